"""Bias-Dropout-Add ``residual + dropout(x + bias, p)``, fused, with a recomputable mask.

Ops:
  mxgraph::bias_dropout_add(x, bias?, residual, p, training, seed, offset) -> out
  mxgraph::bias_dropout_add_backward(grad, p, training, seed, offset) -> grad_x

The dropout mask is a pure function of ``(seed, offset, element index)``: element ``i`` of
the flattened ``x`` is kept when ``hash(i + offset, seed) >> 8 >= round(p * 2**24)``, with
``hash`` two rounds of the lowbias32 integer mix. Reference and Triton compute the same
bits, so the backward (and any recompute) regenerates the forward's mask exactly instead of
saving it. Kept values are scaled by ``1 / (1 - p)``; ``p == 0`` or ``training=False``
means no dropout. The gradient of ``residual`` is ``grad`` itself and the bias gradient is
``grad_x`` summed over all but the last dim (done in the autograd formula).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common

BLOCK = 1024
_M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- the mask
def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for uint32 values held in int64, without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _lowbias32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _seed_key(seed: int) -> int:
    return _lowbias32(_lowbias32(seed & _M32) ^ ((seed >> 32) & _M32))


def _as_i32(v: int) -> int:
    v &= _M32
    return v - (1 << 32) if v >= (1 << 31) else v


def _threshold(p: float) -> int:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: p must be in [0, 1], got {p}")
    return round(p * (1 << 24))


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_keep_mask(numel: int, p: float, seed: int, offset: int, device=None) -> Tensor:
    """The bool keep-mask (flat, ``numel`` long) that both implementations use."""
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    h = _lowbias32(_lowbias32((idx + offset) & _M32) ^ _seed_key(seed))
    return (h >> 8) >= _threshold(p)


# --------------------------------------------------------------------------- reference
def bias_dropout_add_reference(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool,
                               seed: int, offset: int) -> Tensor:
    h = x.float() if bias is None else x.float() + bias.float()
    if training and p > 0:
        keep = dropout_keep_mask(x.numel(), p, seed, offset, x.device).view(x.shape)
        h = torch.where(keep, h * _scale(p), 0.0)
    return (residual.float() + h).to(x.dtype)


def bias_dropout_add_backward_reference(grad: Tensor, p: float, training: bool, seed: int, offset: int) -> Tensor:
    g = grad.float()
    if training and p > 0:
        keep = dropout_keep_mask(grad.numel(), p, seed, offset, grad.device).view(grad.shape)
        g = torch.where(keep, g * _scale(p), 0.0)
    return g.to(grad.dtype, copy=True)  # a fresh tensor even when nothing is dropped


# --------------------------------------------------------------------------- triton
@triton.jit(do_not_specialize=["offset32", "key32"])  # a value of 1 must not become a constexpr: .to() below
def _bda_kernel(x_ptr, bias_ptr, res_ptr, out_ptr, numel, N, offset32, key32, threshold, scale,
                HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        r = offs.to(tl.uint32) + offset32.to(tl.uint32)
        # two rounds of lowbias32 with the seed key xor-ed in between (as _lowbias32 above)
        r = r ^ (r >> 16)
        r = r * 0x7FEB352D
        r = r ^ (r >> 15)
        r = r * 0x846CA68B
        r = r ^ (r >> 16)
        r = r ^ key32.to(tl.uint32)
        r = r ^ (r >> 16)
        r = r * 0x7FEB352D
        r = r ^ (r >> 15)
        r = r * 0x846CA68B
        r = r ^ (r >> 16)
        keep = (r >> 8).to(tl.int32) >= threshold
        h = tl.where(keep, h * scale, 0.0)
    if HAS_RESIDUAL:
        h = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32) + h
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, bias, residual, p, training, seed, offset):
    x = x.contiguous()
    out = _common.new_output_like(x)
    numel = x.numel()
    dropout = bool(training and p > 0)
    if not numel:
        return out
    _common.on(_bda_kernel, x.device)[(triton.cdiv(numel, BLOCK),)](
        x, bias.contiguous() if bias is not None else x, residual.contiguous() if residual is not None else x,
        out, numel, x.shape[-1] if x.dim() else 1, _as_i32(offset), _as_i32(_seed_key(seed)), _threshold(p),
        _scale(p), HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, DROPOUT=dropout, BLOCK=BLOCK)
    return out


def bias_dropout_add_triton(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool,
                            seed: int, offset: int) -> Tensor:
    return _launch(x, bias, residual, p, training, seed, offset)


def bias_dropout_add_backward_triton(grad: Tensor, p: float, training: bool, seed: int, offset: int) -> Tensor:
    return _launch(grad, None, None, p, training, seed, offset)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::bias_dropout_add", mutates_args=())
def bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool, seed: int,
                     offset: int) -> Tensor:
    """``residual + dropout(x + bias, p)`` with the counter-based mask of this module."""
    impl = bias_dropout_add_triton if _common.use_triton(x) else bias_dropout_add_reference
    return _common.contiguous_outputs(impl(x, bias, residual, p, training, seed, offset))


@bias_dropout_add.register_fake
def _(x, bias, residual, p, training, seed, offset):
    return x.new_empty(x.shape)


@torch.library.custom_op("mxgraph::bias_dropout_add_backward", mutates_args=())
def bias_dropout_add_backward(grad: Tensor, p: float, training: bool, seed: int, offset: int) -> Tensor:
    """``grad * keep / (1 - p)``: the gradient of ``x`` (and, summed, of ``bias``)."""
    impl = bias_dropout_add_backward_triton if _common.use_triton(grad) else bias_dropout_add_backward_reference
    return _common.contiguous_outputs(impl(grad, p, training, seed, offset))


@bias_dropout_add_backward.register_fake
def _(grad, p, training, seed, offset):
    return grad.new_empty(grad.shape)


def _setup(ctx, inputs, output):
    x, bias, residual, p, training, seed, offset = inputs
    ctx.args = (p, training, seed, offset)
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _bwd(ctx, grad):
    dx = torch.ops.mxgraph.bias_dropout_add_backward(grad, *ctx.args)
    dbias = None if ctx.bias_dtype is None else _common.sum_to_last_dim(dx).to(ctx.bias_dtype)
    return dx.to(ctx.x_dtype), dbias, grad.to(ctx.residual_dtype), None, None, None, None


bias_dropout_add.register_autograd(_bwd, setup_context=_setup)
