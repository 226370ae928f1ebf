"""MoE router: scores, biased (optionally group-limited) top-k selection, normalisation, counts.

Ops:
  mxgraph::moe_router(logits, expert_bias?, topk, score_func, num_groups, topk_groups, normalize, route_scale)
      -> (probs, topk_ids, counts)
  mxgraph::moe_router_backward(grad_probs, logits, topk_ids, score_func, normalize, route_scale) -> grad_logits

``logits`` is ``[T, E]``. Per token:

1. ``scores = softmax(logits)`` or ``sigmoid(logits)`` (``score_func``), in fp32;
2. selection scores ``scores + expert_bias`` (the bias, e.g. DeepSeek-V3's load-balancing
   bias, steers selection only and never enters ``probs``);
3. with ``num_groups > 1`` (``E`` divisible by it), experts form ``num_groups`` contiguous
   groups; a group's score is the sum of its best ``topk // topk_groups`` selection scores
   and only experts of the best ``topk_groups`` groups stay eligible;
4. ``topk_ids`` are the ``topk`` best eligible experts, best first; ``probs`` their
   ``scores``; with ``normalize`` divided by their sum (+1e-20), then times ``route_scale``;
5. ``counts[e]`` is the number of tokens that chose expert ``e``.

Shapes: ``probs`` fp32 ``[T, K]``, ``topk_ids`` int64 ``[T, K]``, ``counts`` int64 ``[E]``: none
depends on the routing. Only ``logits`` gets a gradient, through ``probs``.

Triton: one program per token does steps 1-4 in registers (iterated arg-max for the top-k,
so ties go to the lower expert index); counts are an ``index_add`` in torch. The backward
recomputes the scores and applies the normalisation and softmax/sigmoid Jacobians per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common

_NORM_EPS = 1e-20


def _check(logits: Tensor, topk: int, score_func: str, num_groups: int, topk_groups: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"moe_router: want logits [T, E], got {tuple(logits.shape)}")
    e = logits.shape[1]
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_router: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    if not 1 <= topk <= e:
        raise ValueError(f"moe_router: topk must be in [1, {e}], got {topk}")
    if num_groups > 1:
        if e % num_groups or not 1 <= topk_groups <= num_groups or topk < topk_groups \
                or topk > topk_groups * (e // num_groups):
            raise ValueError(f"moe_router: group-limited routing needs E ({e}) divisible by num_groups ({num_groups}), "
                             f"1 <= topk_groups ({topk_groups}) <= num_groups and topk ({topk}) between topk_groups "
                             f"and the experts in topk_groups groups")


def _counts(ids: Tensor, num_experts: int) -> Tensor:
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))


def _per_group(topk: int, num_groups: int, topk_groups: int, group_topk: int, experts: int) -> int:
    """How many of a group's best selection scores sum to its score."""
    per_group = group_topk or topk // topk_groups
    if not 1 <= per_group <= experts // num_groups:
        raise ValueError(f"group_topk={group_topk} must be between 1 and the group size "
                         f"{experts // num_groups} (0 = topk // topk_groups)")
    return per_group


# --------------------------------------------------------------------------- reference
def _scores(logits: Tensor, score_func: str) -> Tensor:
    x = logits.float()
    return torch.softmax(x, -1) if score_func == "softmax" else torch.sigmoid(x)


