"""Context parallelism: the sequence split over the CP group, on the sharding core
(`sharding/propagate.py`, `sharding/rules.py`).

Every input of the step with two or more dims ([batch, seq, ...]) is cut along dim 1 into
2*cp chunks inside the graph (`cp_chunk`: rank r keeps chunks r and 2*cp-1-r, which
balances causal attention): those values start as S(1), and the shared rules carry the
shard through per-token ops (pointwise: a replicated operand with a sequence dim, like a
RoPE table, is cut the same way; matmuls, norms, embeddings; views that merge dims in
front of the sequence give a strided shard, `Shard(d, outer)`). CP's own rules:

- attention all-gathers K and V (`cp_all_gather`, backward reduce-scatter) where they are
  smallest (before a GQA repeat); causality becomes a mask of this rank's query positions
  against every key position, and an explicit mask keeps the rows of this rank's queries
  (`cp_chunk` of its query dim), so attention stays exact;
- sums over the sequence (a mean cross-entropy included) are partial: `cp_all_reduce`
  adds them where a consumer needs the whole value.

Gradient convention: a replicated value carries a partial gradient on each rank (no copy
op), so the replicated outputs (the loss) go through `cp_replicated` (backward / cp) and the
parameters' gradients are summed over the CP group by the runtime, in the same bucket
collectives as the data-parallel average (group dp x cp: `runtime/data_parallel/buckets.py`).
Numerics: equal to the unsharded graph up to summation order.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import mxgraph.runtime.collectives.cp  # noqa: F401 - registers the ops
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import SHAPE_OPS, VIEW_OPS, schema_arg
from mxgraph.passes.sharding.einsum import einsum_rule
from mxgraph.passes.sharding.placement import R, Shard
from mxgraph.passes.sharding.propagate import AxisOps, Rules, Sharder, placed, repropagate
from mxgraph.passes.sharding.rules import COMMON
from mxgraph.passes.sharding.token_local import add_local_rules, valid_regions
from mxgraph.passes.sharding.writes import kept_whole
from mxgraph.plan import divisors

aten = torch.ops.aten
mx = torch.ops.mxgraph
CP = Rules(COMMON)
CP.register(aten.einsum.default)(einsum_rule)
add_local_rules(CP)


@CP.register(aten.scaled_dot_product_attention.default)
def sequence_attention_rule(s: Sharder, node: Node):
    """q, k, v [.., s, d] sharded on the sequence: K and V are gathered, causality is a
    mask of this rank's query positions against all key positions."""
    q, k, v = node.args[:3]
    seq = s.ndim(q) - 2
    if not all(isinstance(s.of(t), Shard) and placed(s.of(t), s.ndim(t)) == Shard(seq)
               for t in (q, k, v)):
        return COMMON.table[node.target](s, node)  # sharded otherwise (heads, say)
    mask = schema_arg(node, "attn_mask")
    if isinstance(mask, Node) and s.of(mask) != R:
        return s.gather_all(node, "attention with a sequence-sharded mask")
    if isinstance(mask, Node):  # the rows of this rank's queries, every key
        mask = s.need(node, mask, Shard(s.ndim(mask) - 2))
    keys = [_gather_early(s, t, node) for t in (k, v)]
    dropout = schema_arg(node, "dropout_p", 0.0)
    if schema_arg(node, "is_causal", False):
        mask = _causal_mask(s, q, node)
    node.args = (q, keys[0], keys[1], mask, dropout, False)
    node.kwargs = {key: val for key, val in node.kwargs.items()
                   if key not in ("attn_mask", "dropout_p", "is_causal")}
    return Shard(seq)


def _gather_early(s: Sharder, value: Node, user: Node) -> Node:
    """Gather K or V where it is smallest: before the shape-only ops leading to `user`
    (a GQA repeat by expand + reshape: the KV heads move, not the query heads); those ops
    then run on the whole value again."""
    chain = [value]  # from the attention input back towards its source
    while (chain[-1].op == "call_function" and chain[-1].target in SHAPE_OPS
           and len(chain[-1].users) == 1 and s.of(chain[-1].args[0]) != R):
        chain.append(chain[-1].args[0])
    best = min(range(len(chain)), key=lambda i: (chain[i].meta["val"].numel(), i))
    if best == 0:
        return s.need(user, value, R)
    s.need(chain[best - 1], chain[best], R)
    for node in reversed(chain[:best]):  # back to whole shapes, replicated
        if node.target in VIEW_OPS or node.target is aten.expand.default:
            node.args = (node.args[0], list(node.meta["val"].shape)) + node.args[2:]
        s.place[node] = R
    return value


