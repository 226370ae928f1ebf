"""Expert parallelism on the forward graph: routed experts split over the "ep" group.

Rank r of the group keeps experts [r*E/ep, (r+1)*E/ep). The blocks come from
`moe_blocks.find_expert_blocks` (found by what they do, never by names); each is rewritten
so that its rows travel to the rank that owns their expert and back, with the all-to-all
ops of `mxgraph.runtime.collectives.ep`. Every form shares the frame

  recv = ep_counts(counts)                       [ep, E/ep]: rows from each rank (int64)
  local = recv.sum(0); total = item(local.sum())   rows per local expert; their sum
  X_l = ep_dispatch(X, counts, recv, total)      rows sorted by local expert
  ... the local experts on X_l ...
  Y = ep_combine(Y_l, counts, recv, N)           back in the sender's row order

Matches -> Rewrite to (per form of `moe_blocks`):

  grouped    G(X, W, cumsum(counts)) ... Y        G(X_l, W_l, cumsum(local)) ... Y_l
             (counts of any dtype: cast to int64 for the exchange; the offsets keep their
             casts and dtype); B[ids] of a per-   B_l[repeat_interleave(local)] (each local
             expert tensor B [E, ...] per row    row's local expert)
  gathered   W[ids] @ X ... Y, rows in token      perm = argsort(ids); counts =
             order (HF batched_mm)                bincount(ids); X_l = ep_dispatch(X[perm]);
                                                  ids_l = repeat_interleave(local);
                                                  W_l[ids_l] @ X_l ... Y_l;
                                                  Y = ep_combine(Y_l)[argsort(perm)]
  loop/split split(X, counts)[e] -> chain_e       split(X_l, local)[l] -> chain of expert
             (select(W, 0, e)) -> cat -> Y        r*E/ep + l with select(W_l, 0, l) -> cat
                                                  -> Y_l; other experts' chains removed
  loop/gather x[t_e] -> chain_e -> O_e, each      X = cat(x[t_e]); counts =
             combined on its own                  stack(count_nonzero(mask_e)); local chains
                                                  as above; O_e = split(Y, rows of x[t_e])[e]
                                                  for every e (its combine unchanged)
  dense      every expert on every token, bmm    this rank's experts on the group's tokens:
             over W [E, ...], summed over E      ep_all_gather of the tokens and scores,
                                                 ep_reduce_scatter of the sum over local
                                                 experts (`sharding/ep_dense.py`; EP ranks
                                                 are data-parallel ranks: their tokens differ)

With `Plan.moe.hot_experts` the grouped and gathered forms use the hot-expert frame of
`sharding/ep_hot.py` instead of the exchange and dispatch above (replicated experts' rows stay
here); with `Plan.moe.capacity_factor` this pass does nothing (`moe/capacity.py` pads
and shards the blocks).

W_l is the parameter placeholder at its local shape [E/ep, ...]. Received row counts are
data-dependent: `total` (grouped, gathered) or each local count (loop) is an `item()` in the
graph, an unbacked SymInt when traced, checked to [0, ep * rows], so every buffer has its
exact size (no padding to the worst case); the counts reach the host anyway for the
all-to-all's split sizes. New nodes go where their inputs are, then a stable topological
sort puts every node after its inputs (nodes already in order keep it).

Refused with a PlanError naming the weights, the op and module that stopped the match and
what would work: the capacity-padded form, an all-experts block with an op between its
expert GEMMs that is not per (expert, token), experts held as one module each (unstacked
weights), a block whose rows are not routed by a top-k, a match stopped partway, an expert
weight also read outside its block, ep not dividing the experts, and finding no block.

Precondition: placeholders carry meta["mx_slot_kind"]; runs before shard_tp. Guarantee:
expert parameter placeholders carry meta["ep_shard_dim"] = 0 and their local shape
[E/ep, ...] (`shard_parameters_step` cuts the model's parameters from it); meta["val"] is
re-propagated. Numerics: each row meets the same expert weights; only the order of the
weight-gradient sums changes (not bitwise). Returns `gm` unchanged when ep == 1.
"""
from __future__ import annotations

