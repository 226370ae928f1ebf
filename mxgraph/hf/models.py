"""Hugging Face transformers causal LMs as mxgraph models (`pip install mxgraph[hf]`).

    model = build_hf_model("hf:llama", {"hidden_size": 64, "num_hidden_layers": 2})
    step = mxgraph.compile(model, plan)        # model(tokens, targets) -> loss

A spec is `hf:<model_type>` (a key of transformers' `CONFIG_MAPPING`: the config class's
defaults, i.e. the full-size model, changed by the overrides) or the path of a
`config.json`. The model is built from the config with random weights
(`AutoModelForCausalLM.from_config`); nothing is downloaded. With `pretrained.py`
(weights in) and `token_file.py` (tokenizers), the only modules of mxgraph that import
`transformers`, and only inside functions.

The config keeps every default but the overrides: transformers' choice of attention
("sdpa" where the family has it, else "eager"; both trace with `torch.export`), and
`use_cache` (True for most families: the forward then builds a KV cache it throws away, and
the passes take its concatenations as they come). `mxgraph train` turns the cache off for
its own runs (`train.build_training_model`).

MoE experts (`config._experts_implementation`, transformers/integrations/moe.py) keep the
transformers default, "grouped_mm", for the families whose experts class has
`@use_experts_implementation` (Mixtral, Qwen2-MoE, ...): tokens sorted by expert, then a
grouped GEMM. Under torch.export it is `aten._grouped_mm` in bf16 and transformers' own
custom op `transformers::grouped_mm_fallback` in fp32 (with its autograd formula); both
trace, in fp32 too, with the same loss and gradients as eager. "batched_mm" (gather each
token's expert weights, `bmm`) traces as well. "eager" (a Python loop over the experts
hit) does not: `GuardOnDataDependentSymNode: Could not guard on data-dependent expression
Eq(u0, 0)` (the loop's length is data-dependent). Choose one with
`experts_implementation=batched_mm` among the overrides.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from mxgraph.errors import UserError
from mxgraph.hf.files import HF_INSTALL_HINT, is_model_dir

HF_PREFIX = "hf:"
ModelKind = Literal["preset", "model_file", "hf", "hf_config", "pretrained"]
"""What a `--model` string names (`model_kind`)."""
HF_KINDS: tuple[ModelKind, ...] = ("hf", "hf_config", "pretrained")
"""The kinds that are transformers models (`hf_config` reads their config)."""

_TINY_COMMON = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 128,
                "max_position_embeddings": 64, "attention_dropout": 0.0,
                "bos_token_id": 0, "eos_token_id": 0}
_TINY_MOE = {"num_experts_per_tok": 2}
TINY: dict[str, dict] = {
    "llama": {**_TINY_COMMON, "num_key_value_heads": 2},
    "gpt2": {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128,
             "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "bos_token_id": 0, "eos_token_id": 0},
    "mixtral": {**_TINY_COMMON, **_TINY_MOE, "num_key_value_heads": 2,
                "num_local_experts": 4},
    "qwen2_moe": {**_TINY_COMMON, **_TINY_MOE, "num_key_value_heads": 2, "num_experts": 4,
                  "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
}
"""Tiny configs per family for tests: width 64, 2 layers, 4 heads (2 KV heads with GQA),
vocabulary 256, MLP 128, 64 positions; MoE: 4 experts, top-2 (Qwen2-MoE with its shared
expert); no dropout. Only sizes (and dropout) differ from the families' defaults: the cache,
the attention implementation and the router options stay as a user gets them."""


class HFCausalLM(nn.Module):
    """A transformers `*ForCausalLM` (submodule `model`, so parameters are named
    `model.<hf name>`) whose forward is mxgraph's: `(tokens, targets) -> loss`.

    `targets` are already shifted (`targets[:, t] = tokens[:, t + 1]`, as mxgraph's data
    gives them), so the loss is taken from the logits here, not through HF's `labels=`
    (which shifts again). It is the mean cross-entropy over every token in float32 (ignore
    index -100), as the presets' `lm_loss`: the log-softmax over the vocabulary in bf16
    would lose about three significant digits of the loss, and HF's own loss upcasts too.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.model = hf_model
        self.config = hf_model.config
        self.vocab_size: int = hf_model.config.vocab_size

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits_BSV = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels.flatten())


