"""SwiGLU ``silu(a) * b`` and bias-SwiGLU ``silu(a + bias_a) * (b + bias_b)``, fused.

Ops (forward / fused backward):
  mxgraph::swiglu(a, b) -> out
  mxgraph::swiglu_backward(grad, a, b) -> (grad_a, grad_b)
  mxgraph::bias_swiglu(a, b, bias_a, bias_b) -> out
  mxgraph::bias_swiglu_backward(grad, a, b, bias_a, bias_b) -> (grad_a, grad_b, grad_bias_a, grad_bias_b)

``a`` and ``b`` share one shape ``[..., N]``; biases are ``[N]``. Math runs in fp32, outputs
take ``a``'s dtype (bias gradients take the bias dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common

BLOCK = 1024


# --------------------------------------------------------------------------- reference
def _biased(a: Tensor, b: Tensor, bias_a: Tensor | None, bias_b: Tensor | None):
    a32, b32 = a.float(), b.float()
    if bias_a is not None:
        a32 = a32 + bias_a.float()
        b32 = b32 + bias_b.float()
    return a32, b32


def swiglu_reference(a: Tensor, b: Tensor, bias_a: Tensor | None = None, bias_b: Tensor | None = None) -> Tensor:
    a32, b32 = _biased(a, b, bias_a, bias_b)
    return (F.silu(a32) * b32).to(a.dtype)


def swiglu_backward_reference(grad: Tensor, a: Tensor, b: Tensor, bias_a: Tensor | None = None,
                              bias_b: Tensor | None = None):
    """Returns (grad_a, grad_b) or, with biases, (grad_a, grad_b, grad_bias_a, grad_bias_b).

    The ATen calls eager autograd makes for ``F.silu(a) * b`` (see the package docstring)."""
    a32, b32 = _biased(a, b, bias_a, bias_b)
    g = grad.float()
    da = torch.ops.aten.silu_backward(g * b32, a32)
    db = g * F.silu(a32)
    if bias_a is None:
        return da.to(a.dtype), db.to(b.dtype)
    return (da.to(a.dtype), db.to(b.dtype), _common.sum_to_last_dim(da).to(bias_a.dtype),
            _common.sum_to_last_dim(db).to(bias_b.dtype))


# --------------------------------------------------------------------------- triton
@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, bias_a_ptr, bias_b_ptr, out_ptr, numel, N,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        col = offs % N
        a += tl.load(bias_a_ptr + col, mask=mask, other=0.0).to(tl.float32)
        b += tl.load(bias_b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(out_ptr + offs, (a * sig * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, a_ptr, b_ptr, bias_a_ptr, bias_b_ptr, da_ptr, db_ptr, part_a_ptr, part_b_ptr, M, N,
                       HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A [BLOCK_R, BLOCK_C] tile of da, db; with biases also its fp32 column sums (bias-grad
    partials, one row of ``part_*`` per row-block)."""
    pid_r = tl.program_id(0)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(bias_a_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        b += tl.load(bias_b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    sig = 1.0 / (1.0 + tl.exp(-a))
    da = g * b * sig * (1.0 + a * (1.0 - sig))
    db = g * a * sig
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        part = pid_r.to(tl.int64) * N + cols
        tl.store(part_a_ptr + part, tl.sum(tl.where(mask, da, 0.0), axis=0), mask=cols < N)
        tl.store(part_b_ptr + part, tl.sum(tl.where(mask, db, 0.0), axis=0), mask=cols < N)


def swiglu_triton(a: Tensor, b: Tensor, bias_a: Tensor | None = None, bias_b: Tensor | None = None) -> Tensor:
    a, b = a.contiguous(), b.contiguous()
    out = _common.new_output_like(a)
    numel, n = a.numel(), a.shape[-1]
    has_bias = bias_a is not None
    bias_a = bias_a.contiguous() if has_bias else a
    bias_b = bias_b.contiguous() if has_bias else a
    if numel:
        _common.on(_swiglu_fwd_kernel, a.device)[(triton.cdiv(numel, BLOCK),)](
            a, b, bias_a, bias_b, out, numel, n, HAS_BIAS=has_bias, BLOCK=BLOCK)
    return out


def swiglu_backward_triton(grad: Tensor, a: Tensor, b: Tensor, bias_a: Tensor | None = None,
                           bias_b: Tensor | None = None):
    grad, a, b = grad.contiguous(), a.contiguous(), b.contiguous()
    da, db = _common.new_output_like(a), _common.new_output_like(b)
    n = a.shape[-1]
    m = a.numel() // max(n, 1)
    has_bias = bias_a is not None
    block_r, block_c = _common.row_tiles(n)
    grid = (triton.cdiv(m, block_r), triton.cdiv(n, block_c))
    parts = [_common.new_output((grid[0], n), dtype=torch.float32, device=a.device)
             for _ in range(2 if has_bias else 0)]
    if m and n:
        _common.on(_swiglu_bwd_kernel, a.device)[grid](
            grad, a, b, bias_a.contiguous() if has_bias else a, bias_b.contiguous() if has_bias else a, da, db,
            *(parts or (a, a)), m, n, HAS_BIAS=has_bias, BLOCK_R=block_r, BLOCK_C=block_c)
    if not has_bias:
        return da, db
    return da, db, parts[0].sum(0).to(bias_a.dtype), parts[1].sum(0).to(bias_b.dtype)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::swiglu", mutates_args=())
def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b``."""
    impl = swiglu_triton if _common.use_triton(a) else swiglu_reference
    return _common.contiguous_outputs(impl(a, b))


@swiglu.register_fake
def _(a, b):
    return a.new_empty(a.shape)


@torch.library.custom_op("mxgraph::swiglu_backward", mutates_args=())
def swiglu_backward(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    impl = swiglu_backward_triton if _common.use_triton(a) else swiglu_backward_reference
    return _common.contiguous_outputs(impl(grad, a, b))


@swiglu_backward.register_fake
def _(grad, a, b):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, grad):
    a, b = ctx.saved_tensors
    return tuple(torch.ops.mxgraph.swiglu_backward(grad, a, b))


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


@torch.library.custom_op("mxgraph::bias_swiglu", mutates_args=())
def bias_swiglu(a: Tensor, b: Tensor, bias_a: Tensor, bias_b: Tensor) -> Tensor:
    """``silu(a + bias_a) * (b + bias_b)``."""
    impl = swiglu_triton if _common.use_triton(a) else swiglu_reference
    return _common.contiguous_outputs(impl(a, b, bias_a, bias_b))


@bias_swiglu.register_fake
def _(a, b, bias_a, bias_b):
    return a.new_empty(a.shape)


@torch.library.custom_op("mxgraph::bias_swiglu_backward", mutates_args=())
def bias_swiglu_backward(grad: Tensor, a: Tensor, b: Tensor, bias_a: Tensor,
                         bias_b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = swiglu_backward_triton if _common.use_triton(a) else swiglu_backward_reference
    return _common.contiguous_outputs(impl(grad, a, b, bias_a, bias_b))


@bias_swiglu_backward.register_fake
def _(grad, a, b, bias_a, bias_b):
    return (a.new_empty(a.shape), b.new_empty(b.shape), bias_a.new_empty(bias_a.shape),
            bias_b.new_empty(bias_b.shape))


def _bias_swiglu_bwd(ctx, grad):
    a, b, bias_a, bias_b = ctx.saved_tensors
    return tuple(torch.ops.mxgraph.bias_swiglu_backward(grad, a, b, bias_a, bias_b))


bias_swiglu.register_autograd(_bias_swiglu_bwd, setup_context=_swiglu_setup)