import heapq
import operator

import torch
from torch.fx import Graph, GraphModule, Node

import mxgraph.codegen.kernels  # noqa: F401 - registers mxgraph::grouped_mm
import mxgraph.runtime.collectives.ep  # noqa: F401 - registers the all-to-all ops
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import ancestors, insert_call
from mxgraph.passes.sharding.ep_dense import shard_dense
from mxgraph.passes.sharding.ep_hot import HotFrame, check_hot
from mxgraph.passes.sharding.moe_blocks import ExpertBlock, find_expert_blocks
from mxgraph.passes.sharding.moe_dataflow import grouped_args, module_of, where
from mxgraph.passes.sharding.propagate import repropagate
from mxgraph.plan import divisors

aten = torch.ops.aten
mx = torch.ops.mxgraph


def _weights_text(block: ExpertBlock, node: Node | None = None) -> str:
    """The block's expert weights for a message: the one `node` reads (through views), or
    the first, with its shape."""
    reading = [w for w in block.weights if node in w.reads or
               any(v in node.all_input_nodes for v in w.views) or w.param in node.all_input_nodes
               ] if node is not None else []
    weight = (reading or block.weights)[0]
    return f"{weight.param.meta.get('mx_slot_key', weight.param.name)} " \
           f"{list(weight.param.meta['val'].shape)}"


def _gather_ids(gather: Node) -> Node:
    """The ids of B[ids] or index_select(B, 0, ids)."""
    return gather.args[1][0] if gather.target is aten.index.Tensor else gather.args[2]


