"""Cost annotations: FLOPs and bytes moved per node, from rules keyed by op.

`node_cost(node)` returns a `Cost`. Rules live in `FLOP_RULES`, keyed by the op's
overload packet (e.g. `aten.mm`), registered with `@flop_rule(...)` beside the formula.
Ops without a rule fall back on their tags: views cost nothing, pointwise ops one FLOP
per output element, reductions one per input element. Anything else is *unknown*: its
FLOPs count as 0 but `Cost.known` is False, and summaries report it by name.
Bytes are the sizes of the tensors read and written (views move none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import Node

from mxgraph.ir import ALIAS_OPS, MATMUL_OPS, schema_arg
from mxgraph.torch_compat import has_guarding_hint

aten = torch.ops.aten


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int
    known: bool = True


FLOP_RULES: dict[object, Callable[..., int]] = {}
FREE_OPS = {op.overloadpacket for op in ALIAS_OPS} | {
    aten.lift_fresh_copy, aten._assert_tensor_metadata, aten.sym_size, aten.sym_numel,
    aten.sym_stride}
"""Packets that move no bytes and cost no FLOPs (besides views, which are free too)."""


def flop_rule(*packets):
    """Register `fn(node, out_shapes, in_shapes) -> flops` for these op packets."""
    def register(fn):
        for packet in packets:
            FLOP_RULES[packet] = fn
        return fn
    return register


def concrete(dim) -> int:
    """An int for a dimension. A data-dependent (unbacked) size counts at the upper bound
    its torch._check calls gave it (worst case for memory), else at 1."""
    if isinstance(dim, int):
        return dim
    if has_guarding_hint(dim):
        return int(dim)
    # unbacked: asking int() would raise (and build a costly error message first)
    node = dim.node
    bound = node.shape_env.bound_sympy(node.expr).upper
    return int(bound) if bound.is_finite else 1


def _numel(shape) -> int:
    return int(math.prod(concrete(d) for d in shape))


def tensor_meta(value) -> list[torch.Tensor]:
    """The tensors in a node's meta['val'] (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in tensor_meta(item)]
    return []


def value_bytes(node: Node) -> int:
    """Bytes of the tensors a node produces (0 for non-tensor values)."""
    return sum(_numel(t.shape) * t.element_size() for t in tensor_meta(node.meta.get("val")))


def _arg_tensors(node: Node) -> list[torch.Tensor]:
    """Tensor arguments in argument order (an input passed twice counts twice)."""
    found = []
    for arg in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(arg, Node):
            found += tensor_meta(arg.meta.get("val"))
    return found


@flop_rule(*MATMUL_OPS)
def _matmul_flops(node, outs, ins):
    # 2 * (output elements) * (contracted dimension); the contracted dim is the last
    # dim of the first matrix operand.
    a = ins[1] if node.target.overloadpacket in (aten.addmm, aten.baddbmm) else ins[0]
    return 2 * _numel(outs[0].shape) * concrete(a.shape[-1])


@flop_rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
           aten._scaled_dot_product_flash_attention_for_cpu,
           aten._scaled_dot_product_efficient_attention,
           aten._scaled_dot_product_cudnn_attention)
