"""Bias-GELU ``gelu(x + bias)``, erf (``approximate="none"``) or tanh form, fused.

Ops:
  mxgraph::bias_gelu(x, bias, approximate) -> out
  mxgraph::bias_gelu_backward(grad, x, bias, approximate) -> (grad_x, grad_bias)

``x`` is ``[..., N]``, ``bias`` is ``[N]``. Math in fp32; outputs take ``x``'s dtype (the
bias gradient takes ``bias``'s dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common

BLOCK = 1024


def _check(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


# --------------------------------------------------------------------------- reference
def bias_gelu_reference(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    _check(approximate)
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


def bias_gelu_backward_reference(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none"):
    """The ATen calls eager autograd makes for ``F.gelu(x + bias)`` (see the package docstring)."""
    _check(approximate)
    dx = torch.ops.aten.gelu_backward(grad.float(), x.float() + bias.float(), approximate=approximate)
    return dx.to(x.dtype), _common.sum_to_last_dim(dx).to(bias.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _bias_gelu_fwd_kernel(x_ptr, bias_ptr, out_ptr, numel, N, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        # tanh(u) without libdevice, free of cancellation where |tanh(u)| is close to 1
        e = tl.exp(-2.0 * tl.abs(u))
        y = 0.5 * h * tl.where(u >= 0, 2.0 / (1.0 + e), 2.0 * e / (1.0 + e))
    else:
        y = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(g_ptr, x_ptr, bias_ptr, dx_ptr, part_ptr, M, N, TANH: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A [BLOCK_R, BLOCK_C] tile of dx and its fp32 column sums (one row of bias-grad partials
    per row-block)."""
    pid_r = tl.program_id(0)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if TANH:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        e = tl.exp(-2.0 * tl.abs(u))
        one_plus_t = tl.where(u >= 0, 2.0 / (1.0 + e), 2.0 * e / (1.0 + e))
        sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
        d = 0.5 * one_plus_t + 0.5 * h * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
    else:
        d = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476)) + h * tl.exp(-0.5 * h * h) * 0.3989422804014327
    dx = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * d
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(part_ptr + pid_r.to(tl.int64) * N + cols, tl.sum(tl.where(mask, dx, 0.0), axis=0), mask=cols < N)


def bias_gelu_triton(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    _check(approximate)
    x, bias = x.contiguous(), bias.contiguous()
    out = _common.new_output_like(x)
    numel = x.numel()
    if numel:
        _common.on(_bias_gelu_fwd_kernel, x.device)[(triton.cdiv(numel, BLOCK),)](
            x, bias, out, numel, x.shape[-1], TANH=approximate == "tanh", BLOCK=BLOCK)
    return out


def bias_gelu_backward_triton(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none"):
    _check(approximate)
    grad, x, bias = grad.contiguous(), x.contiguous(), bias.contiguous()
    dx = _common.new_output_like(x)
    n = x.shape[-1]
    m = x.numel() // max(n, 1)
    block_r, block_c = _common.row_tiles(n)
    grid = (triton.cdiv(m, block_r), triton.cdiv(n, block_c))
    part = _common.new_output((grid[0], n), dtype=torch.float32, device=x.device)
    if m and n:
        _common.on(_bias_gelu_bwd_kernel, x.device)[grid](
            grad, x, bias, dx, part, m, n, TANH=approximate == "tanh", BLOCK_R=block_r, BLOCK_C=block_c)
    return dx, part.sum(0).to(bias.dtype)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x + bias, approximate=approximate)``."""
    impl = bias_gelu_triton if _common.use_triton(x) else bias_gelu_reference
    return _common.contiguous_outputs(impl(x, bias, approximate))


@bias_gelu.register_fake
def _(x, bias, approximate="none"):
    _check(approximate)
    return x.new_empty(x.shape)


@torch.library.custom_op("mxgraph::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    impl = bias_gelu_backward_triton if _common.use_triton(x) else bias_gelu_backward_reference
    return _common.contiguous_outputs(impl(grad, x, bias, approximate))


@bias_gelu_backward.register_fake
def _(grad, x, bias, approximate="none"):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bwd(ctx, grad):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.mxgraph.bias_gelu_backward(grad, x, bias, ctx.approximate)
    return dx, dbias, None


bias_gelu.register_autograd(_bwd, setup_context=_setup)