class ExpertSharder:
    def __init__(self, gm: GraphModule, ctx: CompileContext):
        self.gm, self.graph = gm, gm.graph
        self.ep = ctx.mesh.sizes["ep"]
        self.rank = ctx.mesh.coords["ep"]
        self.group = ctx.mesh.group_name("ep")
        self.params: dict[Node, int] = {}  # expert weight placeholder -> E
        self.covered: set[Node] = set()  # nodes allowed to read expert weights
        self.dead: list[Node] = []  # nodes to remove once unused
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        moe = ctx.plan.moe
        self.hot, self.threshold, self.min_rows = moe.hot_experts, moe.hot_threshold, \
            moe.hot_min_rows

    # ---- checks -----------------------------------------------------------------------
    def check(self, block: ExpertBlock) -> None:
        """PlanError for a block this pass cannot shard."""
        if block.problem is not None:
            problem = block.problem
            raise PlanError(f"expert parallelism (ep={self.ep}) found the expert weights "
                            f"{_weights_text(block, problem.node)} read by "
                            f"{where(problem.node)}, {problem.reason}; {problem.remedy}")
        num = block.num_experts
        if num % self.ep:
            raise PlanError(f"ep={self.ep} does not divide the number of routed experts "
                            f"{num} ({_weights_text(block)} at {module_of(block.first())}); "
                            f"choose ep in {divisors(num)} (ep must also divide dp)")
        if self.hot:
            check_hot(self, block)
        for weight in block.weights:
            self.params[weight.param] = num
            self.covered.update(weight.reads + weight.views)

    def check_unsharded(self) -> None:
        """Every read of an expert weight belongs to its block."""
        for param in self.params:
            for user in param.users:
                if user not in self.covered:
                    raise PlanError(
                        f"expert parallelism (ep={self.ep}) found the expert weights "
                        f"{param.meta.get('mx_slot_key', param.name)} "
                        f"{list(param.meta['val'].shape)} also read by {where(user)}, "
                        f"outside their expert block; this rank would hold only its experts' "
                        f"part; read them only in the block or set ep=1")

    # ---- helpers ----------------------------------------------------------------------
    def after(self, node: Node):
        """Insert the next nodes right after `node`, in the order they are created (fx's
        `inserting_after` puts each new node first)."""
        return self.graph.inserting_before(node.next)

    def call(self, target, args, like: Node, kwargs=None) -> Node:
        """`target(*args)` at the insertion point, with `like`'s provenance and no fake value
        (the pass re-propagates)."""
        return insert_call(self.graph, target, args, kwargs, like=like, val=None)

    def exchange(self, counts: Node, like: Node) -> tuple[Node, Node, Node]:
        """(counts as int64, recv = ep_counts(counts), local = recv.sum(0)); counts the
        pass built (no meta["val"] yet) are int64 already."""
        if "val" in counts.meta and counts.meta["val"].dtype != torch.int64:
            counts = self.call(aten._to_copy.default, (counts,), like, {"dtype": torch.int64})
        recv = self.call(mx.ep_counts.default, (counts, self.group), like)
        return counts, recv, self.call(aten.sum.dim_IntList, (recv, [0]), like)

    def item(self, tensor: Node, like: Node, upper: int) -> Node:
        """item(tensor), a received row count, with torch._check(0 <= value <= upper)
        (the bound gives memory estimates a worst case)."""
        value = self.call(aten.item.default, (tensor,), like)
        for compare, bound in ((operator.ge, 0), (operator.le, upper)):
            check = self.call(compare, (value, bound), like)
            self.call(aten._assert_scalar.default,
                      (check, f"expert parallelism: an expert at {module_of(like)} receives "
                              f"a row count outside [0, {upper}]"), like)
        return value

    def static_rows(self, x: Node, block: ExpertBlock) -> int:
        rows = x.meta["val"].shape[0]
        if not isinstance(rows, int):
            raise PlanError(f"ep={self.ep}: the rows {x.name} entering the experts at "
                            f"{module_of(block.first())} have a data-dependent count {rows}; expert "
                            f"parallelism needs a fixed number of (token, choice) rows")
        return rows

    def dispatch(self, x: Node, counts: Node, recv: Node, local: Node, rows: int,
                 like: Node) -> Node:
        total = self.item(self.call(aten.sum.default, (local,), like), like, self.ep * rows)
        return self.call(mx.ep_dispatch.default, (x, counts, recv, total, self.group), like)

    def combine(self, y: Node, counts: Node, recv: Node, rows, keep: set[Node]) -> Node:
        """ep_combine(y) right after `y`; every user of `y` outside `keep` reads it."""
        with self.after(y):
            out = self.call(mx.ep_combine.default, (y, counts, recv, rows, self.group), y)
        y.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out and u not in keep)
        return out

    # ---- forms ------------------------------------------------------------------------
    def grouped(self, block: ExpertBlock) -> None:
        x, rows = block.rows, self.static_rows(block.rows, block)
        cumsum = block.offsets[-1]
        hot = None
        with self.after(x):
            if self.hot:
                hot = HotFrame(self, block, x, self.int64(block.counts, x), rows)
                x_local, local = hot.x, hot.counts
            else:
                counts, recv, local = self.exchange(block.counts, x)
                x_local = self.dispatch(x, counts, recv, local, rows, x)
            offs_local = self.call(aten.cumsum.default, (local,) + tuple(cumsum.args[1:]),
                                   cumsum, cumsum.kwargs)
            for convert in reversed(block.offsets[:-1]):
                offs_local = self.call(convert.target, (offs_local,) + tuple(convert.args[1:]),
                                       convert, convert.kwargs)
            if block.gathers:  # each local row's local expert, for B[ids] of the block
                total = x_local.args[3] if hot is None else \
                    self.call(operator.add, (hot.total, hot.hot_total), x)
                ids_local = self.call(aten.repeat_interleave.Tensor, (local,), x,
                                      {"output_size": total})
        for node in block.nodes:
            node.replace_input_with(x, x_local)
        if hot is not None:
            with self.after(x):
                extended = hot.replicate([grouped_args(g)[1] for g in block.gemms] +
                                         [g.args[0] for g in block.gathers], x)
        for gather in block.gathers:
            gather.replace_input_with(_gather_ids(gather), ids_local)
            if hot is not None:
                gather.replace_input_with(gather.args[0], extended[gather.args[0]])
        for gemm in block.gemms:
            gemm.replace_input_with(grouped_args(gemm)[2], offs_local)
            if hot is not None:
                view = grouped_args(gemm)[1]
                gemm.replace_input_with(view, extended[view])
        if hot is not None:
            self.replace_exit(block, hot.back(block.exit))
        else:
            self.combine(block.exit, counts, recv, rows, block.nodes)

    def int64(self, counts: Node, like: Node) -> Node:
        if "val" in counts.meta and counts.meta["val"].dtype != torch.int64:
            return self.call(aten._to_copy.default, (counts,), like, {"dtype": torch.int64})
        return counts

    def replace_exit(self, block: ExpertBlock, out: Node) -> None:
        """Every user of the block's exit outside the block (and the nodes that made `out`)
        reads `out`."""
        made = ancestors([out]) - ancestors([block.exit]) - {block.exit}
        block.exit.replace_all_uses_with(out, delete_user_cb=lambda u: u not in block.nodes
                                         and u not in made and u is not out)

    def gathered(self, block: ExpertBlock) -> None:
        x, ids, rows = block.rows, block.expert_ids, self.static_rows(block.rows, block)
        num = block.num_experts
        with self.after(x):
            perm = self.call(aten.argsort.stable, (ids,), x, {"stable": True})
            zeros = self.call(aten.zeros.default, ([num],), x,
                              {"dtype": torch.int64, "device": ids.meta["val"].device})
            ones = self.call(aten.ones_like.default, (ids,), x)
            counts = self.call(aten.scatter_add.default, (zeros, 0, ids, ones), x)
            x_sorted = self.call(aten.index.Tensor, (x, [perm]), x)
            if self.hot:
                hot = HotFrame(self, block, x_sorted, counts, rows)
                x_local, local = hot.x, hot.counts
                total = self.call(operator.add, (hot.total, hot.hot_total), x)
            else:
                hot = None
                counts, recv, local = self.exchange(counts, x)
                x_local = self.dispatch(x_sorted, counts, recv, local, rows, x)
                total = x_local.args[3]
            # local expert l repeated local[l] times: each received row's local expert
            ids_local = self.call(aten.repeat_interleave.Tensor, (local,), x,
                                  {"output_size": total})
        for node in block.nodes:
            node.replace_input_with(x, x_local)
        reads = [read for weight in block.weights for read in weight.reads]
        if hot is not None:
            with self.after(x):
                extended = hot.replicate([read.args[0] for read in reads], x)
        for read in reads:
            read.replace_input_with(ids, ids_local)
            if hot is not None:
                read.replace_input_with(read.args[0], extended[read.args[0]])
        if hot is not None:
            y = hot.back(block.exit)
            self.replace_exit(block, y)
        else:
            y = self.combine(block.exit, counts, recv, rows, block.nodes)
        with self.after(y):
            inverse = self.call(aten.argsort.stable, (perm,), y, {"stable": True})
            unsorted = self.call(aten.index.Tensor, (y, [inverse]), y)
        y.replace_all_uses_with(unsorted, delete_user_cb=lambda u: u is not unsorted)

    def loop(self, block: ExpertBlock) -> None:
        num, local_num = block.num_experts, block.num_experts // self.ep
        first = self.rank * local_num
        mine = range(first, first + local_num)
        if block.rows is not None:  # split: X and counts are in the graph
            x, counts_in = block.rows, block.counts
            rows = self.static_rows(x, block)
            upper = self.ep * rows
            at = max([x, counts_in], key=self.order.get)
        else:  # gather: X = cat(pieces), counts from the masks
            at = max(block.pieces + block.masks, key=self.order.get)
            with self.after(at):
                x = self.call(aten.cat.default, (list(block.pieces),), at)
                sizes = [self.call(aten.sym_size.int, (p, 0), at) for p in block.pieces]
                rows = sizes[0]
                for size in sizes[1:]:
                    rows = self.call(operator.add, (rows, size), at)
                counts_in = self.call(aten.stack.default, (
                    [self.call(aten.count_nonzero.default, (m,), at) for m in block.masks],), at)
            at = counts_in
            upper = self.ep * int(block.masks[0].meta["val"].numel())
        with self.after(at):
            counts, recv, local_counts = self.exchange(counts_in, at)
            unbound = self.call(aten.unbind.int, (local_counts,), at)
            local_sizes = [self.item(self.call(operator.getitem, (unbound, i), at), at, upper)
                           for i in range(local_num)]
            total = local_sizes[0]
            for size in local_sizes[1:]:
                total = self.call(operator.add, (total, size), at)
            x_local = self.call(mx.ep_dispatch.default, (x, counts, recv, total, self.group),
                                at)
            split = self.call(aten.split_with_sizes.default, (x_local, local_sizes), at)
            pieces = [self.call(operator.getitem, (split, i), at) for i in range(local_num)]
        for i, e in enumerate(mine):
            for node in block.chains[e]:
                node.replace_input_with(block.pieces[e], pieces[i])
            for select in block.selects[e]:
                select.args = (select.args[0], 0, i)
        last = max((block.outputs[e] for e in mine), key=self.order.get)
        with self.after(last):
            y_local = self.call(aten.cat.default, ([block.outputs[e] for e in mine], 0), last)
        with self.after(y_local):
            y = self.call(mx.ep_combine.default, (y_local, counts, recv, rows, self.group),
                          y_local)
        if block.exit is not None:  # split: the cat of every expert's output
            block.exit.replace_all_uses_with(y)
            self.dead += [block.exit, block.pieces[0].args[0]] + list(block.pieces)
        else:  # gather: each expert's output, from its rows of Y
            with self.after(y):
                back = self.call(aten.split_with_sizes.default, (y, sizes), y)
                outs = [self.call(operator.getitem, (back, e), y) for e in range(num)]
            for e, output in enumerate(block.outputs):
                output.replace_all_uses_with(outs[e], delete_user_cb=lambda u, e=e: (
                    u not in block.chains[e] and u is not y_local))
        for e in range(num):
            if e not in mine:
                self.dead += list(block.chains[e] - {block.pieces[e]}) + \
                    list(block.weight_nodes[e])

    def dense(self, block: ExpertBlock) -> None:
        shard_dense(self, block)

    # ---- driver -----------------------------------------------------------------------
    def run(self) -> None:
        blocks = find_expert_blocks(self.gm)
        if not blocks:
            raise PlanError(f"expert parallelism (ep={self.ep}) found no routed-MoE block "
                            f"(a top-k whose indices route tokens to expert weights stacked "
                            f"[E, ...]) in this model; set ep=1")
        for block in blocks:
            self.check(block)
        self.check_unsharded()
        for block in blocks:
            getattr(self, block.form)(block)
        for node in sorted(set(self.dead), key=lambda n: self.order.get(n, -1), reverse=True):
            if not node.users and node.graph is self.graph:
                self.graph.erase_node(node)
        stable_toposort(self.graph)


