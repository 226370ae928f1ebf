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


def contiguous_outputs(result):
    """An op's outputs made contiguous, as its fake implementation declares them: the plain-torch
    references keep a non-contiguous input's layout, and a compiled graph that views an output
    (``aten.view``) relies on the strides the fake promised."""
    if isinstance(result, torch.Tensor):
        return result.contiguous()
    return tuple(r.contiguous() if isinstance(r, torch.Tensor) else r for r in result)


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

    On the CPU (tests) kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
    in the environment before ``triton`` is first imported (Triton's own ``tl.sum``,
    ``tl.max``, ... are built then). A kernel of this package imported earlier than that is
    wrapped here, so test order does not matter. Kernels must not call other
    ``@triton.jit`` functions: the interpreter cannot follow such calls from a wrapped kernel.
    """
    if device.type != "cpu":
        return kernel
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.sum, InterpretedFunction):
        raise RuntimeError("Triton kernels on CPU tensors run in Triton's interpreter: set TRITON_INTERPRET=1 in "
                           "the environment before triton is first imported")
    if isinstance(kernel, InterpretedFunction):
        return kernel
    key = id(kernel)
    if key not in _interpreted:
        _interpreted[key] = InterpretedFunction(kernel.fn)
    return _interpreted[key]


def num_warps_for(block_elems: int) -> int:
    """Warps for a program that holds ``block_elems`` values of one row in registers."""
    return 4 if block_elems <= 2048 else 8 if block_elems <= 8192 else 16


def row_tiles(n_cols: int, elems: int = 2048) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)`` for kernels that tile ``[rows, n_cols]`` to reduce over rows."""
    block_c = min(128, block_for(n_cols, lo=16))
    return max(1, elems // block_c), block_c
