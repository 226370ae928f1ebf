"""Token-local regions: a routed-MoE block on token shards (sequence parallelism, context
parallelism) runs on this rank's tokens alone, as Megatron-LM's sequence-parallel MoE does.

An MoE block is a per-token function: each token's output depends on that token only (its
routing, its experts, its weights). So when its input tokens are sharded, every rank can
route, sort, count and combine its own tokens, and the outputs are this rank's shard of the
whole block's output. The placement algebra cannot say that of the ops in between (a sort
of this rank's rows is no shard of the global sort), so inside the region (`local_regions`:
from the block's routing top-k to its combine, found by `moe_blocks.find_expert_blocks`)
these rules keep every value on this rank:

  * sort/argsort along the token dim, row arithmetic on the indices (position // top-k),
    gathers and scatters along it with indices computed there (`index`, `index_put`,
    `index_add`, `scatter_add`): this rank's rows, placed as the token shard;
  * per-expert row counts (`histc`, `bincount`) are `Partial`: this rank's counts are a
    summand of the global ones (a consumer outside the region that needs them whole gets
    them all-reduced); their `cumsum` and casts stay partial; a grouped GEMM whose offsets
    are such partial counts runs on this rank's rows;
  * an `arange` of row positions (the values of an inverse permutation) is made over this
    rank's rows.
Replicated weights read there get their gradients summed as everywhere (`AxisOps.copy`).
Outside a region, and on values placed otherwise, each rule defers to the one it wraps.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from mxgraph.ir import ancestors, copy_module, descendants, op_name, packet, schema_arg
from mxgraph.passes.sharding.moe_blocks import find_expert_blocks
from mxgraph.passes.sharding.moe_dataflow import GROUPED_GEMMS
from mxgraph.passes.sharding.placement import P, Partial, R, Shard
from mxgraph.passes.sharding.propagate import Rules, placed

aten = torch.ops.aten


def local_regions(gm: GraphModule) -> list[set[Node]]:
    """The nodes of each routed-MoE block from its routing top-k to its combine, where
    every shape is static (a block with data-dependent row counts keeps its gathers: the
    rules here do not reason about them)."""
    regions = []
    for block in find_expert_blocks(gm):
        if block.topk is None or block.combine is None or block.problem is not None or \
                block.form == "dense":  # every expert on every token: the core's own rules
            continue
        nodes = descendants([block.topk]) & ancestors([block.combine])
        if not any(_data_dependent(n) for n in nodes):
            regions.append(nodes)
    return regions


def valid_regions(gm: GraphModule, trial: Callable[[GraphModule, set[Node]], list]) -> set[Node]:
    """The nodes of the token-local regions of `gm` that shard without a gather in them or
    of their values: `trial(copy, region)` shards a copy of `gm` with `region` (its nodes)
    local and returns the fallbacks. A region value is a rank's own (positions among its
    rows), so gathering one would concatenate meaningless values: a block where a rule
    gathers keeps the gathers of the rules these wrap, in every one of its ops."""
    blocks = local_regions(gm)
    for _ in range(len(blocks) + 1):
        if not blocks:
            return set()
        copies = {}
        copy = copy_module(gm, copies)
        originals = {c: node for node, c in copies.items()}
        fallbacks = trial(copy, {copies[n] for block in blocks for n in block})
        gathered = {originals.get(n) for f in fallbacks for n in (f.node, *f.inputs)}
        kept = [block for block in blocks if not block & gathered]
        if len(kept) == len(blocks):
            return set().union(*blocks)
        blocks = kept
    return set()


def _data_dependent(node: Node) -> bool:
    values = torch.utils._pytree.tree_leaves(node.meta.get("val"))
    return any(free_unbacked_symbols(v) for v in values if isinstance(v, torch.Tensor))


def _row_shard(s, value) -> Shard | None:
    p = s.of(value)
    return placed(p, s.ndim(value)) if isinstance(p, Shard) else None


def add_local_rules(rules: Rules) -> None:
    """Register the token-local rules on `rules` (TP's and CP's tables); each applies only
    to nodes in `Sharder.local_region` and defers to the rule it replaces elsewhere."""
    def local(*ops):
        """Register `fn(s, node, outside)` for `ops` inside regions; `outside(s, node)`: the
        rule it wraps (a gather where there was none)."""
        def decorate(fn):
            for op in ops:
                wrapped = rules.table.get(op) or (
                    lambda s, node: s.gather_all(node, "no sharding rule: gathered"))

                def rule(s, node, fn=fn, outside=wrapped):
                    return fn(s, node, outside) if node in s.local_region else outside(s, node)
                rules.table[op] = rule
            return fn
        return decorate

    @local(aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)
    def sort_rule(s, node, outside):
        shard = _row_shard(s, node.args[0])
        if shard is None:
            return outside(s, node)
        return (shard, shard) if packet(node) is aten.sort else shard

    @local(aten.floor_divide.default, aten.remainder.Scalar, aten.div.Tensor_mode)
    def row_arithmetic_rule(s, node, outside):
        shard = _row_shard(s, node.args[0])
        if shard is None or any(isinstance(a, Node) for a in node.args[1:]):
            return outside(s, node)
        return shard

    @local(aten.index.Tensor)
    def index_rule(s, node, outside):
        x, indices = node.args[0], node.args[1]
        shard = _row_shard(s, x)
        # this rank's rows of x at local positions, or whole x (weights) at local values
        if len(indices) != 1 or indices[0] is None or _row_shard(s, indices[0]) is None or \
                not (s.of(x) == R or shard is not None and shard.dim == 0):
            return outside(s, node)
        return Shard(0, shard.outer if shard is not None else 1)

    @local(aten.index_put.default, aten.index_put_.default)
    def index_put_rule(s, node, outside):
        target, _, values = node.args[:3]
        if _row_shard(s, target) is None:
            return outside(s, node)
        if isinstance(values, Node) and values.target is aten.arange.default and \
                s.of(values) == R:  # the positions of the rows: this rank's rows
            rows = s.full(target)[0] // s.axis.size
            positions = s.insert(node, aten.arange.default, (rows,), dict(values.kwargs))
            node.replace_input_with(values, positions)
        return s.of(target)

    @local(aten.index_add.default, aten.index_add_.default, aten.scatter_add.default,
           aten.scatter_add_.default)
    def combine_rule(s, node, outside):
        shard = _row_shard(s, node.args[0])
        if shard is None:
            return outside(s, node)
        return shard

    @local(aten.histc.default, aten.bincount.default)
    def count_rule(s, node, outside):
        return P if _row_shard(s, node.args[0]) is not None else outside(s, node)

    @local(aten.cumsum.default, aten._to_copy.default, aten.to.dtype)
    def partial_count_rule(s, node, outside):
        return P if isinstance(s.of(node.args[0]), Partial) else outside(s, node)

    def grouped(node: Node) -> bool:
        return op_name(node) in GROUPED_GEMMS

    @rules.register_if(grouped)
    def grouped_gemm_rule(s, node):
        rows, weights, offsets = node.args[0], node.args[1], schema_arg(node, "offs")
        shard = _row_shard(s, rows)
        if node in s.local_region and shard is not None and s.of(weights) == R and \
                isinstance(s.of(offsets), Partial):
            return shard
        return s.gather_all(node, "a grouped GEMM placed otherwise")


__all__ = ["add_local_rules", "local_regions", "valid_regions"]