def moe_router_reference(logits: Tensor, expert_bias: Tensor | None, topk: int, score_func: str = "softmax",
                         num_groups: int = 1, topk_groups: int = 1, normalize: bool = False,
                         route_scale: float = 1.0, group_topk: int = 0):
    _check(logits, topk, score_func, num_groups, topk_groups)
    t, e = logits.shape
    scores = _scores(logits, score_func)
    sel = scores if expert_bias is None else scores + expert_bias.float()
    if num_groups > 1:
        group_scores = sel.view(t, num_groups, -1).topk(
            _per_group(topk, num_groups, topk_groups, group_topk, e), dim=-1).values.sum(-1)
        keep = torch.zeros(t, num_groups, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    ids = sel.topk(topk, dim=-1).indices
    probs = scores.gather(1, ids)
    if normalize:
        probs = probs / (probs.sum(-1, keepdim=True) + _NORM_EPS)
    return probs * route_scale, ids, _counts(ids, e)


def moe_router_backward_reference(grad_probs: Tensor, logits: Tensor, topk_ids: Tensor, score_func: str = "softmax",
                                  normalize: bool = False, route_scale: float = 1.0) -> Tensor:
    """The ATen calls eager autograd makes for steps 1, 4 and the scaling (see the package docstring)."""
    scores = _scores(logits, score_func)
    g = grad_probs.float() * route_scale
    if normalize:
        s_sel = scores.gather(1, topk_ids)
        z = s_sel.sum(-1, keepdim=True) + _NORM_EPS
        g = g / z + (-g * ((s_sel / z) / z)).sum(-1, keepdim=True)
    g_scores = torch.zeros_like(scores).scatter_add_(1, topk_ids, g)
    if score_func == "softmax":
        d = torch.ops.aten._softmax_backward_data(g_scores, scores, -1, torch.float32)
    else:
        d = torch.ops.aten.sigmoid_backward(g_scores, scores)
    return d.to(logits.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _router_fwd_kernel(logits_ptr, bias_ptr, probs_ptr, ids_ptr, E, K, group_size, num_groups, topk_groups,
                       per_group, route_scale, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GROUPED: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * E + cols, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        ex = tl.exp(x - tl.max(x, axis=0))
        scores = ex / tl.sum(ex, axis=0)
    sel = scores
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    sel = tl.where(valid, sel, float("-inf"))
    if GROUPED:
        gid = cols // group_size
        garange = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in range(0, num_groups):
            work = tl.where(gid == g, sel, float("-inf"))
            total = 0.0
            for _r in range(0, per_group):
                best = tl.max(work, axis=0)
                total += best
                work = tl.where(cols == tl.argmax(work, axis=0), float("-inf"), work)
            gscore = tl.where(garange == g, total, gscore)
        eligible = cols < 0
        for _g in range(0, topk_groups):
            chosen = tl.argmax(gscore, axis=0)
            eligible = eligible | (gid == chosen)
            gscore = tl.where(garange == chosen, float("-inf"), gscore)
        sel = tl.where(eligible & valid, sel, float("-inf"))
    karange = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    probs = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K):
        idx = tl.argmax(sel, axis=0)
        ids = tl.where(karange == k, idx, ids)
        probs = tl.where(karange == k, tl.sum(tl.where(cols == idx, scores, 0.0), axis=0), probs)
        sel = tl.where(cols == idx, float("-inf"), sel)
    if NORMALIZE:
        probs = probs / (tl.sum(probs, axis=0) + 1e-20)
    kmask = karange < K
    tl.store(probs_ptr + row * K + karange, probs * route_scale, mask=kmask)
    tl.store(ids_ptr + row * K + karange, ids.to(tl.int64), mask=kmask)


@triton.jit
def _router_bwd_kernel(g_ptr, logits_ptr, ids_ptr, dlogits_ptr, E, K, route_scale, SIGMOID: tl.constexpr,
                       NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * E + cols, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        ex = tl.exp(x - tl.max(x, axis=0))
        scores = ex / tl.sum(ex, axis=0)
    karange = tl.arange(0, BLOCK_K)
    kmask = karange < K
    ids = tl.load(ids_ptr + row * K + karange, mask=kmask, other=-1)
    g = tl.load(g_ptr + row * K + karange, mask=kmask, other=0.0).to(tl.float32) * route_scale
    onehot = (ids[:, None] == cols[None, :]) & kmask[:, None]  # [K, E]
    s_sel = tl.sum(tl.where(onehot, scores[None, :], 0.0), axis=1)
    if NORMALIZE:
        z = tl.sum(s_sel, axis=0) + 1e-20
        g = g / z - tl.sum(g * s_sel, axis=0) / (z * z)
    g_scores = tl.sum(tl.where(onehot, g[:, None], 0.0), axis=0)
    if SIGMOID:
        d = g_scores * scores * (1.0 - scores)
    else:
        d = scores * (g_scores - tl.sum(g_scores * scores, axis=0))
    tl.store(dlogits_ptr + row * E + cols, d.to(dlogits_ptr.dtype.element_ty), mask=valid)


def moe_router_triton(logits: Tensor, expert_bias: Tensor | None, topk: int, score_func: str = "softmax",
                      num_groups: int = 1, topk_groups: int = 1, normalize: bool = False, route_scale: float = 1.0,
                      group_topk: int = 0):
    _check(logits, topk, score_func, num_groups, topk_groups)
    logits = logits.contiguous()
    t, e = logits.shape
    probs = _common.new_output((t, topk), dtype=torch.float32, device=logits.device)
    ids = _common.new_output((t, topk), dtype=torch.int64, device=logits.device)
    grouped = num_groups > 1
    if t:
        _common.on(_router_fwd_kernel, logits.device)[(t,)](
            logits, expert_bias.contiguous() if expert_bias is not None else logits, probs, ids, e, topk,
            e // num_groups if grouped else e, num_groups, topk_groups,
            _per_group(topk, num_groups, topk_groups, group_topk, e) if grouped else 1,
            route_scale, SIGMOID=score_func == "sigmoid", HAS_BIAS=expert_bias is not None, GROUPED=grouped,
            NORMALIZE=normalize, BLOCK_E=_common.block_for(e, lo=2), BLOCK_K=_common.block_for(topk, lo=2),
            BLOCK_G=_common.block_for(num_groups, lo=2))
    return probs, ids, _counts(ids, e)


def moe_router_backward_triton(grad_probs: Tensor, logits: Tensor, topk_ids: Tensor, score_func: str = "softmax",
                               normalize: bool = False, route_scale: float = 1.0) -> Tensor:
    logits, grad_probs, topk_ids = logits.contiguous(), grad_probs.contiguous(), topk_ids.contiguous()
    t, e = logits.shape
    k = topk_ids.shape[1]
    dlogits = _common.new_output_like(logits)
    if t:
        _common.on(_router_bwd_kernel, logits.device)[(t,)](
            grad_probs, logits, topk_ids, dlogits, e, k, route_scale, SIGMOID=score_func == "sigmoid",
            NORMALIZE=normalize, BLOCK_E=_common.block_for(e, lo=2), BLOCK_K=_common.block_for(k, lo=2))
    return dlogits


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::moe_router", mutates_args=())
def moe_router(logits: Tensor, expert_bias: Tensor | None, topk: int, score_func: str = "softmax",
               num_groups: int = 1, topk_groups: int = 1, normalize: bool = False,
               route_scale: float = 1.0, group_topk: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(probs [T, K] fp32, topk_ids [T, K] int64, counts [E] int64)``.
    ``group_topk``: how many of a group's best scores make its score (0 = topk // topk_groups;
    DeepSeek-V3 uses 2)."""
    impl = moe_router_triton if _common.use_triton(logits) else moe_router_reference
    return _common.contiguous_outputs(
        impl(logits, expert_bias, topk, score_func, num_groups, topk_groups, normalize, route_scale,
             group_topk))


@moe_router.register_fake
def _(logits, expert_bias, topk, score_func="softmax", num_groups=1, topk_groups=1, normalize=False,
      route_scale=1.0, group_topk=0):
    _check(logits, topk, score_func, num_groups, topk_groups)
    t, e = logits.shape
    return (logits.new_empty((t, topk), dtype=torch.float32), logits.new_empty((t, topk), dtype=torch.int64),
            logits.new_empty((e,), dtype=torch.int64))


@torch.library.custom_op("mxgraph::moe_router_backward", mutates_args=())
def moe_router_backward(grad_probs: Tensor, logits: Tensor, topk_ids: Tensor, score_func: str = "softmax",
                        normalize: bool = False, route_scale: float = 1.0) -> Tensor:
    impl = moe_router_backward_triton if _common.use_triton(logits) else moe_router_backward_reference
    return _common.contiguous_outputs(impl(grad_probs, logits, topk_ids, score_func, normalize, route_scale))


@moe_router_backward.register_fake
def _(grad_probs, logits, topk_ids, score_func="softmax", normalize=False, route_scale=1.0):
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output):
    logits, _, _, score_func, _, _, normalize, route_scale, _ = inputs
    _, ids, counts = output
    ctx.mark_non_differentiable(ids, counts)
    ctx.save_for_backward(logits, ids)
    ctx.args = (score_func, normalize, route_scale)


def _bwd(ctx, grad_probs, _g_ids, _g_counts):
    logits, ids = ctx.saved_tensors
    dlogits = torch.ops.mxgraph.moe_router_backward(grad_probs, logits, ids, *ctx.args)
    return dlogits, None, None, None, None, None, None, None, None


moe_router.register_autograd(_bwd, setup_context=_setup)
