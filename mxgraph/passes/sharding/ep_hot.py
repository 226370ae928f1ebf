"""Hot-expert replication inside expert parallelism (`Plan.moe.hot_experts = k`): the frame
`sharding/ep.py` writes for a grouped or gathered block when k > 0.

With X the block's rows sorted by global expert and `counts` [E] its rows per expert:

  hot, mask = ep_hot_choose(counts, k, threshold,   group-wide counts -> the k hottest
                            min_rows)               experts worth it (-1: off / unused)
  send = counts * ~mask                             hot rows never enter the all-to-all
  recv = ep_counts(send); local = recv.sum(0)
  perm = argsort(mask[expert of each row])          the sent rows first (expert order),
  X_perm = X[perm]                                  then the hot rows (ascending expert)
  X_l = ep_dispatch(X_perm, send, recv, total)      as without replication
  X_hot = the last sum(counts[hot]) rows of X_perm  computed here, on replicas
  X_ext = cat(X_l, X_hot); counts_ext = cat(local, counts[hot])
  W_ext = cat(W_l, ep_hot_weights(W_l, hot))        per expert weight: E/ep + k experts
  ... the experts on X_ext with counts_ext (grouped: offsets; gathered: ids) ...
  Y = cat(ep_combine(Y_ext[:total]), Y_ext[total:])[argsort(perm)]

`ep_hot_weights` sums the replicas' gradients back to the owner (runtime/
collectives_ep_hot.py), so each expert's weight gradient is its owner's usual one plus
the replicas' parts: the same sum in another order (fp32 rounding, not bitwise). When the
load is even the choice is empty: every row is sent, no weight moves, and the frame costs
the small all-reduce of the counts.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

import mxgraph.runtime.collectives.ep_hot  # noqa: F401 - registers the ops
from mxgraph.errors import PlanError
from mxgraph.passes.sharding.moe_blocks import ExpertBlock
from mxgraph.passes.sharding.moe_dataflow import module_of, where

aten = torch.ops.aten
mx = torch.ops.mxgraph


def check_hot(sharder, block: ExpertBlock) -> None:
    """PlanError unless `block` can replicate `sharder.hot` experts."""
    local = block.num_experts // sharder.ep
    if sharder.hot >= local:
        raise PlanError(f"moe.hot_experts={sharder.hot} must be less than the experts per "
                        f"EP rank ({block.num_experts} experts / ep={sharder.ep} = {local} at "
                        f"{module_of(block.first())}); choose hot_experts in 0..{local - 1}")
    if block.form == "dense":
        raise PlanError(f"moe.hot_experts has nothing to replicate for experts that run on "
                        f"every token ({where(block.first())}: no rows cross the all-to-all, "
                        f"every rank's load is the same); set hot_experts=0")
    if block.form not in ("grouped", "gathered"):
        raise PlanError(f"moe.hot_experts is not built for a loop over experts "
                        f"({where(block.first())}): replicas join one GEMM over all local "
                        f"experts; use experts with a grouped GEMM or gathered weights, or "
                        f"set hot_experts=0")


def cost_rule(block: ExpertBlock, x: Node, ep: int) -> int:
    """The group-wide rows that make replicating an expert pay: each of its rows off the
    all-to-all saves ~(ep-1)/ep of a row four times (dispatch, combine, both backward);
    a replica costs its weights once (broadcast) and their gradients once (reduce)."""
    row = x.meta["val"]
    row_bytes = row[0].numel() * row.element_size()
    expert_bytes = sum(w.param.meta["val"].numel() // block.num_experts *
                       w.param.meta["val"].element_size() for w in block.weights)
    return math.ceil(2 * expert_bytes / (4 * row_bytes * (ep - 1) / ep))


class HotFrame:
    """The rows of one block: sent to their owners, or computed here on replicas."""

    def __init__(self, sharder, block: ExpertBlock, x: Node, counts: Node, rows: int):
        s, self.s, self.rows = sharder, sharder, rows
        self.key = module_of(block.first())
        min_rows = s.min_rows if s.min_rows is not None else cost_rule(block, x, s.ep)
        choice = s.call(mx.ep_hot_choose.default, (counts, s.hot, s.threshold, min_rows,
                                                   s.group, self.key), x)
        self.hot, mask = (s.call(operator.getitem, (choice, i), x) for i in (0, 1))
        self.send = s.call(aten.mul.Tensor, (counts, s.call(aten.logical_not.default, (mask,),
                                                            x)), x)
        self.recv = s.call(mx.ep_counts.default, (self.send, s.group), x)
        self.local = s.call(aten.sum.dim_IntList, (self.recv, [0]), x)
        expert = s.call(aten.repeat_interleave.Tensor, (counts,), x, {"output_size": rows})
        row_hot = s.call(aten._to_copy.default, (s.call(aten.index.Tensor, (mask, [expert]), x),),
                         x, {"dtype": torch.int64})
        self.perm = s.call(aten.argsort.stable, (row_hot,), x, {"stable": True})
        x_perm = s.call(aten.index.Tensor, (x, [self.perm]), x)
        valid = s.call(aten.ge.Scalar, (self.hot, 0), x)
        picked = s.call(aten.index.Tensor, (counts, [s.call(aten.clamp.default, (self.hot, 0), x)]),
                        x)
        self.hot_counts = s.call(aten.where.ScalarOther, (valid, picked, 0), x)
        self.hot_total = s.item(s.call(aten.sum.default, (self.hot_counts,), x), x, rows)
        self.total = s.item(s.call(aten.sum.default, (self.local,), x), x, s.ep * rows)
        x_local = s.call(mx.ep_dispatch.default, (x_perm, self.send, self.recv, self.total,
                                                  s.group), x)
        self.sent = s.call(operator.sub, (rows, self.hot_total), x)
        x_hot = self.split(x_perm, self.sent, self.hot_total, x)[1]
        self.x = s.call(aten.cat.default, ([x_local, x_hot],), x)
        self.counts = s.call(aten.cat.default, ([self.local, self.hot_counts],), x)

    def split(self, rows: Node, first, second, like: Node) -> tuple[Node, Node]:
        """`rows` [first + second, ...] as its first `first` and its last `second` rows.
        A split, not two narrows: Inductor lowers a narrow whose start is a data-dependent
        size (`first`) only as far as its end is not known (torch 2.13 asserts on one that
        ends at the size), and the split's sizes are the ones the frame gives."""
        parts = self.s.call(aten.split_with_sizes.default, (rows, [first, second]), like)
        return tuple(self.s.call(operator.getitem, (parts, i), like) for i in (0, 1))

    def replicate(self, views: list[Node], like: Node) -> dict[Node, Node]:
        """Per expert weight `view` [E/ep, ...]: [E/ep + k, ...], this rank's experts then
        the replicas (one `ep_hot_weights` for all of them)."""
        s, views = self.s, list(dict.fromkeys(views))
        replicas = s.call(mx.ep_hot_weights.default, (views, self.hot, s.group), like)
        return {view: s.call(aten.cat.default, ([view, s.call(
            operator.getitem, (replicas, i), like)],), like) for i, view in enumerate(views)}

    def back(self, y: Node) -> Node:
        """The experts' output rows (X_ext's order) -> X's order; inserted after `y`."""
        s = self.s
        with s.after(y):
            y_local, y_hot = self.split(y, self.total, self.hot_total, y)
            back = s.call(mx.ep_combine.default, (y_local, self.send, self.recv, self.rows,
                                                  s.group), y)
            y_perm = s.call(aten.cat.default, ([self.split(back, self.sent, self.hot_total, y)[0],
                                                y_hot],), y)
            inverse = s.call(aten.argsort.stable, (self.perm,), y, {"stable": True})
            return s.call(aten.index.Tensor, (y_perm, [inverse]), y)


__all__ = ["HotFrame", "check_hot"]
