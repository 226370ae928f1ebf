"""Bias-GELU ``gelu(x + bias)``, erf (``approximate="none"``) or tanh form, fused.

Ops:
  mxgraph::bias_gelu(x, bias, approximate) -> out
  mxgraph::bias_gelu_backward(grad, x, bias, approximate) -> (grad_x, grad_bias)

``x`` is ``[..., N]``, ``bias`` is ``[N]``. Math in fp32; outputs take ``x``'s dtype (the
bias gradient takes ``bias``'s dtype).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common

BLOCK = 1024
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


# --------------------------------------------------------------------------- reference
def bias_gelu_reference(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    _check(approximate)
    h = x.float() + bias.float()
    if approximate == "tanh":
        y = 0.5 * h * (1 + torch.tanh(_SQRT_2_OVER_PI * (h + 0.044715 * h * h * h)))
    else:
        y = 0.5 * h * (1 + torch.erf(h * _INV_SQRT_2))
    return y.to(x.dtype)


def bias_gelu_backward_reference(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none"):
    _check(approximate)
    h = x.float() + bias.float()
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (h + 0.044715 * h * h * h))
        d = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * h * h)
    else:
        d = 0.5 * (1 + torch.erf(h * _INV_SQRT_2)) + h * torch.exp(-0.5 * h * h) * _INV_SQRT_2PI
    dx = grad.float() * d
    return dx.to(x.dtype), _common.sum_to_last_dim(dx).to(bias.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _bias_gelu_kernel(x_ptr, bias_ptr, g_ptr, out_ptr, numel, N, BACKWARD: tl.constexpr,
                      TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        # tanh(u) without libdevice, free of cancellation where |tanh(u)| is close to 1
        e = tl.exp(-2.0 * tl.abs(u))
        one_plus_t = tl.where(u >= 0, 2.0 / (1.0 + e), 2.0 * e / (1.0 + e))
        if BACKWARD:
            sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
            d = 0.5 * one_plus_t + 0.5 * h * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
        else:
            y = 0.5 * h * one_plus_t
    else:
        e = tl.math.erf(h * 0.7071067811865476)
        if BACKWARD:
            d = 0.5 * (1.0 + e) + h * tl.exp(-0.5 * h * h) * 0.3989422804014327
        else:
            y = 0.5 * h * (1.0 + e)
    if BACKWARD:
        y = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * d
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, bias, grad, approximate, backward):
    _check(approximate)
    x, bias = x.contiguous(), bias.contiguous()
    grad = grad.contiguous() if grad is not None else x
    out = _common.new_output_like(x)
    numel = x.numel()
    _common.on(_bias_gelu_kernel, x.device)[(triton.cdiv(numel, BLOCK),)](
        x, bias, grad, out, numel, x.shape[-1], BACKWARD=backward, TANH=approximate == "tanh", BLOCK=BLOCK)
    return out


def bias_gelu_triton(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    return _launch(x, bias, None, approximate, backward=False)


def bias_gelu_backward_triton(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none"):
    dx = _launch(x, bias, grad, approximate, backward=True)
    return dx, _common.sum_to_last_dim(dx).to(bias.dtype)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x + bias, approximate=approximate)``."""
    impl = bias_gelu_triton if _common.use_triton(x) else bias_gelu_reference
    return impl(x, bias, approximate)


@bias_gelu.register_fake
def _(x, bias, approximate="none"):
    _check(approximate)
    return x.new_empty(x.shape)


@torch.library.custom_op("mxgraph::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    impl = bias_gelu_backward_triton if _common.use_triton(x) else bias_gelu_backward_reference
    return impl(grad, x, bias, approximate)


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
