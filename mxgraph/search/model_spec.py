"""TOML model files: a model config that is no preset, read into a models config (the
command line's `--model` is resolved by `mxgraph.train.model_spec.resolve_model`, which
calls `load_model_file` for one).

A TOML model file names its family and that family's config fields, e.g.

    family = "llama"          # "gpt", "llama" or "moe"
    vocab_size = 32000
    dim = 4096
    n_layers = 32
    n_heads = 32
    n_kv_heads = 8
    ffn_dim = 14336
    max_seq_len = 8192

`REQUIRED` lists the fields a file must give per family (the shape); the rest take the
config's defaults. The model library (`models`) is passed in by the caller
(`mxgraph.train.model_spec`): the search package builds models only through it.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import tomllib

from mxgraph.errors import UserError

REQUIRED = {
    "gpt": ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"),
    "llama": ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"),
    "moe": ("vocab_size", "dim", "n_layers", "n_heads", "n_dense_layers", "moe_ffn_dim",
            "n_routed_experts", "topk"),
}
CONFIG_CLASSES = {"gpt": "GPTConfig", "llama": "LlamaConfig", "moe": "MoEConfig"}


def load_model_file(path: str, library):
    """The config of the TOML model file `path`; UserError for a missing file, bad TOML, or
    what `model_from_dict` refuses."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"model file {path} does not exist; pass a preset name or a TOML "
                        f"model file") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"model file {path} is not valid TOML: {error}") from None
    return model_from_dict(data, f"model file {path}", library)


def model_from_dict(data: dict, source: str, library):
    """The config of a model table (`family` plus that family's config fields), as a model
    file holds it; `source` names the table in errors ("model file x.toml")."""
    data = dict(data)
    family = data.pop("family", None)
    if family not in REQUIRED:
        raise UserError(f"{source}: family = {family!r}; set family to one of "
                        f"{', '.join(repr(f) for f in REQUIRED)}")
    cls = getattr(library, CONFIG_CLASSES[family])
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"fields: {', '.join(sorted(fields))}"
            raise UserError(f"{source}: {key!r} is no field of {cls.__name__}; {hint}")
    missing = [key for key in REQUIRED[family] if key not in data]
    if missing:
        raise UserError(f"{source} misses the field {missing[0]!r} (a {family} "
                        f"model needs {', '.join(REQUIRED[family])})")
    try:
        return cls(**data)
    except (TypeError, ValueError) as error:
        raise UserError(f"{source}: {error}") from None