def model_kind(spec: str) -> ModelKind:
    """What `--model spec` names, by its spelling and what lies at that path: "pretrained"
    (a directory holding config.json), "hf" (`hf:<model_type>`), "hf_config" (a .json
    file: a Hugging Face config.json), "model_file" (a .toml file, or another existing
    file: a TOML model file of `mxgraph.search.model_spec`), else "preset" (a name of
    `models`). Only classifies (nothing is read); `mxgraph.train.model_spec.resolve_model`
    resolves a spec for a command, and `export` reads the one a checkpoint records."""
    if is_model_dir(spec):
        return "pretrained"
    if spec.startswith(HF_PREFIX):
        return "hf"
    if spec.endswith(".json"):
        return "hf_config"
    if spec.endswith(".toml") or os.path.isfile(spec):
        return "model_file"
    return "preset"


def parse_overrides(text: str | None) -> dict:
    """`"hidden_size=64,tie_word_embeddings=false,hidden_act=gelu"` -> a dict of ints,
    floats, bools (true/false), None (none/null) and strings; UserError if malformed."""
    overrides = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(f"--model-config item {item.strip()!r} is not key=value; write "
                            f"e.g. hidden_size=64,num_hidden_layers=2")
        overrides[key] = _parse_value(value.strip())
    return overrides


def _parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(f"Hugging Face models need the transformers package: "
                        f"{HF_INSTALL_HINT}") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise UserError(f"Hugging Face models need transformers>=5, found "
                        f"{transformers.__version__}: {HF_INSTALL_HINT}")
    return transformers


def hf_config(spec: str, overrides: dict | None = None):
    """The transformers config of `spec` with `overrides` applied (no model is built, so
    this is the cheap check the CLI runs first). UserError for a missing transformers, an
    unknown model_type, an unreadable config file, an override that is no field of the
    config, or a family without a causal LM."""
    transformers = _transformers()
    from huggingface_hub.errors import StrictDataclassError  # transformers' dependency
    overrides = dict(overrides or {})
    if spec.startswith(HF_PREFIX):
        model_type, fields = spec[len(HF_PREFIX):], {}
    else:
        model_type, fields = _read_config_file(spec)
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=1)
        guess = f"did you mean {close[0]!r}?" if close else \
            "see transformers.CONFIG_MAPPING for the known ones"
        raise UserError(f"unknown Hugging Face model_type {model_type!r}; {guess}")
    # a file's fields go through the same constructor as the overrides (from_pretrained
    # would drop an unknown override and legacy keys such as rope_theta without a word)
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**fields, **overrides})
    except (ValueError, TypeError, StrictDataclassError) as error:  # a field's value
        raise UserError(f"{spec}: {' '.join(str(error).split())}") from None
    _check_override_keys(config, overrides, transformers)
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"Hugging Face model_type {config.model_type!r} has no causal "
                        f"language model (AutoModelForCausalLM); choose a decoder such as "
                        f"llama, gpt2, mixtral or qwen2_moe")
    return config


def _read_config_file(path: str) -> tuple[str, dict]:
    """(model_type, the other fields) of a config.json."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist; --model takes a preset, "
                        f"hf:<model_type> or the path of a Hugging Face config.json")
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: not a JSON file ({error})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise UserError(f"{path} has no \"model_type\"; a Hugging Face config.json names "
                        f"its family, e.g. \"model_type\": \"llama\"")
    return fields.pop("model_type"), fields


def _check_override_keys(config, overrides: dict, transformers) -> None:
    """A key the config keeps as an unknown extra attribute (neither a field of its
    class's defaults nor an alias in `attribute_map`) is a typo: say so, rather than train
    a model that silently ignores it. Init-only keys (`rope_theta`,
    `experts_implementation`) are consumed by the config and pass."""
    default = set(transformers.CONFIG_MAPPING[config.model_type]().to_dict())
    stored = set(config.to_dict())
    unknown = [k for k in overrides
               if k in stored and k not in default and k not in config.attribute_map]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(default), n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"--model-config {unknown[0]} is no field of "
                        f"{type(config).__name__}{guess}")


def build_hf_model(spec: str, overrides: dict | None = None,
                   dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """`HFCausalLM` of `spec` (`hf:<model_type>` or a config.json path) with `overrides`,
    randomly initialised in float32 under the current torch seed, then its floating
    parameters cast to `dtype` (buffers such as RoPE frequencies stay fp32), as the
    presets do."""
    transformers = _transformers()
    config = hf_config(spec, overrides)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for param in hf_model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    hf_model.config.dtype = dtype
    return HFCausalLM(hf_model)

