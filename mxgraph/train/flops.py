"""Model FLOPs per token, counted from the ops a model runs (MFU's numerator).

    per_token = model_flops_per_token(model, tokens, seq_len)   # forward + backward

The count is the usual one of PaLM (appendix B) and Megatron-LM: 6 x the parameters a
token's matmuls use + 12 x layers x attention width x seq_len, i.e. 3 x the forward's matmul
and attention FLOPs (the backward does twice the forward's), with attention counted whole
(no halving for the causal mask), norms, activations and the embedding lookup not at all.

It is measured, not read from a config: the model's own forward runs once (eval mode, no
gradients, the random state put back) on a short real sequence under `ForwardFlops`, a
dispatch mode that adds up the FLOPs of every matmul and attention op by the rules in
`FLOP_RULES` (keyed by op; 2 FLOPs per multiply-add). So any model is counted as it is
written (Hugging Face or preset, tied or not, GQA, MLA), and a routed MoE as routed: each
token's rows go through its top-k experts only, so only the active experts count. A Python
custom op (`torch.library.custom_op`: grouped expert GEMMs) is opened and its own ops are
counted; another op outside aten is listed in `ForwardFlops.uncounted`.

Per token, the matmuls cost the same at every length and attention grows linearly with it,
so two short sequences (8 and 16 tokens) give the count at `seq_len` exactly by a straight
line; a model that pads experts to a capacity computed from the sequence length (a
model-level capacity factor) counts its padded rows, at those short lengths.
"""
from __future__ import annotations

import math
import random
from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SHORT_LENGTHS = (8, 16)
"""Sequence lengths the forward is measured at (when `seq_len` is longer)."""

FLOP_RULES: dict[object, Callable[..., int]] = {}
"""Op packet -> `fn(args, kwargs) -> FLOPs` of one call (real tensors)."""


def flop_rule(*packets):
    """Register `fn(args, kwargs) -> flops` for these op packets."""
    def register(fn):
        for packet in packets:
            FLOP_RULES[packet] = fn
        return fn
    return register


@flop_rule(aten.mm)
def _mm_rule(args, kwargs) -> int:
    a, b = args[:2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


@flop_rule(aten.addmm)
def _addmm_rule(args, kwargs) -> int:
    return _mm_rule(args[1:], kwargs)


@flop_rule(aten.bmm)
def _bmm_rule(args, kwargs) -> int:
    a, b = args[:2]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


@flop_rule(aten.baddbmm)
def _baddbmm_rule(args, kwargs) -> int:
    return _bmm_rule(args[1:], kwargs)


@flop_rule(aten._grouped_mm)
def _grouped_mm_rule(args, kwargs) -> int:
    # a [rows, K] sorted by group and b [G, K, N] with offs (cumulative row ends): the rows
    # up to offs[-1] meet one group each; else a batched product over the leading dim
    a, b = args[:2]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if a.dim() == 2 and b.dim() == 3 and offs is not None:
        return 2 * int(offs[-1]) * a.shape[1] * b.shape[2]
    return 2 * a.numel() * b.shape[-1]


@flop_rule(aten._scaled_dot_product_flash_attention_for_cpu,
           aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
           aten._scaled_dot_product_cudnn_attention)
def _attention_rule(args, kwargs) -> int:
    # q [B, H, S, Dqk], k [B, Hkv, Skv, Dqk], v [B, Hkv, Skv, Dv]: QK^T and PV for every
    # query head, the causal mask not subtracted (PaLM's and Megatron's convention)
    q, k, v = args[:3]
    return 2 * (q.numel() // q.shape[-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])


class ForwardFlops(TorchDispatchMode):
    """Adds up the matmul and attention FLOPs (`FLOP_RULES`) of the ops run inside it."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.uncounted: set[str] = set()
        """Ops outside aten that are no Python custom op (their FLOPs are not known)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = FLOP_RULES.get(func.overloadpacket)
        if rule is None and func.namespace not in ("aten", "prim", "prims"):
            self.uncounted.add(str(func))
        out = func(*args, **kwargs)
        if rule is not None:
            self.flops += int(rule(args, kwargs))
        return out


class OpenCustomOps(TorchFunctionMode):
    """Runs a Python custom op (`torch.library.custom_op`) as its own Python function, so
    that a dispatch mode around it sees the ops inside (a dispatch mode sees the custom op
    as one op, and cannot look inside it from there)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverloadPacket):
            opdef = _maybe_get_opdef(func._qualified_op_name)
        elif isinstance(func, torch._ops.OpOverload):
            opdef = _maybe_get_opdef(func)
        else:
            opdef = None
        if opdef is not None:
            return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def preserved_rng():
    """Run the body and put back the random states it may draw from: torch's (CPU and the
    current CUDA device), Python's `random` and NumPy's; so code run between training steps
    (validation, compiling its program, this count) changes no later dropout or draw."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = [torch.cuda.current_device()] if cuda else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def forward_flops(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                  ) -> ForwardFlops:
    """The counted forward `model(inputs, targets)` (eval mode, no gradients, the model's
    mode and the random state put back)."""
    was_training = model.training
    model.eval()
    counter = ForwardFlops()
    try:
        with preserved_rng(), torch.no_grad(), counter, OpenCustomOps():
            model(inputs, targets)
    finally:
        model.train(was_training)
    return counter


def model_flops_per_token(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int
                          ) -> tuple[float, list[str]]:
    """(Model FLOPs of one token's forward and backward at sequence length `seq_len`, the
    ops that were not counted): measured on the first tokens of `tokens` (1-D token ids,
    at least min(seq_len, 16) + 1) at `SHORT_LENGTHS` and extended to `seq_len` along the
    straight line (module docstring)."""
    device = next(model.parameters()).device
    lengths = (seq_len,) if seq_len <= SHORT_LENGTHS[-1] else SHORT_LENGTHS
    per_token, uncounted = [], set()
    for length in lengths:
        window = tokens[:length + 1].to(device=device, dtype=torch.long)[None]
        counted = forward_flops(model, window[:, :-1], window[:, 1:])
        per_token.append(3 * counted.flops / length)
        uncounted |= counted.uncounted
    if len(lengths) == 1:
        return per_token[0], sorted(uncounted)
    slope = (per_token[1] - per_token[0]) / (lengths[1] - lengths[0])
    return per_token[0] + slope * (seq_len - lengths[0]), sorted(uncounted)


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_flops` (both for the same
    set of devices); NaN without a peak."""
    if not peak_flops or not math.isfinite(peak_flops):
        return float("nan")
    return flops_per_token * tokens_per_s / peak_flops