def _causal_mask(s: Sharder, q: Node, user: Node) -> Node:
    """[s/cp, s] bool: a query at this rank's position i sees keys at positions <= i."""
    seq = s.full(q)[-2]
    device = q.meta["val"].device
    positions = s.insert(user, aten.arange.default, (seq,),
                         {"dtype": torch.int64, "device": device})
    mine = s.insert(user, mx.cp_chunk.default, (positions, 0, s.axis.group),
                    val=positions.meta["val"], placement=Shard(0))
    rows = s.insert(user, aten.unsqueeze.default, (mine, 1), placement=Shard(0))
    return s.insert(user, aten.ge.Tensor, (rows, positions), placement=Shard(0))


def cp_axis(ctx: CompileContext) -> AxisOps:
    mesh = ctx.mesh
    gather = mx.cp_all_gather.default  # replicated values carry partial gradients: always
    return AxisOps("cp", mesh.sizes["cp"], mesh.coords["cp"], mesh.group_name("cp"),
                   all_reduce=mx.cp_all_reduce.default, all_gather=gather,
                   gather_split=gather, slice=mx.cp_chunk.default, copy=None)


def _cut_inputs(s: Sharder) -> dict[Node, Shard]:
    """Every input [batch, seq, ...] cut by `cp_chunk` right after its placeholder."""
    seeds = {}
    for node in s.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if node.meta.get("mx_slot_kind") != "input" or not isinstance(val, torch.Tensor) \
                or val.dim() < 2 or not node.users:
            continue
        seq = val.shape[1]
        if seq % (2 * s.axis.size):
            raise PlanError(
                f"cp={s.axis.size} needs the sequence length (dim 1 of input "
                f"{node.meta.get('mx_slot_key')}, {seq}) divisible by 2*cp = "
                f"{2 * s.axis.size}; choose cp in "
                f"{[c for c in divisors(seq) if seq % (2 * c) == 0]} or pad the sequence")
        cut = s.collective(next(iter(node.users)), mx.cp_chunk.default,
                           (node, 1, s.axis.group), Shard(1))
        node.replace_all_uses_with(cut, delete_user_cb=lambda u, cut=cut: u is not cut)
        seeds[cut] = Shard(1)
    return seeds


def shard_cp_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Shard the forward graph's sequence over the CP group (see module docstring).

    Precondition: placeholders carry meta["mx_slot_kind"]; inputs are [batch, seq, ...].
    Guarantee: the graph takes the full inputs and cuts them itself; parameters are
    unchanged (their gradients are partial sums the runtime adds over the CP group);
    every node's meta["val"] is re-propagated. Returns `gm` unchanged when cp == 1.
    """
    if ctx.mesh is None or ctx.mesh.sizes["cp"] == 1:
        return gm
    def lost_writes(copy: GraphModule, whole: set[str]) -> set[str]:
        s = Sharder(copy, cp_axis(ctx), CP, whole=whole)
        s.run(_cut_inputs(s))
        return set(s.lost_writes)
    whole = kept_whole(gm, lost_writes)

    def trial(copy: GraphModule, region: set[Node]) -> list:
        s = Sharder(copy, cp_axis(ctx), CP, local_region=region, whole=whole)
        s.run(_cut_inputs(s))
        return s.fallbacks
    sharder = Sharder(gm, cp_axis(ctx), CP, strict=ctx.plan.strict_sharding,
                      local_region=valid_regions(gm, trial), whole=whole)
    sharder.run(_cut_inputs(sharder))
    sharder.check_writes()
    ctx.findings += [f.describe() for f in sharder.fallbacks]
    output = gm.graph.find_nodes(op="output")[0]
    for value in output.all_input_nodes:
        if isinstance(value.meta.get("val"), torch.Tensor) and value.meta["val"].is_floating_point():
            replicated = sharder.collective(output, mx.cp_replicated.default,
                                            (value, sharder.axis.group), R)
            output.replace_input_with(value, replicated)
    return repropagate(gm, {})
