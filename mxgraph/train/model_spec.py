"""`--model`, resolved once for every command that takes it: `resolve_model(text,
model_config, command)` -> `ModelSpec`.

A `--model` string is one of five kinds (`mxgraph.hf.models.model_kind` tells them apart
by spelling, so that `export` can read the one a checkpoint records):

    preset        llama-tiny                a name of `models` (`models.list_presets()`)
    model_file    m.toml                    family = "llama" plus its config fields
                                            (`mxgraph.search.model_spec.load_model_file`)
    hf            hf:llama                  transformers' defaults of a model_type
    hf_config     path/config.json          a Hugging Face config file
    pretrained    path/to/dir               config.json + model.safetensors (or its index)

`TAKES` says which kinds each command takes; another kind is a one-line UserError naming
what the command takes. `--model-config key=value,...` overrides the config: a preset's or
model file's config is resolved here (the overrides applied, each key checked); a Hugging
Face config is read when asked for (`ModelSpec.hf_config`: it needs transformers).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import models
from mxgraph.errors import UserError
from mxgraph.hf.files import CONFIG, WEIGHTS
from mxgraph.hf.models import HF_KINDS, ModelKind, hf_config, model_kind, parse_overrides
from mxgraph.search.model_spec import load_model_file

TAKES: dict[str, tuple[ModelKind, ...]] = {
    "train": ("preset", "hf", "hf_config", "pretrained"),
    "search": ("preset", "model_file"),  # it prices `models` configs
    "inspect --memory": ("preset",),
    "inspect --comm": ("preset",),
}
"""The kinds of `--model` each command takes."""
KIND_NAMES: dict[ModelKind, str] = {
    "preset": "a preset",
    "model_file": "a TOML model file",
    "hf": "a Hugging Face model_type (hf:<model_type>)",
    "hf_config": "a Hugging Face config.json",
    "pretrained": f"a model directory ({CONFIG} + {WEIGHTS})",
}
"""Each kind in the user's words (errors name them)."""
MODEL_FILE_HINT = "or pass a TOML model file (family = \"llama\" plus its config fields)"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A `--model` resolved: its kind and what building, pricing or exporting it needs."""

    kind: ModelKind
    name: str
    """`--model` as given; errors name the model by it."""
    overrides: dict = field(default_factory=dict)
    """`--model-config`, parsed (`mxgraph.hf.models.parse_overrides`)."""
    config: object | None = None
    """preset, model_file: the `models` config, the overrides applied."""
    config_source: str | None = None
    """hf, hf_config, pretrained: what `mxgraph.hf.models.hf_config` reads (hf:<model_type>,
    or the config.json path)."""
    directory: str | None = None
    """pretrained: the model directory (its weights, and tokenizer files if any)."""

    @property
    def is_hf(self) -> bool:
        return self.kind in HF_KINDS

    def hf_config(self):
        """The transformers config with the overrides (UserError for a missing
        transformers, a bad file, model_type or override)."""
        assert self.is_hf, self.kind
        return hf_config(self.config_source, self.overrides)  # mxgraph.hf.models

    def vocab_size(self) -> int:
        """The model's vocabulary, from its config alone: no model is built."""
        return self.hf_config().vocab_size if self.is_hf else self.config.vocab_size


def resolve_model(text: str, model_config: str | None = None, *, command: str) -> ModelSpec:
    """`--model text` (with `--model-config model_config`) for `command` (a key of
    `TAKES`). UserError naming what the command takes for another kind; for an unknown
    preset (the known ones), a model file that is missing or wrong, an override that is no
    field of a preset's config."""
    kind, takes = model_kind(text), TAKES[command]
    if kind not in takes:
        raise UserError(f"--model {text} is {KIND_NAMES[kind]}; mxgraph {command} takes "
                        f"{_either(takes)}")
    overrides = parse_overrides(model_config)
    if kind == "pretrained":
        return ModelSpec(kind=kind, name=text, overrides=overrides, directory=text,
                         config_source=os.path.join(text, CONFIG))
    if kind in HF_KINDS:
        return ModelSpec(kind=kind, name=text, overrides=overrides, config_source=text)
    config = load_model_file(text, models) if kind == "model_file" else \
        _preset_config(text, takes)
    return ModelSpec(kind=kind, name=text, overrides=overrides,
                     config=_with_overrides(config, overrides, text))


def _preset_config(name: str, takes: tuple[ModelKind, ...]):
    try:
        return models.preset_config(name)
    except models.UnknownPresetError as error:
        if "pretrained" in takes and os.path.isdir(name):
            raise UserError(f"--model {name} is a directory without {CONFIG}; a pretrained "
                            f"model directory holds {CONFIG} and {WEIGHTS} (save it "
                            f"with save_pretrained(DIR))") from None
        hint = f"; {MODEL_FILE_HINT}" if "model_file" in takes else ""
        raise UserError(f"{error}{hint}") from None


def _with_overrides(config, overrides: dict, name: str):
    """`config` with `overrides`; UserError naming a key that is no field of it."""
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = [key for key in overrides if key not in fields]
    if unknown:
        raise UserError(f"--model-config {unknown[0]} is no field of {name}'s "
                        f"{type(config).__name__}; its fields: {', '.join(fields)}")
    try:
        return dataclasses.replace(config, **overrides)
    except (TypeError, ValueError) as error:
        raise UserError(f"--model-config for {name}: {error}") from None


def _either(kinds: tuple[ModelKind, ...]) -> str:
    names = [KIND_NAMES[kind] for kind in kinds]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
