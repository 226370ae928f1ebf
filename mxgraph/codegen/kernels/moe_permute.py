"""MoE token permute / unpermute with routing probabilities, dropless and capacity-padded.

Ops:
  mxgraph::moe_permute(x, topk_ids, num_experts) -> (x_sorted, row_map, counts)
  mxgraph::moe_permute_capacity(x, topk_ids, num_experts, capacity) -> (x_padded, slot_map, counts)
  mxgraph::moe_permute_backward(grad_rows, row_map, topk) -> grad_x
  mxgraph::moe_unpermute(y_rows, row_map, probs) -> out
  mxgraph::moe_unpermute_backward(grad_out, y_rows, row_map, probs) -> (grad_y_rows, grad_probs)

``x`` is ``[T, D]``, ``topk_ids`` ``[T, K]`` (expert of each token's k-th choice, ``< E``),
``probs`` ``[T, K]``. Assignment ``a = t * K + k`` goes to row ``row_map[a]`` of the expert
input. Every output shape depends only on ``T, K, D, E, C``, never on the routing, so the ops
trace with static shapes.

* Dropless: ``x_sorted`` is ``[T * K, D]``, assignments grouped by expert (expert 0 first)
  and in token order within an expert; ``counts[e]`` tokens go to expert ``e``, so expert
  ``e`` owns rows ``cumsum(counts)[e] - counts[e]`` to ``cumsum(counts)[e]``.
* Capacity-padded: ``x_padded`` is ``[E, C, D]``; expert ``e`` takes its first ``C``
  assignments in token order into slots ``0..C-1``, **later assignments beyond capacity are
  dropped** (``slot_map[a] == -1``: they get no expert output, only what the residual
  carries) and unused slots hold zeros. ``slot_map`` indexes the flattened ``[E * C]`` rows;
  ``counts`` are the tokens routed per expert before dropping.
* ``moe_unpermute(y_rows, row_map, probs)[t] = sum_k probs[t, k] * y_rows[row_map[t*K + k]]``
  (dropped assignments add nothing); pass a capacity output as ``y.reshape(E * C, D)``
  (or use :func:`moe_unpermute_capacity`).

The routing indices come from a stable ``argsort`` in torch on both paths; Triton kernels do
the row movement: one program per assignment scatters a row (and, in the unpermute backward,
its probability gradient), one program per token gathers and sums its ``K`` rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common


# --------------------------------------------------------------------------- routing maps
def _check(x: Tensor, topk_ids: Tensor, num_experts: int) -> None:
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or num_experts <= 0:
        raise ValueError(f"moe_permute: want x [T, D], topk_ids [T, K] and num_experts > 0, got {tuple(x.shape)}, "
                         f"{tuple(topk_ids.shape)}, {num_experts}")


def routing_maps(topk_ids: Tensor, num_experts: int, capacity: int | None = None):
    """``(row_map [T*K], counts [E])``; with ``capacity``, rows index ``[E * capacity]`` and
    assignments past an expert's capacity map to -1."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(n, device=flat.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))
    if capacity is None:
        return sorted_pos, counts
    rank = sorted_pos - (torch.cumsum(counts, 0) - counts)[flat]
    return torch.where(rank < capacity, flat * capacity + rank, -1), counts


# --------------------------------------------------------------------------- reference
def _scatter_reference(x: Tensor, row_map: Tensor, num_rows: int, topk: int) -> Tensor:
    out = torch.zeros((num_rows, x.shape[1]), dtype=x.dtype, device=x.device)
    keep = row_map >= 0
    src = torch.arange(row_map.numel(), device=x.device) // topk
    out[row_map[keep]] = x[src[keep]]
    return out


def _gather_reference(rows: Tensor, row_map: Tensor, weights: Tensor | None, topk: int) -> Tensor:
    keep = row_map >= 0
    picked = rows.float()[row_map.clamp(min=0)] * keep[:, None]
    if weights is not None:
        picked = picked * weights.float().reshape(-1, 1)
    return picked.view(-1, topk, rows.shape[1]).sum(1).to(rows.dtype)


