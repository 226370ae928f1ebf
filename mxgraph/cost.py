"""Cost annotations: FLOPs and bytes moved per node, from rules keyed by op.

`node_cost(node)` returns a `Cost`. FLOP rules live in `FLOP_RULES`, keyed by the op's
overload packet (e.g. `aten.mm`), registered with `@flop_rule(..., counts=...)` beside the
formula. A rule reads one `OpCall` (a graph node's fake tensors, or a running op's real
ones) and says what it counts (`FlopRule.counts`: "matmul", "attention", "norm", ...).

The FLOP convention, the one every count here comes from: a rule gives its op's arithmetic,
2 FLOPs per multiply-add, attention counted whole (a rule knows no mask). Two counts derive
from the rules, each by name:
  * `executed_flops(node)`, the compiler's cost (`node_cost`): what the kernels do; every
    rule counts, and attention under a causal mask counts half (the kernel skips it).
  * `model_flops(call)`, model FLOPs, the MFU numerator of PaLM (appendix B) and Megatron-LM
    (`mxgraph/train/flops.py`): matmul and attention rules only (`MODEL_FLOP_KINDS`), causal
    attention counted whole; norms, softmax, losses, gathers and pointwise ops not at all.
Ops without a rule fall back on their tags (executed FLOPs only): views cost nothing,
pointwise ops one FLOP per output element, reductions one per input element. Anything else
is *unknown*: its FLOPs count as 0 but `Cost.known` is False, and summaries report it by
name. Bytes are the sizes of the tensors read and written (views move none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx import Node
from torch.utils._pytree import tree_leaves, tree_map_only

from mxgraph.ir import ALIAS_OPS, MATMUL_OPS, schema_arg
from mxgraph.torch_compat import has_guarding_hint

aten = torch.ops.aten


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int
    known: bool = True


FlopKind = Literal["matmul", "attention", "norm", "softmax", "loss", "gather", "scatter"]
MODEL_FLOP_KINDS: frozenset[str] = frozenset({"matmul", "attention"})
"""What model FLOPs count (module docstring)."""


@dataclass(frozen=True)
class OpCall:
    """One call of an op as a FLOP rule reads it: from a graph node (`OpCall.of_node`: the
    fake tensors of its arguments' meta) or from a running op (real tensors). It reads like
    a node (`target`, `args`, `kwargs`), so `ir.schema_arg` finds its arguments by name."""
    target: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outs: list[torch.Tensor]
    """The tensors the call returns."""

    @classmethod
    def of_node(cls, node: Node) -> OpCall:
        args, kwargs = tree_map_only(Node, lambda arg: arg.meta.get("val"),
                                     (node.args, node.kwargs))
        return cls(node.target, args, kwargs, tensor_meta(node.meta.get("val")))

    @property
    def ins(self) -> list[torch.Tensor]:
        """Tensor arguments in argument order (an input passed twice counts twice)."""
        return [leaf for leaf in tree_leaves((self.args, self.kwargs))
                if isinstance(leaf, torch.Tensor)]


@dataclass(frozen=True)
class FlopRule:
    """One op's FLOP formula and what it counts."""
    flops: Callable[[OpCall], int]
    """FLOPs of one call, in the convention of the module docstring."""
    counts: FlopKind
    """What the FLOPs are of (model FLOPs keep `MODEL_FLOP_KINDS`)."""


FLOP_RULES: dict[object, FlopRule] = {}
FREE_OPS = {op.overloadpacket for op in ALIAS_OPS} | {
    aten.lift_fresh_copy, aten._assert_tensor_metadata, aten.sym_size, aten.sym_numel,
    aten.sym_stride}
"""Packets that move no bytes and cost no FLOPs (besides views, which are free too)."""


def flop_rule(*packets, counts: FlopKind):
    """Register `fn(call: OpCall) -> flops` for these op packets, counting `counts`."""
    def register(fn):
        for packet in packets:
            FLOP_RULES[packet] = FlopRule(fn, counts)
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


@flop_rule(*MATMUL_OPS - {aten._grouped_mm}, counts="matmul")
def _matmul_flops(call):
    # 2 * (output elements) * (contracted dimension); the contracted dim is the last
    # dim of the first matrix operand.
    ins = call.ins
    a = ins[1] if call.target.overloadpacket in (aten.addmm, aten.baddbmm) else ins[0]
    return 2 * _numel(call.outs[0].shape) * concrete(a.shape[-1])


@flop_rule(aten._grouped_mm, counts="matmul")
def _grouped_mm_flops(call):
    # a [rows, K] sorted by group, b [G, K, N]: the rows up to offs[-1] meet one group each
    # (every row where offs is fake: a traced graph). a [M, K_total], b [K_total, N]: each
    # group contracts its share of K. Else (a batched product, or b's columns grouped) each
    # output element contracts a's last dim.
    a, b = call.ins[:2]
    offs = schema_arg(call, "offs")
    if a.dim() == 2 and b.dim() == 2:
        return 2 * _numel(a.shape) * concrete(b.shape[-1])
    if a.dim() == 2 and offs is not None and not is_fake(offs):
        return 2 * int(offs[-1]) * concrete(a.shape[1]) * concrete(b.shape[2])
    return 2 * _numel(call.outs[0].shape) * concrete(a.shape[-1])


@flop_rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
           aten._scaled_dot_product_flash_attention_for_cpu,
           aten._scaled_dot_product_efficient_attention,
           aten._scaled_dot_product_cudnn_attention, counts="attention")