def _attention_flops(node, outs, ins):
    # q [B, H, S, D], k [B, Hkv, S_kv, D], v [B, Hkv, S_kv, Dv]: QK^T and PV, 2 FLOPs per MAC.
    q, k, v = ins[:3]
    batch_heads = _numel(q.shape[:-2])
    flops = 2 * batch_heads * _numel(q.shape[-2:-1] + k.shape[-2:-1]) * _numel(
        [concrete(q.shape[-1]) + concrete(v.shape[-1])])
    return int(flops // 2 if schema_arg(node, "is_causal") else flops)


@flop_rule(aten._scaled_dot_product_flash_attention_backward,
           aten._scaled_dot_product_flash_attention_for_cpu_backward,
           aten._scaled_dot_product_efficient_attention_backward,
           aten._scaled_dot_product_cudnn_attention_backward)
def _attention_backward_flops(node, outs, ins):
    # grad_out, q, k, v, ...: the backward does ~2.5x the forward's matmuls (dQ, dK, dV,
    # dP and the recomputed P) -> count 2x the forward as Megatron's formula does.
    grad_out, q, k, v = ins[:4]
    batch_heads = _numel(q.shape[:-2])
    flops = 4 * batch_heads * _numel(q.shape[-2:-1] + k.shape[-2:-1]) * _numel(
        [concrete(q.shape[-1]) + concrete(v.shape[-1])])
    return int(flops // 2 if schema_arg(node, "is_causal") else flops)


@flop_rule(aten.embedding, aten.index_select, aten.gather, aten.index)
def _gather_flops(node, outs, ins):
    return 0


@flop_rule(aten.embedding_dense_backward, aten.index_add, aten.scatter_add, aten.index_put,
           aten._index_put_impl)
def _scatter_flops(node, outs, ins):
    return sum(_numel(t.shape) for t in ins[1:2]) or _numel(outs[0].shape)


@flop_rule(aten.rms_norm, aten.layer_norm, aten.native_layer_norm, aten._fused_rms_norm,
           aten.native_layer_norm_backward, aten._fused_rms_norm_backward)
def _norm_flops(node, outs, ins):
    return 5 * _numel(ins[0].shape)


@flop_rule(aten._log_softmax, aten._softmax, aten._log_softmax_backward_data,
           aten._softmax_backward_data, aten.cross_entropy_loss)
def _softmax_flops(node, outs, ins):
    return 3 * _numel(ins[0].shape)


@flop_rule(aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss_nd, aten.nll_loss)
def _nll_flops(node, outs, ins):
    return _numel(ins[1].shape) if len(ins) > 1 else 0


def node_cost(node: Node) -> Cost:
    """FLOPs and bytes of one node; placeholders, outputs and getitems cost nothing."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        if node.op == "call_function" and node.target.__module__ == "_operator":
            return Cost(0, 0)
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
            return Cost(0, 0)
        return Cost(0, 0, node.op != "call_function")
    packet = node.target.overloadpacket
    outs = tensor_meta(node.meta.get("val"))
    ins = _arg_tensors(node)
    if packet in FREE_OPS or node.target.is_view:
        return Cost(0, 0)
    moved = sum(_numel(t.shape) * t.element_size() for t in ins + outs)
    if packet in FLOP_RULES:
        return Cost(int(FLOP_RULES[packet](node, outs, ins)), moved)
    tags = node.target.tags
    if torch.Tag.pointwise in tags:
        return Cost(sum(_numel(t.shape) for t in outs), moved)
    if torch.Tag.reduction in tags:
        return Cost(sum(_numel(t.shape) for t in ins[:1]), moved)
    if packet in _COPY_OPS or "collective" in str(packet) or "_c10d_functional" in str(packet):
        return Cost(0, moved)
    return Cost(0, moved, known=False)


_COPY_OPS = {aten.clone, aten.to, aten.copy, aten._to_copy, aten.cat, aten.stack, aten.new_zeros,
             aten.zeros, aten.zeros_like, aten.ones_like, aten.full, aten.empty,
             aten.scalar_tensor, aten.arange, aten.empty_like, aten.full_like,
             aten.ones, aten.new_empty, aten.new_ones, aten.new_full, aten.select_scatter,
             aten.slice_scatter, aten.copy_, aten.constant_pad_nd, aten.split_with_sizes,
             aten.split, aten.chunk, aten.unbind, aten.repeat, aten.repeat_interleave,
             aten.contiguous, aten.masked_fill, aten.tril, aten.triu, aten.sort, aten.topk,
             aten.argsort, aten.bincount, aten.cumsum, aten.one_hot, aten.nonzero,
             aten.histc, aten.where, aten.scatter, aten.gather, aten.native_dropout,
             aten.dropout, aten.bernoulli, aten.rand, aten.randn, aten.rand_like,
             aten.native_dropout_backward, aten.embedding}


def graph_cost(gm: torch.fx.GraphModule) -> tuple[int, int, list[str]]:
    """Total FLOPs, total bytes, and the sorted names of ops without a rule."""
    flops = moved = 0
    unknown = set()
    for node in gm.graph.nodes:
        cost = node_cost(node)
        flops += cost.flops
        moved += cost.bytes
        if not cost.known:
            unknown.add(str(node.target))
    return flops, moved, sorted(unknown)