def moe_permute_reference(x: Tensor, topk_ids: Tensor, num_experts: int):
    _check(x, topk_ids, num_experts)
    row_map, counts = routing_maps(topk_ids, num_experts)
    return _scatter_reference(x, row_map, row_map.numel(), topk_ids.shape[1]), row_map, counts


def moe_permute_capacity_reference(x: Tensor, topk_ids: Tensor, num_experts: int, capacity: int):
    _check(x, topk_ids, num_experts)
    slot_map, counts = routing_maps(topk_ids, num_experts, capacity)
    out = _scatter_reference(x, slot_map, num_experts * capacity, topk_ids.shape[1])
    return out.view(num_experts, capacity, x.shape[1]), slot_map, counts


def moe_permute_backward_reference(grad_rows: Tensor, row_map: Tensor, topk: int) -> Tensor:
    return _gather_reference(grad_rows, row_map, None, topk)


def moe_unpermute_reference(y_rows: Tensor, row_map: Tensor, probs: Tensor) -> Tensor:
    return _gather_reference(y_rows, row_map, probs, probs.shape[1])


def moe_unpermute_backward_reference(grad_out: Tensor, y_rows: Tensor, row_map: Tensor, probs: Tensor):
    topk = probs.shape[1]
    keep = row_map >= 0
    g = grad_out.float().repeat_interleave(topk, 0)  # [T*K, D]
    dy = _scatter_reference((g * probs.float().reshape(-1, 1)).to(y_rows.dtype), row_map, y_rows.shape[0], 1)
    dprobs = (g * y_rows.float()[row_map.clamp(min=0)]).sum(-1) * keep
    return dy, dprobs.view(probs.shape).to(probs.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _scatter_kernel(src_ptr, row_map_ptr, probs_ptr, y_ptr, out_ptr, dprobs_ptr, D, K, HAS_PROBS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """out[row_map[a]] = probs[a] * src[a // K]; with probs also dprobs[a] = <src[a // K], y[row_map[a]]>."""
    a = tl.program_id(0).to(tl.int64)
    dst = tl.load(row_map_ptr + a)
    cols = tl.arange(0, BLOCK_D)
    keep = (cols * 0 + dst) >= 0  # broadcast first: the interpreter rejects a scalar mask term
    dst = tl.maximum(dst, 0)
    src_base = (a // K) * D
    if HAS_PROBS:
        w = tl.load(probs_ptr + a).to(tl.float32)
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        c = start + cols
        m = (c < D) & keep
        v = tl.load(src_ptr + src_base + c, mask=m, other=0.0)
        if HAS_PROBS:
            yv = tl.load(y_ptr + dst * D + c, mask=m, other=0.0).to(tl.float32)
            dot += v.to(tl.float32) * yv
            v = v.to(tl.float32) * w
        tl.store(out_ptr + dst * D + c, v.to(out_ptr.dtype.element_ty), mask=m)
    if HAS_PROBS:
        tl.store(dprobs_ptr + a, tl.sum(dot, axis=0).to(dprobs_ptr.dtype.element_ty))


@triton.jit
def _gather_kernel(rows_ptr, row_map_ptr, probs_ptr, out_ptr, D, K, HAS_PROBS: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_k probs[t, k] * rows[row_map[t*K + k]] (rows mapped to -1 skipped)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(0, K):
        src = tl.load(row_map_ptr + t * K + k)
        m = (c < D) & ((c * 0 + src) >= 0)
        v = tl.load(rows_ptr + tl.maximum(src, 0) * D + c, mask=m, other=0.0).to(tl.float32)
        if HAS_PROBS:
            v = v * tl.load(probs_ptr + t * K + k).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * D + c, acc.to(out_ptr.dtype.element_ty), mask=c < D)


def _block_d(d: int) -> int:
    return _common.block_for(d, hi=1024)


def _scatter_triton(src, row_map, num_rows, topk, probs=None, y_rows=None, poison=True):
    src, row_map = src.contiguous(), row_map.contiguous()
    d = src.shape[1]
    out = (_common.new_output((num_rows, d), dtype=src.dtype if y_rows is None else y_rows.dtype, device=src.device)
           if poison else torch.zeros((num_rows, d), dtype=src.dtype if y_rows is None else y_rows.dtype,
                                      device=src.device))
    dprobs = _common.new_output(probs.shape, dtype=probs.dtype, device=src.device) if probs is not None else None
    if row_map.numel():
        _common.on(_scatter_kernel, src.device)[(row_map.numel(),)](
            src, row_map, probs.contiguous() if probs is not None else src,
            y_rows.contiguous() if y_rows is not None else src, out, dprobs if probs is not None else src, d, topk,
            HAS_PROBS=probs is not None, BLOCK_D=_block_d(d))
    return out, dprobs


def _gather_triton(rows, row_map, probs, topk, num_tokens):
    rows, row_map = rows.contiguous(), row_map.contiguous()
    d = rows.shape[1]
    out = _common.new_output((num_tokens, d), dtype=rows.dtype, device=rows.device)
    if num_tokens and d:
        _common.on(_gather_kernel, rows.device)[(num_tokens, triton.cdiv(d, _block_d(d)))](
            rows, row_map, probs.contiguous() if probs is not None else rows, out, d, topk,
            HAS_PROBS=probs is not None, BLOCK_D=_block_d(d))
    return out


def moe_permute_triton(x: Tensor, topk_ids: Tensor, num_experts: int):
    _check(x, topk_ids, num_experts)
    row_map, counts = routing_maps(topk_ids, num_experts)
    out, _ = _scatter_triton(x, row_map, row_map.numel(), topk_ids.shape[1])  # a bijection: every row written
    return out, row_map, counts


def moe_permute_capacity_triton(x: Tensor, topk_ids: Tensor, num_experts: int, capacity: int):
    _check(x, topk_ids, num_experts)
    slot_map, counts = routing_maps(topk_ids, num_experts, capacity)
    out, _ = _scatter_triton(x, slot_map, num_experts * capacity, topk_ids.shape[1], poison=False)  # empty slots: 0
    return out.view(num_experts, capacity, x.shape[1]), slot_map, counts


def moe_permute_backward_triton(grad_rows: Tensor, row_map: Tensor, topk: int) -> Tensor:
    return _gather_triton(grad_rows, row_map, None, topk, row_map.numel() // topk)


def moe_unpermute_triton(y_rows: Tensor, row_map: Tensor, probs: Tensor) -> Tensor:
    return _gather_triton(y_rows, row_map, probs, probs.shape[1], probs.shape[0])


def moe_unpermute_backward_triton(grad_out: Tensor, y_rows: Tensor, row_map: Tensor, probs: Tensor):
    # rows no assignment maps to (capacity padding) get a zero gradient
    dy, dprobs = _scatter_triton(grad_out, row_map, y_rows.shape[0], probs.shape[1], probs=probs, y_rows=y_rows,
                                 poison=False)
    return dy, dprobs


# --------------------------------------------------------------------------- custom ops
def _use(x):
    return _common.use_triton(x)


@torch.library.custom_op("mxgraph::moe_permute", mutates_args=())
def moe_permute(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Dropless: ``(x_sorted [T*K, D], row_map [T*K], counts [E])``."""
    impl = moe_permute_triton if _use(x) else moe_permute_reference
    return _common.contiguous_outputs(impl(x, topk_ids, num_experts))


@moe_permute.register_fake
def _(x, topk_ids, num_experts):
    _check(x, topk_ids, num_experts)
    n = topk_ids.shape[0] * topk_ids.shape[1]
    return (x.new_empty((n, x.shape[1])), x.new_empty((n,), dtype=torch.int64),
            x.new_empty((num_experts,), dtype=torch.int64))


@torch.library.custom_op("mxgraph::moe_permute_capacity", mutates_args=())
def moe_permute_capacity(x: Tensor, topk_ids: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """Capacity-padded: ``(x_padded [E, C, D], slot_map [T*K] (-1: dropped), counts [E])``."""
    impl = moe_permute_capacity_triton if _use(x) else moe_permute_capacity_reference
    return _common.contiguous_outputs(impl(x, topk_ids, num_experts, capacity))


@moe_permute_capacity.register_fake
def _(x, topk_ids, num_experts, capacity):
    _check(x, topk_ids, num_experts)
    n = topk_ids.shape[0] * topk_ids.shape[1]
    return (x.new_empty((num_experts, capacity, x.shape[1])), x.new_empty((n,), dtype=torch.int64),
            x.new_empty((num_experts,), dtype=torch.int64))


@torch.library.custom_op("mxgraph::moe_permute_backward", mutates_args=())
def moe_permute_backward(grad_rows: Tensor, row_map: Tensor, topk: int) -> Tensor:
    """``grad_x[t] = sum_k grad_rows[row_map[t*K + k]]``."""
    impl = moe_permute_backward_triton if _use(grad_rows) else moe_permute_backward_reference
    return _common.contiguous_outputs(impl(grad_rows, row_map, topk))


@moe_permute_backward.register_fake
def _(grad_rows, row_map, topk):
    return grad_rows.new_empty((row_map.shape[0] // topk, grad_rows.shape[1]))


@torch.library.custom_op("mxgraph::moe_unpermute", mutates_args=())
def moe_unpermute(y_rows: Tensor, row_map: Tensor, probs: Tensor) -> Tensor:
    """``out[t] = sum_k probs[t, k] * y_rows[row_map[t*K + k]]``."""
    impl = moe_unpermute_triton if _use(y_rows) else moe_unpermute_reference
    return _common.contiguous_outputs(impl(y_rows, row_map, probs))


@moe_unpermute.register_fake
def _(y_rows, row_map, probs):
    return y_rows.new_empty((probs.shape[0], y_rows.shape[1]))


@torch.library.custom_op("mxgraph::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward(grad_out: Tensor, y_rows: Tensor, row_map: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    impl = moe_unpermute_backward_triton if _use(grad_out) else moe_unpermute_backward_reference
    return _common.contiguous_outputs(impl(grad_out, y_rows, row_map, probs))


@moe_unpermute_backward.register_fake
def _(grad_out, y_rows, row_map, probs):
    return y_rows.new_empty(y_rows.shape), probs.new_empty(probs.shape)


def _permute_setup(ctx, inputs, output):
    _, row_map, counts = output
    ctx.mark_non_differentiable(row_map, counts)
    ctx.save_for_backward(row_map)
    ctx.topk = inputs[1].shape[1]


def _permute_bwd(ctx, grad_rows, _g_map, _g_counts):
    (row_map,) = ctx.saved_tensors
    # dropless grads are [T*K, D]; capacity grads [E, C, D] index the flattened rows
    grad_x = torch.ops.mxgraph.moe_permute_backward(grad_rows.reshape(-1, grad_rows.shape[-1]), row_map, ctx.topk)
    return (grad_x,) + (None,) * (len(ctx.needs_input_grad) - 1)


moe_permute.register_autograd(_permute_bwd, setup_context=_permute_setup)
moe_permute_capacity.register_autograd(_permute_bwd, setup_context=_permute_setup)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_bwd(ctx, grad_out):
    y_rows, row_map, probs = ctx.saved_tensors
    dy, dprobs = torch.ops.mxgraph.moe_unpermute_backward(grad_out, y_rows, row_map, probs)
    return dy, None, dprobs


moe_unpermute.register_autograd(_unpermute_bwd, setup_context=_unpermute_setup)


def moe_unpermute_capacity(y_padded: Tensor, slot_map: Tensor, probs: Tensor) -> Tensor:
    """:func:`moe_unpermute` for an ``[E, C, D]`` expert output."""
    return torch.ops.mxgraph.moe_unpermute(y_padded.reshape(-1, y_padded.shape[-1]), slot_map, probs)