def _attention_flops(call):
    # q [B, H, S, D], k [B, Hkv, S_kv, D], v [B, Hkv, S_kv, Dv]: QK^T and PV for every query
    # head, 2 FLOPs per MAC.
    q, k, v = call.ins[:3]
    return 2 * _numel(q.shape[:-1]) * concrete(k.shape[-2]) * (
        concrete(q.shape[-1]) + concrete(v.shape[-1]))


@flop_rule(aten._scaled_dot_product_flash_attention_backward,
           aten._scaled_dot_product_flash_attention_for_cpu_backward,
           aten._scaled_dot_product_efficient_attention_backward,
           aten._scaled_dot_product_cudnn_attention_backward, counts="attention")
def _attention_backward_flops(call):
    # grad_out, q, k, v, ...: the backward does ~2.5x the forward's matmuls (dQ, dK, dV,
    # dP and the recomputed P) -> count 2x the forward as Megatron's formula does.
    grad_out, q, k, v = call.ins[:4]
    return 4 * _numel(q.shape[:-1]) * concrete(k.shape[-2]) * (
        concrete(q.shape[-1]) + concrete(v.shape[-1]))


@flop_rule(aten.embedding, aten.index_select, aten.gather, aten.index, counts="gather")
def _gather_flops(call):
    return 0


@flop_rule(aten.embedding_dense_backward, aten.index_add, aten.scatter_add, aten.index_put,
           aten._index_put_impl, counts="scatter")
def _scatter_flops(call):
    return sum(_numel(t.shape) for t in call.ins[1:2]) or _numel(call.outs[0].shape)


@flop_rule(aten.rms_norm, aten.layer_norm, aten.native_layer_norm, aten._fused_rms_norm,
           aten.native_layer_norm_backward, aten._fused_rms_norm_backward, counts="norm")
def _norm_flops(call):
    return 5 * _numel(call.ins[0].shape)


@flop_rule(aten._log_softmax, aten._softmax, aten._log_softmax_backward_data,
           aten._softmax_backward_data, aten.cross_entropy_loss, counts="softmax")
def _softmax_flops(call):
    return 3 * _numel(call.ins[0].shape)


@flop_rule(aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss_nd, aten.nll_loss,
           counts="loss")
def _nll_flops(call):
    ins = call.ins
    return _numel(ins[1].shape) if len(ins) > 1 else 0


def executed_flops(node: Node) -> int:
    """FLOPs a node's kernels execute (module docstring): its rule's count, attention under
    a causal mask halved. KeyError for an op without a rule."""
    rule = FLOP_RULES[node.target.overloadpacket]
    flops = int(rule.flops(OpCall.of_node(node)))
    return flops // 2 if rule.counts == "attention" and schema_arg(node, "is_causal") else flops


def model_flops(call: OpCall) -> int:
    """Model FLOPs of one call (module docstring): its rule's count for a matmul or attention,
    causal attention counted whole; 0 for any other op."""
    rule = FLOP_RULES.get(call.target.overloadpacket)
    return int(rule.flops(call)) if rule is not None and rule.counts in MODEL_FLOP_KINDS else 0


def node_cost(node: Node) -> Cost:
    """FLOPs and bytes of one node; placeholders, outputs and getitems cost nothing."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        if node.op == "call_function" and node.target.__module__ == "_operator":
            return Cost(0, 0)
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
            return Cost(0, 0)
        return Cost(0, 0, node.op != "call_function")
    packet = node.target.overloadpacket
    if packet in FREE_OPS or node.target.is_view:
        return Cost(0, 0)
    call = OpCall.of_node(node)
    ins, outs = call.ins, call.outs
    moved = sum(_numel(t.shape) * t.element_size() for t in ins + outs)
    if packet in FLOP_RULES:
        return Cost(executed_flops(node), moved)
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