def stable_toposort(graph: Graph) -> None:
    """Reorder `graph` so that every node follows its inputs, keeping the current order
    wherever it already does: a node moves only if it reads one placed after it (a node
    a rewrite inserted later), and then only as far as that input."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(position[n], n) for n in nodes if waiting[n] == 0 and n.op != "output"]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0 and user.op != "output":
                heapq.heappush(ready, (position[user], user))
    output = [n for n in nodes if n.op == "output"]
    if len(order) + len(output) != len(nodes):
        raise RuntimeError("stable_toposort: the graph has a cycle")
    for before, node in zip(order, order[1:] + output, strict=True):
        before.append(node)


def shard_ep_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Shard routed experts over the "ep" group (see module docstring)."""
    if ctx.mesh is None or ctx.mesh.sizes["ep"] == 1 or ctx.plan.moe.capacity_factor is not None:
        return gm  # capacity-padded blocks: moe/capacity.py shards them
    sharder = ExpertSharder(gm, ctx)
    sharder.run()
    for node in sharder.params:
        node.meta["ep_shard_dim"] = 0
    return repropagate(gm, {node: [node.meta["val"].shape[0] // sharder.ep,
                                   *node.meta["val"].shape[1:]] for node in sharder.params})


__all__ = ["ExpertSharder", "shard_ep_pass", "stable_toposort"]
