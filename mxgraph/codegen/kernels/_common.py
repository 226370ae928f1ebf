"""Helpers shared by the fused-kernel modules: output allocation, launch sizes, dispatch.

Debug knob: with ``MXGRAPH_KERNEL_POISON=1`` in the environment, every output that a Triton
path allocates and is meant to overwrite completely starts as NaN (or -1 for integers), so a
kernel that leaves an element unwritten fails its test instead of passing on leftover memory.
"""

from __future__ import annotations

import os

import torch
import triton


def poison_enabled() -> bool:
    return os.environ.get("MXGRAPH_KERNEL_POISON", "0") == "1"


def new_output(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer that the kernel must fill entirely (poisoned when debugging)."""
    if poison_enabled():
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_output_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return new_output(t.shape, dtype=dtype or t.dtype, device=t.device)


def use_triton(*tensors: torch.Tensor) -> bool:
    """The custom ops run their Triton path on ``cuda`` tensors (MXMACA included)."""
    return tensors[0].device.type == "cuda"


def block_for(n: int, lo: int = 16, hi: int = 65536) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def sum_to_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Reduce every dimension but the last (bias gradients), in fp32."""
    return t.reshape(-1, t.shape[-1]).float().sum(0)


_interpreted: dict[int, object] = {}


def on(kernel, device: torch.device):
    """The kernel to launch for tensors on ``device``.

    On the CPU (tests) the kernel runs in Triton's interpreter even when this module was
    imported without ``TRITON_INTERPRET=1``. Kernels must not call other ``@triton.jit``
    functions: the interpreter cannot follow such calls from a compiled-mode kernel.
    """
    if device.type != "cpu":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    key = id(kernel)
    if key not in _interpreted:
        _interpreted[key] = InterpretedFunction(kernel.fn)
    return _interpreted[key]
