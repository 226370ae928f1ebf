"""Reference models for mxgraph: Llama, DeepSeek-V3-style MoE, GPT.

``build_model(name, device=..., dtype=..., **overrides)`` builds a preset (``PRESETS``,
``list_presets()``); ``build_from_config(config, ...)`` builds from a config instance
(``LlamaConfig``, ``MoEConfig``, ``GPTConfig``). Every model has ``.config`` and
``forward(tokens[B, S], targets[B, S]) -> scalar`` mean cross-entropy in nats per token
(fp32, plus the MoE aux loss if configured). Module layout: ``embed``, ``layers``
(an ``nn.ModuleList``), ``norm``, ``lm_head``; see each family's module docstring.
"""

from __future__ import annotations

import dataclasses
import difflib

import torch
import torch.nn as nn

from models.common import cast_params_, count_params
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from models.moe import MoEConfig, MoETransformer
from models.presets import PRESETS, PUBLISHED_PARAMS, list_presets

FAMILIES: dict[str, type[nn.Module]] = {"llama": Llama, "moe": MoETransformer, "gpt": GPT}

__all__ = ["FAMILIES", "GPT", "GPTConfig", "PRESETS", "PUBLISHED_PARAMS", "Llama", "LlamaConfig",
           "MoEConfig", "MoETransformer", "UnknownPresetError",
           "build_model", "build_from_config", "count_params", "list_presets", "preset_config"]


class UnknownPresetError(KeyError):
    """A preset name that is not in ``PRESETS``; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def preset_config(name: str):
    """The config of preset ``name``; ``UnknownPresetError`` naming the known presets."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list_presets(), n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownPresetError(f"unknown model preset {name!r}; {guess}known presets: "
                                 f"{', '.join(list_presets())}")
    return PRESETS[name][1]


def build_from_config(config, *, device="cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the model whose family matches the config's type.

    Parameters are created directly on ``device`` (``"meta"`` allocates nothing) and initialised
    in float32 under the current torch seed, then cast to ``dtype`` (buffers stay float32).
    """
    cls = next((cls for family, cls in FAMILIES.items() if isinstance(config, _config_type(family))), None)
    if cls is None:
        raise TypeError(f"no model family for config type {type(config).__name__}")
    with torch.device(device):
        model = cls(config)
    cast_params_(model, dtype)
    return model


def build_model(name: str, *, device="cpu", dtype: torch.dtype = torch.float32,
                **overrides) -> nn.Module:
    """Build preset ``name``; ``overrides`` replace config fields (e.g. ``n_layers=2``)."""
    config = dataclasses.replace(preset_config(name), **overrides)
    return build_from_config(config, device=device, dtype=dtype)


def _config_type(family: str) -> type:
    return {"llama": LlamaConfig, "moe": MoEConfig, "gpt": GPTConfig}[family]
