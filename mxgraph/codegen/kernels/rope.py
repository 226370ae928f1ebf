"""Rotary position embedding applied to q and k in one op, fused, with a fused backward.

Ops:
  mxgraph::rope(q, k, cos, sin, interleaved) -> (q_out, k_out)
  mxgraph::rope_backward(grad_q, grad_k, cos, sin, interleaved) -> (grad_q_in, grad_k_in)

Layout: ``q`` is ``[B, S, Hq, D]``, ``k`` is ``[B, S, Hk, D]`` (any head_dim ``D``); ``cos``
and ``sin`` are ``[S, R]`` with ``R = rot_dim``, even, ``R <= D``. Only the first ``R``
channels rotate; the rest pass through unchanged (partial rotary). Element ``j < R`` pairs
with a partner ``p(j)``: ``j ± R/2`` (``interleaved=False``, "rotate-half", GPT-NeoX/Llama)
or ``j ^ 1`` (``interleaved=True``, GPT-J). With ``sign(j) = -1`` for the first element of a
pair and ``+1`` for the second:

    out[j] = x[j] * cos[s, j] + sign(j) * x[p(j)] * sin[s, j]

so ``cos``/``sin`` carry one value per channel (the usual duplicated tables). The backward
applies the transpose, ``dx[j] = g[j] * cos[j] - sign(j) * g[p(j)] * sin[p(j)]``. ``cos`` and
``sin`` are treated as constants (no gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common

BLOCK_ROWS = 16


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"rope: want x [B, S, H, D] and cos/sin [S, R], got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    r = cos.shape[1]
    if r % 2 or r > x.shape[3] or cos.shape[0] != x.shape[1]:
        raise ValueError(f"rope: rot_dim {r} must be even and <= head_dim {x.shape[3]}, and cos must have "
                         f"{x.shape[1]} positions (has {cos.shape[0]})")


def _pairing(r: int, interleaved: bool, device):
    j = torch.arange(r, device=device)
    if interleaved:
        return j ^ 1, torch.where(j % 2 == 0, -1.0, 1.0)
    half = r // 2
    return torch.where(j < half, j + half, j - half), torch.where(j < half, -1.0, 1.0)


# --------------------------------------------------------------------------- reference
def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool) -> Tensor:
    _check(x, cos, sin)
    r = cos.shape[1]
    partner, sign = _pairing(r, interleaved, x.device)
    x32 = x.float()
    xr = x32[..., :r]
    c = cos.float()[None, :, None, :]
    s = sin.float()[None, :, None, :]
    if backward:
        out = xr * c - sign * (xr * s)[..., partner]
    else:
        out = xr * c + sign * xr[..., partner] * s
    return torch.cat([out, x32[..., r:]], dim=-1).to(x.dtype)


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False):
    return _rotate_reference(q, cos, sin, interleaved, False), _rotate_reference(k, cos, sin, interleaved, False)


def rope_backward_reference(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False):
    return (_rotate_reference(grad_q, cos, sin, interleaved, True),
            _rotate_reference(grad_k, cos, sin, interleaved, True))


# --------------------------------------------------------------------------- triton
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, S, H, D, R, INTERLEAVED: tl.constexpr,
                 BACKWARD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    pos = ((rows // H) % S)[:, None]
    if INTERLEAVED:
        partner = cols ^ 1
        first = (cols % 2) == 0
    else:
        half = R // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        first = cols < half
    sign = tl.where(first, -1.0, 1.0)[None, :]
    rot_mask = mask & (cols < R)[None, :]
    base = rows[:, None] * D
    x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + base + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * R + cols[None, :], mask=rot_mask, other=1.0).to(tl.float32)
    if BACKWARD:
        sp = tl.load(sin_ptr + pos * R + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        out = x * c - sign * (xp * sp)
    else:
        s = tl.load(sin_ptr + pos * R + cols[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        out = x * c + sign * xp * s
    tl.store(out_ptr + base + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_triton(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool) -> Tensor:
    _check(x, cos, sin)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    b, s, h, d = x.shape
    out = _common.new_output_like(x)
    n_rows = b * s * h
    if n_rows:
        _common.on(_rope_kernel, x.device)[(triton.cdiv(n_rows, BLOCK_ROWS),)](
            x, cos, sin, out, n_rows, s, h, d, cos.shape[1], INTERLEAVED=interleaved, BACKWARD=backward,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=_common.block_for(d, lo=2))
    return out


def rope_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False):
    return _rotate_triton(q, cos, sin, interleaved, False), _rotate_triton(k, cos, sin, interleaved, False)


def rope_backward_triton(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False):
    return (_rotate_triton(grad_q, cos, sin, interleaved, True),
            _rotate_triton(grad_k, cos, sin, interleaved, True))


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` (``[B, S, H, D]``) by ``cos``/``sin`` (``[S, rot_dim]``)."""
    impl = rope_triton if _common.use_triton(q) else rope_reference
    return _common.contiguous_outputs(impl(q, k, cos, sin, interleaved))


@rope.register_fake
def _(q, k, cos, sin, interleaved=False):
    _check(q, cos, sin)
    _check(k, cos, sin)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("mxgraph::rope_backward", mutates_args=())
def rope_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                  interleaved: bool = False) -> tuple[Tensor, Tensor]:
    impl = rope_backward_triton if _common.use_triton(grad_q) else rope_backward_reference
    return _common.contiguous_outputs(impl(grad_q, grad_k, cos, sin, interleaved))


@rope_backward.register_fake
def _(grad_q, grad_k, cos, sin, interleaved=False):
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


def _setup(ctx, inputs, output):
    q, k, cos, sin, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved


def _bwd(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.mxgraph.rope_backward(grad_q, grad_k, cos, sin, ctx.interleaved)
    return dq, dk, None, None, None


rope.register_autograd(_bwd, setup_context=_setup)
