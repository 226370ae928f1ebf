"""Model FLOPs per token, counted from the ops a model runs (MFU's numerator).

    per_token = model_flops_per_token(model, tokens, seq_len)   # forward + backward

The count is model FLOPs as `mxgraph.cost` defines them (its docstring states the convention,
PaLM's and Megatron-LM's; `cost.model_flops`), of the forward, x 3 for forward and backward
(the backward does twice the forward's): for a dense transformer, 6 x the parameters a
token's matmuls use + 12 x layers x attention width x seq_len.

It is measured, not read from a config: the model's own forward runs once (eval mode, no
gradients, the random state put back) on a short real sequence under `ForwardFlops`, a
dispatch mode that adds up `cost.model_flops` of every op it runs, by the rules of
`cost.FLOP_RULES` (keyed by op). So any model is counted as it is written (Hugging Face or
preset, tied or not, GQA, MLA), and a routed MoE as routed: each token's rows go through its
top-k experts only, so only the active experts count. A Python custom op
(`torch.library.custom_op`: grouped expert GEMMs) is opened and its own ops are counted;
another op outside aten is listed in `ForwardFlops.uncounted`.

Per token, the matmuls cost the same at every length and attention grows linearly with it,
so two short sequences (8 and 16 tokens) give the count at `seq_len` exactly by a straight
line; a model that pads experts to a capacity computed from the sequence length (a
model-level capacity factor) counts its padded rows, at those short lengths.
"""
from __future__ import annotations

import math
import random
from contextlib import contextmanager

import numpy as np
import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mxgraph.cost import FLOP_RULES, OpCall, model_flops, tensor_meta

SHORT_LENGTHS = (8, 16)
"""Sequence lengths the forward is measured at (when `seq_len` is longer)."""


class ForwardFlops(TorchDispatchMode):
    """Adds up the model FLOPs (`cost.model_flops`: matmuls and attention) of the ops run
    inside it."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.uncounted: set[str] = set()
        """Ops outside aten that are no Python custom op (their FLOPs are not known)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in FLOP_RULES and func.namespace not in (
                "aten", "prim", "prims"):
            self.uncounted.add(str(func))
        out = func(*args, **kwargs)
        self.flops += model_flops(OpCall(func, args, kwargs, tensor_meta(out)))
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
