"""Tensor parallelism (with sequence parallelism and vocabulary parallelism) on the sharding
core (`sharding/propagate.py`, `sharding/rules.py`).

Parameter placements follow Megatron-LM, found from dataflow alone: a matmul whose input
is replicated gets its weight split along the output features (column parallel: the
output is a shard of its last dim), a matmul whose input is sharded along the contracted
features gets its weight split along them (row parallel: the output is partial, summed by
an all-reduce where a consumer needs it whole, the bias added after). A weight is split
only if every use reads it as a matmul operand the same way (a tied embedding table and LM
head: the vocabulary rows). Heads stay sharded through views into attention; a fused
projection split into pieces (`c_attn(x).split(...)`, fused gate/up) has its weight split
block by block (Megatron's fused-QKV layout). A column-parallel weight whose shard would
only be gathered again (a MoE router before its top-k) is left replicated: the pass runs
once on a copy of the graph, and the weights it blames for a gather stay whole.

Vocabulary parallelism: an embedding of the step's token ids with a split table looks up
its own rows and zeroes the others (a partial value); a cross-entropy over logits split
along the classes becomes `mxgraph::vocab_parallel_ce` (three all-reduces of one float per
token), so logits are never gathered.

Sequence parallelism (`Plan(sequence_parallel=True)`): partial values [.., s, h] are
reduce-scattered along the sequence instead of all-reduced, norms, dropout and residual
adds run on sequence shards, and a column-parallel input is all-gathered (backward:
reduce-scatter); replicated parameters read there get their gradient summed by `tp_copy`.
Numerics: equal to one device up to the order of the sums.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import mxgraph.runtime.collectives.cp  # noqa: F401 - registers the CP ops
import mxgraph.runtime.collectives.tp  # noqa: F401 - registers the collective ops
import mxgraph.runtime.collectives.vocab_parallel  # noqa: F401 - registers vocab_parallel_ce
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import COPY_LIKE_OPS, VIEW_OPS, copy_module, descendants, schema_arg
from mxgraph.passes.sharding.einsum import einsum_rule
from mxgraph.passes.sharding.placement import P, R, Shard
from mxgraph.passes.sharding.propagate import AxisOps, Rules, Sharder, placed, repropagate
from mxgraph.passes.sharding.rules import COMMON, SPLITS, addmm_rule, linear_rule, row_cross_entropy_rule, split_rule
from mxgraph.passes.sharding.token_local import add_local_rules, local_regions, valid_regions
from mxgraph.passes.sharding.writes import kept_whole
from mxgraph.plan import divisors

aten = torch.ops.aten
mx = torch.ops.mxgraph
TP = Rules(COMMON)
TP.register(aten.einsum.default)(einsum_rule)
CP_OPS = {mx.cp_chunk.default, mx.cp_all_gather.default, mx.cp_all_reduce.default,
          mx.cp_replicated.default}


class TensorSharder(Sharder):
    """The engine with TP's parameter choices and fused-projection splits."""

    def param(self, node: Node) -> bool:
        return node.op == "placeholder" and node.meta.get("mx_slot_kind") == "param"

    def choose(self, weight: Node, placement: Shard, user: Node) -> bool:
        """Give a parameter `placement` if every use reads it as the same matmul operand
        and the split dim divides; False leaves it replicated."""
        if not self.param(weight) or weight.meta.get("mx_slot_key") in self.keep_replicated:
            return False
        if weight in self.params:
            return self.params[weight] == placement
        ok = all(_reads_as_matrix(u, weight, placement.dim) for u in weight.users)
        size = self.full(weight)[placement.dim] if ok else 0
        ok = ok and size >= self.axis.size  # a dim smaller than tp (a scalar gate): whole
        if ok and size % self.axis.size:
            module = (user.meta.get("custom") or {}).get("module") or "<top>"
            raise PlanError(
                f"tp={self.axis.size} does not divide dim {placement.dim} (size {size}) of "
                f"parameter {weight.meta.get('mx_slot_key')} read by {module} ({user.target}):"
                f" the vocabulary, FFN width and heads must split evenly; choose tp in "
                f"{divisors(size)} or pad that dim")
        self.params[weight] = placement if ok else R
        self.place[weight] = self.params[weight]
        return ok

    def split_along_shard(self, node: Node):
        """A column-parallel output split into pieces along its shard (fused q/k/v or
        gate/up): the weight is split block by block, so every piece stays a shard."""
        x = node.args[0]
        source = x
        while source.op == "call_function" and (source.target in COPY_LIKE_OPS or (
                source.target in VIEW_OPS and  # [b*s, 3h] -> [b, s, 3h]: the features stay
                self.full(source)[-1] == self.full(source.args[0])[-1])):
            source = source.args[0]
        count = len(node.meta["val"])
        along = schema_arg(node, "dim", 0) % self.ndim(x)
        matmuls = (aten.linear.default, aten.addmm.default, aten.mm.default)
        if not (source.op == "call_function" and source.target in matmuls and
                node.target is not aten.unbind.int and along == self.ndim(x) - 1):
            return self.gather_all(node, "a split along the sharded dim")
        if source.target is aten.linear.default:
            params = [p for p in source.args[1:3] if p is not None]
        else:  # addmm(bias, x, W) / mm(x, W)
            params = [source.args[-1]] + ([source.args[0]] if source.target is
                                          aten.addmm.default else [])
        sizes = [t.shape[along] for t in node.meta["val"]]
        if any(size % self.axis.size for size in sizes) or any(
                not isinstance(self.params.get(p), Shard) or len(p.users) != 1 for p in params):
            return self.gather_all(node, "a split along the sharded dim")
        for param in params:
            self.blocks[param] = sizes
        if node.target is aten.split.Tensor:
            node.args = (x, node.args[1] // self.axis.size) + tuple(node.args[2:])
        elif node.target is aten.split_with_sizes.default:
            node.args = (x, [size // self.axis.size for size in sizes]) + tuple(node.args[2:])
        return (self.of(x),) * count


def _reads_as_matrix(user: Node, param: Node, dim: int) -> bool:
    if user.target is aten.linear.default:
        return user.args[1] is param
    if user.target in (aten.mm.default, aten.addmm.default):
        if user.target is aten.addmm.default and user.args[0] is param:  # the bias
            return param.meta["val"].dim() == 1 and dim == 0
        return user.args[-1] is param and param.meta["val"].dim() == 2
    return user.target is aten.embedding.default and user.args[0] is param and dim == 0 \
        and _vocab_lookup(user)


def _vocab_lookup(node: Node) -> bool:
    """An embedding that vocabulary parallelism can split: the step's token ids looked up
    with at most a padding row (no gradient scaled by frequency, no sparse gradient)."""
    extra = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "padding_idx"]
    return all(a is False for a in extra) and _reads_input(node.args[1])


@TP.register(aten.linear.default, always=True)
def tp_linear_rule(s: TensorSharder, node: Node):
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    have, last = s.of(x), s.ndim(x) - 1
    if have == R or (isinstance(have, Shard) and placed(have, s.ndim(x)).dim != last):
        if s.choose(weight, Shard(0), node):  # column parallel
            if bias is not None:
                s.choose(bias, Shard(0), node)
            s.need(node, x, R, split_user=True)  # a sequence shard is all-gathered
    elif isinstance(have, Shard) and s.choose(weight, Shard(1), node):  # row parallel
        pass
    if all(s.of(a) == R for a in node.all_input_nodes):
        return R
    return linear_rule(s, node)


@TP.register(aten.mm.default, aten.addmm.default, always=True)
def tp_mm_rule(s: TensorSharder, node: Node):
    """x @ W (+ b) with W [in, out] (GPT-2's Conv1D): column parallel splits W's dim 1."""
    x, weight = node.args[-2], node.args[-1]
    have = s.of(x)
    if s.param(weight):
        if have == R or isinstance(have, Shard) and placed(have, 2).dim == 0:
            if s.choose(weight, Shard(1), node):
                if node.target is aten.addmm.default:
                    s.choose(node.args[0], Shard(0), node)
                s.need(node, x, R, split_user=True)
        elif isinstance(have, Shard):
            s.choose(weight, Shard(0), node)
    if all(s.of(a) == R for a in node.all_input_nodes):
        return R
    if node.target is aten.addmm.default:
        return addmm_rule(s, node)
    return COMMON.table[aten.mm.default](s, node)


@TP.register(aten.embedding.default, always=True)
def vocab_embedding_rule(s: TensorSharder, node: Node):
    """The step's token ids looked up in a vocabulary-split table: this rank's rows, zeros
    elsewhere (P)."""
    weight, indices = node.args[:2]
    if s.of(indices) != R or not _vocab_lookup(node) or not s.choose(weight, Shard(0), node):
        return COMMON.table[aten.embedding.default](s, node) if s.of(indices) != R else R
    rows = s.full(weight)[0] // s.axis.size
    local = s.insert(node, aten.sub.Tensor, (indices, s.axis.rank * rows))
    low = s.insert(node, aten.ge.Scalar, (local, 0))
    high = s.insert(node, aten.lt.Scalar, (local, rows))
    valid = s.insert(node, aten.logical_and.default, (low, high))
    padding = schema_arg(node, "padding_idx", -1)  # -1: none (F.embedding made it >= 0)
    padding -= s.axis.rank * rows if padding >= 0 else 0  # the row without gradient, if here
    node.args = (weight, s.insert(node, aten.mul.Tensor, (local, valid)),
                 padding if 0 <= padding < rows else -1)
    node.kwargs = {}
    mask = s.insert(node.next, aten.unsqueeze.default, (valid, -1))
    masked = s.insert(mask.next, aten.mul.Tensor, (node, mask), placement=P)
    node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
    return P  # the lookup is partial too (only the masked value is read)


def _reads_input(value: Node) -> bool:
    """`value` is an input of the step, seen through views and copies."""
    while value.op == "call_function" and (value.target in VIEW_OPS | COPY_LIKE_OPS or
                                           value.target is mx.cp_chunk.default):
        value = value.args[0]
    return value.op == "placeholder" and value.meta.get("mx_slot_kind") == "input"


@TP.register(aten.cross_entropy_loss.default)
def vocab_cross_entropy_rule(s: TensorSharder, node: Node):
    """Logits [N, C] split along C -> `vocab_parallel_ce` (+ the reduction)."""
    logits, target = node.args[:2]
    shard = placed(s.of(logits), s.ndim(logits)) if isinstance(s.of(logits), Shard) else None
    if shard is None or shard.dim != 1 or s.ndim(logits) != 2:
        return row_cross_entropy_rule(s, node)
    if s.of(target) != R or schema_arg(node, "weight") is not None or \
            schema_arg(node, "label_smoothing", 0.0) != 0.0:
        return s.gather_all(node, "a weighted or smoothed cross-entropy of split logits")
    ignore, reduction = schema_arg(node, "ignore_index", -100), schema_arg(node, "reduction", 1)
    both = s.insert(node, mx.vocab_parallel_ce.default, (logits, target, ignore, s.axis.group))
    loss = s.insert(node, operator.getitem, (both, 0))
    result = loss
    if reduction != 0:
        result = s.insert(node, aten.sum.default, (loss,))
        if reduction == 1:
            kept = s.insert(node, aten.ne.Scalar, (target, ignore))
            result = s.insert(node, aten.div.Tensor, (result, s.insert(
                node, aten.sum.default, (kept,))))
    node.replace_all_uses_with(result)
    s.graph.erase_node(node)
    return R


@TP.register(*CP_OPS)
def context_parallel_rule(s: TensorSharder, node: Node):
    """A context-parallel collective along another dim keeps the TP placement."""
    have = s.of(node.args[0])
    along = node.args[1] if node.target in (mx.cp_chunk.default, mx.cp_all_gather.default) \
        else None
    if isinstance(have, Shard) and along is not None and \
            placed(have, s.ndim(node.args[0])).dim == along % s.ndim(node.args[0]):
        return s.gather_all(node, "a context-parallel collective along the TP shard")
    return have


add_local_rules(TP)  # after TP's own: token-local MoE regions under sequence parallelism


def _sequence_shard(sharder: TensorSharder, gm: GraphModule):
    """The sequence shard of a value: dim -2 of `[..., s, h]`, or, for `[b*s, h]` (a linear
    written on flattened tokens, as GPT-2's Conv1D), dim 0 in `b` runs (`Shard(0, outer=b)`),
    with `[b, s]` the shape of the token input (the first 2-d integer input)."""
    n = sharder.axis.size
    tokens = [p.meta["val"].shape for p in gm.graph.find_nodes(op="placeholder")
              if isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].ndim == 2 and
              not p.meta["val"].is_floating_point()]
    batch, seq = tokens[0] if tokens else (None, None)

    def shard(value: Node) -> Shard | None:
        shape = value.meta["val"].shape
        if len(shape) >= 3 and shape[-2] % n == 0:
            return Shard(len(shape) - 2)
        if len(shape) == 2 and batch is not None and shape[0] == batch * seq and seq % n == 0:
            return Shard(0, outer=batch)
        return None
    return shard


def tp_axis(ctx: CompileContext) -> AxisOps:
    mesh = ctx.mesh
    return AxisOps("tp", mesh.sizes["tp"], mesh.coords["tp"], mesh.group_name("tp"),
                   all_reduce=mx.tp_all_reduce.default, all_gather=mx.tp_all_gather.default,
                   gather_split=mx.sp_all_gather.default, slice=mx.tp_slice.default,
                   reduce_scatter=mx.sp_reduce_scatter.default, copy=mx.tp_copy.default)


def _sharder(gm: GraphModule, ctx: CompileContext, keep: set[str],
             region: set[Node] | None = None, whole: set[str] = frozenset()) -> TensorSharder:
    """A sharder for `gm`; under SP with the token-local `region` (default: every MoE
    block's, as the blame trials use); `whole`: written bases kept whole (`writes.py`)."""
    sharder = TensorSharder(gm, tp_axis(ctx), TP, strict=ctx.plan.strict_sharding,
                            keep_replicated=set(keep), whole=set(whole))
    if ctx.plan.sequence_parallel:
        sharder.sequence_shard = _sequence_shard(sharder, gm)
        sharder.local_region = set().union(*local_regions(gm)) if region is None else region
    return sharder


def _blamed(gm: GraphModule, ctx: CompileContext, keep: set[str], whole: set[str]) -> set[str]:
    """Column-parallel weights whose shard reaches a gather, or a reduction over the split
    features (a norm of a down-projection), in a trial run on a copy: Megatron's layout
    keeps such projections whole."""
    trial = _sharder(copy_module(gm), ctx, keep, whole=whole)
    trial.strict = False
    trial.run()
    events = trial.fallbacks + trial.sharded_reductions
    # a choice made on an input that an earlier event already changed is a consequence,
    # not a cause: blamed in a later round, once the cause is fixed
    tainted = descendants([e.node for e in events])
    blamed = set()
    for event in events:
        for matmul, _weight in _column_sources(trial, list(event.inputs)):
            if matmul not in tainted:
                blamed.add(_role(matmul))
    # repeated layers share one layout: a weight blamed in one layer is kept whole in all
    return {n.meta.get("mx_slot_key") for n in trial.graph.nodes
            if n.op == "call_function" and _role(n) in blamed and n.target in (
                aten.linear.default, aten.mm.default, aten.addmm.default)
            for n in [n.args[1] if n.target is aten.linear.default else n.args[-1]]
            if trial.param(n)} - keep


def _role(matmul: Node) -> tuple:
    """A matmul's place in its layer: its module path with the layer index left out."""
    custom = matmul.meta.get("custom") or {}
    layer = custom.get("layer")
    parts = (custom.get("module") or "").split(".")
    return tuple("*" if layer is not None and part == str(layer) else part for part in parts)


def _column_sources(s: TensorSharder, values: list[Node]) -> set[tuple[Node, Node]]:
    """(matmul, weight) of the column-parallel matmuls whose shard `values` carry (back
    through ops that keep a placement, up to the matmul)."""
    found, todo, seen = set(), list(values), set()
    while todo:
        value = todo.pop()
        if value in seen or s.of(value) == R:
            continue
        seen.add(value)
        if value.op == "call_function" and value.target in (aten.linear.default, aten.mm.default,
                                                            aten.addmm.default):
            weight = value.args[1] if value.target is aten.linear.default else value.args[-1]
            if s.params.get(weight) in (Shard(0), Shard(1)) and s.of(value) != P:
                found.add((value, weight))
            continue
        todo.extend(value.all_input_nodes)
    return found


def shard_tp_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Shard the forward graph for tensor parallelism (see module docstring).

    Precondition: placeholders carry meta["mx_slot_kind"]. Guarantee: parameter
    placeholders chosen for sharding carry meta["tp_shard_dim"] (and "tp_blocks") and their
    local shape; every value has a placement; fallbacks are listed in `ctx.findings`.
    Numerics: not bitwise (the order of the sums). Returns `gm` unchanged when tp == 1.
    """
    if ctx.mesh is None or ctx.mesh.sizes["tp"] == 1:
        return gm
    def lost_writes(copy: GraphModule, whole: set[str]) -> set[str]:
        s = _sharder(copy, ctx, set(), whole=whole)
        s.strict = False
        s.run()
        return set(s.lost_writes)
    whole = kept_whole(gm, lost_writes)
    keep: set[str] = set()
    layers = {(n.meta.get("custom") or {}).get("layer") for n in gm.graph.nodes}
    for _ in range(2 * len(layers) + 2):  # a round fixes the first layer a cause sits in
        blamed = _blamed(gm, ctx, keep, whole)
        if not blamed:
            break
        keep |= blamed

    def trial(copy: GraphModule, region: set[Node]) -> list:
        s = _sharder(copy, ctx, keep, region, whole)
        s.strict = False
        s.run()
        return s.fallbacks
    region = valid_regions(gm, trial) if ctx.plan.sequence_parallel else set()
    sharder = _sharder(gm, ctx, keep, region, whole)
    sharder.run()
    sharder.check_writes()
    ctx.findings += [f.describe() for f in sharder.fallbacks]
    local = {}
    for node, placement in sharder.params.items():
        if isinstance(placement, Shard):
            node.meta["tp_shard_dim"] = placement.dim
            if node in sharder.blocks:
                node.meta["tp_blocks"] = sharder.blocks[node]
            shape = list(node.meta["val"].shape)
            shape[placement.dim] //= sharder.axis.size
            local[node] = shape
    return repropagate(gm, local)


__all__ = ["SPLITS", "TP", "TensorSharder", "shard_tp_pass", "split_rule", "tp_axis"]
