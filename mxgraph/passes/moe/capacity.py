"""Capacity-padded experts (`Plan.moe.capacity_factor`): every routed expert gets exactly
C rows, so every shape is static, and with ep > 1 the all-to-alls move equal blocks.

For each block of `moe_blocks.find_expert_blocks` (forms grouped, gathered, loop by split),
with N (token, choice) rows of this rank and E experts, C = max(1, ceil(N / E * factor))
(Megatron-Core's capacity, before the all-to-all). Rewrite:

  e       each row's expert: repeat_interleave(counts) (grouped, loop) or ids (gathered)
  order   rows by (e, -gate) for drop_policy "probs" (gate: the routing weight that
          multiplies the experts' output), by (e, row) for "position"; stable sorts
  p       each row's place among its expert's rows in that order
  slot    e * C + p where p < C, else E * C (dropped); recorded (`moe_capacity_slots`)
  X_pad   [E * C, ...]: X's rows at their slots, zero rows where an expert has fewer
  ep > 1  X_pad's block of rank s (experts [s E/ep, (s+1) E/ep)) -> `ep_all_to_all` ->
          [ep, E/ep, C] -> local-expert-major [E/ep * ep * C]: R = ep * C rows per local
          expert (R = C without ep)
  experts the block's own chain on static rows: grouped offsets = R, 2R, ...; gathered ids
          = arange // R; loop splits [R] * experts. batched_gemm: each grouped GEMM
          G(x, W, offs) -> bmm(x.view(E', R, k), W), each gathered bmm(W[ids], x) ->
          bmm(W, x.view(E', R, k)^T)^T
  back    the inverse all-to-all, then Y = [Y_pad; 0][slot]: a dropped row's output is 0,
          so the combine adds nothing for it (and its gate gets no gradient)

With `moe.a2a_overlap` the padded rows run as two chunks along C (ceil(C/2) and floor),
each with its own all-to-alls and a copy of the chain, so one chunk's all-to-all can fly
while the other computes (the window pass, `overlap/moe.py`, orders them).

Refused with a PlanError: the loop-by-gather form, a capacity-padded model and experts that
run on every token (the all-experts form; nothing to pad), drop_policy "probs" when no
routing weight multiplies the experts' output, batched_gemm on a loop over experts, and ep's
own refusals (`sharding/ep.py`).

Precondition: as `shard_ep` (it runs instead of it when capacity_factor is set).
Guarantee: no host sync in the block (no counts reach the host); expert parameters carry
meta["ep_shard_dim"] = 0 under ep; meta["val"] re-propagated. Numerics: with nothing
dropped each row meets the same weights as dropless (the loss equal to fp32 rounding of
the GEMM shapes); batched GEMMs round like the grouped ones.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node

import mxgraph.runtime.collectives.ep  # noqa: F401 - registers ep_all_to_all
import mxgraph.runtime.moe_stats  # noqa: F401 - registers moe_capacity_slots
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import insert_call
from mxgraph.passes.sharding.ep import ExpertSharder, stable_toposort
from mxgraph.passes.sharding.moe_blocks import ExpertBlock, find_expert_blocks
from mxgraph.passes.sharding.moe_dataflow import grouped_args, module_of, where
from mxgraph.passes.sharding.propagate import repropagate

aten = torch.ops.aten
mx = torch.ops.mxgraph
_SCALAR_USERS = (operator.ge, operator.le, operator.add, aten._assert_scalar.default)


class _Padder:
    def __init__(self, gm: GraphModule, ctx: CompileContext):
        self.gm, self.graph, moe = gm, gm.graph, ctx.plan.moe
        self.factor, self.policy, self.batched = moe.capacity_factor, moe.drop_policy, \
            moe.batched_gemm
        self.chunks = 2 if moe.a2a_overlap else 1
        mesh = ctx.mesh
        self.ep = mesh.sizes["ep"] if mesh is not None else 1
        self.sharder = ExpertSharder(gm, ctx) if self.ep > 1 else None
        self.group = mesh.group_name("ep") if self.ep > 1 else None
        self.rank = mesh.coords["ep"] if self.ep > 1 else 0
        self.params: set[Node] = set()
        self.created: set[Node] = set()  # nodes this pass wrote

    def call(self, target, *args, like: Node, **kwargs) -> Node:
        node = insert_call(self.graph, target, args, kwargs, like=like, val=None)
        self.created.add(node)
        return node

    # ---- checks -------------------------------------------------------------------------
    def check(self, block: ExpertBlock) -> None:
        if self.sharder is not None:
            self.sharder.check(block)
        elif block.problem is not None and block.form != "capacity":
            raise PlanError(f"moe.capacity_factor: the experts at {where(block.problem.node)} "
                            f"are not a whole block ({block.problem.reason})")
        if block.form == "capacity":
            raise PlanError(f"moe.capacity_factor: the experts at {module_of(block.first())} "
                            f"are already capacity-padded by the model; drop the plan's "
                            f"capacity_factor (or make the model dropless)")
        if block.form == "dense":
            raise PlanError(f"moe.capacity_factor: the experts at {module_of(block.first())} "
                            f"run on every token (no rows routed to them to pad or drop); "
                            f"drop the plan's capacity_factor")
        if block.form == "loop" and block.rows is None:
            raise PlanError(f"moe.capacity_factor is not built for experts that gather their "
                            f"rows by a routing mask ({where(block.first())}); route rows "
                            f"sorted by expert (split by counts, a grouped GEMM or gathered "
                            f"weights) or leave capacity_factor unset")
        if self.batched and block.form == "loop":
            raise PlanError(f"moe.batched_gemm is not built for a loop over experts "
                            f"({where(block.first())}: each expert runs its own GEMMs); use "
                            f"experts with a grouped GEMM or gathered weights, or turn "
                            f"batched_gemm off (capacity padding still applies)")
        for weight in block.weights:
            self.params.add(weight.param)

    def gate(self, block: ExpertBlock, rows: int) -> Node | None:
        """The per-row routing weight multiplying the experts' output [N]."""
        for user in block.exit.users:
            if user.target is aten.mul.Tensor:
                other = user.args[1] if user.args[0] is block.exit else user.args[0]
                shape = getattr(other, "meta", {}).get("val")
                if shape is not None and shape.numel() == rows and shape.shape[0] == rows:
                    return other
        return None

    # ---- slots --------------------------------------------------------------------------
    def slots(self, block: ExpertBlock, rows: int, capacity: int, like: Node) -> Node:
        num = block.num_experts
        if block.form == "gathered":
            expert = self.call(aten._to_copy.default, block.expert_ids, like=like,
                               dtype=torch.int64)
        else:
            counts = self.call(aten._to_copy.default, block.counts, like=like, dtype=torch.int64)
            expert = self.call(aten.repeat_interleave.Tensor, counts, like=like,
                               output_size=rows)
        if self.policy == "probs":
            gate = self.gate(block, rows)
            if gate is None:
                raise PlanError(f"moe.drop_policy='probs' keeps the rows with the highest "
                                f"routing weight, and no weight multiplies the experts' output "
                                f"at {module_of(block.first())}; use drop_policy='position'")
            flat = self.call(aten.reshape.default, gate, [rows], like=like)
            by_gate = self.call(aten.argsort.stable, flat, like=like, stable=True,
                                descending=True)
            within = self.call(aten.argsort.stable, self.call(
                aten.index.Tensor, expert, [by_gate], like=like), like=like, stable=True)
            order = self.call(aten.index.Tensor, by_gate, [within], like=like)
        else:
            order = self.call(aten.argsort.stable, expert, like=like, stable=True)
        zeros = self.call(aten.zeros.default, [num], like=like, dtype=torch.int64,
                          device=like.meta["val"].device)
        counts = self.call(aten.scatter_add.default, zeros, 0, expert,
                           self.call(aten.ones_like.default, expert, like=like), like=like)
        start = self.call(aten.sub.Tensor, self.call(aten.cumsum.default, counts, 0, like=like),
                          counts, like=like)
        sorted_expert = self.call(aten.index.Tensor, expert, [order], like=like)
        arange = self.call(aten.arange.default, rows, like=like, dtype=torch.int64,
                           device=like.meta["val"].device)
        place_sorted = self.call(aten.sub.Tensor, arange, self.call(
            aten.index.Tensor, start, [sorted_expert], like=like), like=like)
        place = self.call(aten.scatter.src, self.call(aten.zeros_like.default, expert, like=like),
                          0, order, place_sorted, like=like)
        kept = self.call(aten.lt.Scalar, place, capacity, like=like)
        slot = self.call(aten.add.Tensor, self.call(aten.mul.Tensor, expert, capacity, like=like),
                         place, like=like)
        slot = self.call(aten.where.ScalarOther, kept, slot, num * capacity, like=like)
        return self.call(mx.moe_capacity_slots.default, slot, num * capacity,
                         module_of(block.first()), like=like), arange

    def padded(self, x: Node, slot: Node, arange: Node, rows: int, total: int) -> Node:
        """x's rows at their slots in a [total, ...] buffer, zero rows elsewhere."""
        fill = self.call(aten.full.default, [total + 1], rows, like=x, dtype=torch.int64,
                         device=x.meta["val"].device)
        source = self.call(aten.scatter.src, fill, 0, slot, arange, like=x)
        source = self.call(aten.slice.Tensor, source, 0, 0, total, like=x)
        return self.call(aten.index.Tensor, self.with_zero_row(x, x), [source], like=x)

    # ---- the all-to-alls -------------------------------------------------------------------
    def send(self, rows: Node, local: int, cap: int, trail) -> Node:
        """[E * cap, ...] (experts in global order) -> [local * ep * cap, ...] on the owner,
        local-expert-major."""
        got = self.call(mx.ep_all_to_all.default, rows, self.group, like=rows)
        got = self.call(aten.view.default, got, [self.ep, local, cap, *trail], like=rows)
        got = self.call(aten.transpose.int, got, 0, 1, like=rows)
        return self.call(aten.reshape.default, got, [local * self.ep * cap, *trail], like=rows)

    def receive(self, y: Node, local: int, cap: int, trail) -> Node:
        """The inverse of `send`: [local * ep * cap, ...] -> [E * cap, ...]."""
        back = self.call(aten.view.default, y, [local, self.ep, cap, *trail], like=y)
        back = self.call(aten.transpose.int, back, 0, 1, like=y)
        back = self.call(aten.reshape.default, back, [self.ep * local * cap, *trail], like=y)
        return self.call(mx.ep_all_to_all.default, back, self.group, like=y)

    # ---- the experts' chain ----------------------------------------------------------------
    def chain_nodes(self, block: ExpertBlock, mine: range) -> list[Node]:
        """Nodes one chunk runs (graph order): the rows -> exit region (grouped, gathered,
        with the gathered weight reads), or the local experts' chains (loop)."""
        if block.form == "loop":
            nodes = set().union(*(block.chains[e] - {block.pieces[e]} for e in mine))
        else:
            nodes = set(block.nodes) | {r for w in block.weights for r in w.reads}
            nodes.discard(block.rows)
        return [n for n in self.graph.nodes if n in nodes]

    def run_chain(self, block: ExpertBlock, nodes: list[Node], x: Node, local: int, rows: int,
                  copy: bool, like: Node) -> Node:
        """The chain on `x` ([local * rows, ...], `rows` per local expert); the original
        nodes rewired (copy=False) or a copy. Returns its exit."""
        device = like.meta["val"].device
        env: dict[Node, Node] = {}
        if block.form == "grouped":
            offs = grouped_args(block.gemms[0])[2]
            static = self.call(aten.mul.Tensor, self.call(
                aten.arange.start, 1, local + 1, like=like, dtype=offs.meta["val"].dtype,
                device=device), rows, like=like)
            env = {block.rows: x, offs: static}
            for gemm in block.gemms:
                env[grouped_args(gemm)[2]] = static
        elif block.form == "gathered":
            ids = self.call(aten.floor_divide.default, self.call(
                aten.arange.default, local * rows, like=like, dtype=torch.int64, device=device),
                rows, like=like)
            env = {block.rows: x, block.expert_ids: ids}
        else:
            split = self.call(aten.split_with_sizes.default, x, [rows] * local, like=like)
            first = self.rank * local
            for i in range(local):
                env[block.pieces[first + i]] = self.call(operator.getitem, split, i, like=like)
            for i in range(local):
                for select in block.selects[first + i]:
                    select.args = (select.args[0], 0, i)
        mapped: dict[Node, Node] = {}
        for node in nodes:
            if copy:
                new = self.graph.node_copy(node, lambda n: mapped.get(n, env.get(n, n)))
                new.meta = {k: v for k, v in node.meta.items() if k != "val"}
                mapped[node] = new
            else:
                for old, replacement in env.items():
                    node.replace_input_with(old, replacement)
                mapped[node] = node
        if self.batched:
            for gemm in block.gemms:
                mapped[gemm] = self.batch(block, gemm, mapped[gemm], local, rows)
        if block.form == "loop":
            outs = [mapped[block.outputs[first + i]] for i in range(local)]
            return self.call(aten.cat.default, outs, like=like)
        return mapped[block.exit]

    def batch(self, block: ExpertBlock, original: Node, gemm: Node, local: int,
              rows: int) -> Node:
        """One expert GEMM (`gemm`, a chunk's copy of `original`) on [local * rows] rows ->
        bmm over [local, rows, ...]."""
        with self.graph.inserting_before(gemm):
            if block.form == "grouped":
                x, weight, _ = grouped_args(gemm)
                out = self.call(aten.bmm.default, self.call(
                    aten.view.default, x, [local, rows, -1], like=gemm), weight, like=gemm)
                out = self.call(aten.reshape.default, out, [local * rows, -1], like=gemm)
            else:
                reads = {r for w in block.weights for r in w.reads}
                a, b = gemm.args[:2]
                first = a.target is aten.index.Tensor and (a in reads or a.args[0] in
                                                           {r.args[0] for r in reads})
                read, x = (a, b) if first else (b, a)
                if read.target is not aten.index.Tensor:
                    raise PlanError(f"moe.batched_gemm: the expert GEMM {where(gemm)} does not "
                                    f"read gathered expert weights directly; turn batched_gemm "
                                    f"off")
                stack = read.args[0]
                rows3 = self.call(aten.view.default, x, [local, rows, -1], like=gemm)
                shape = list(original.meta["val"].shape[1:])
                if first:  # bmm(W[ids] [N, n, k], x [N, k, 1]) -> [N, n, 1]
                    out = self.call(aten.bmm.default, stack, self.call(
                        aten.transpose.int, rows3, 1, 2, like=gemm), like=gemm)
                    out = self.call(aten.transpose.int, out, 1, 2, like=gemm)
                else:  # bmm(x [N, 1, k], W[ids] [N, k, n]) -> [N, 1, n]
                    out = self.call(aten.bmm.default, rows3, stack, like=gemm)
                out = self.call(aten.reshape.default, out, [local * rows, *shape], like=gemm)
        gemm.replace_all_uses_with(out)
        self.graph.erase_node(gemm)
        return out

    # ---- one block ---------------------------------------------------------------------------
    def pad(self, block: ExpertBlock) -> None:
        x, num = block.rows, block.num_experts
        rows = x.meta["val"].shape[0]
        if not isinstance(rows, int):
            raise PlanError(f"moe.capacity_factor: the rows entering the experts at "
                            f"{module_of(block.first())} have a data-dependent count {rows}")
        cap = max(1, math.ceil(rows / num * self.factor))
        local = num // self.ep
        mine = range(self.rank * local, (self.rank + 1) * local)
        nodes = self.chain_nodes(block, mine)
        trail = list(x.meta["val"].shape[1:])
        out_trail = list((block.outputs[0] if block.form == "loop" else block.exit
                          ).meta["val"].shape[1:])
        with self.graph.inserting_before(x.next):
            slot, arange = self.slots(block, rows, cap, x)
            buffer = self.padded(x, slot, arange, rows, num * cap)
        sizes = [cap] if self.chunks == 1 or cap < 2 else [cap - cap // 2, cap // 2]
        outs: dict[int, Node] = {}
        first_exit = None
        # the later chunks first: they copy the chain while its nodes are still unchanged
        for index in reversed(range(len(sizes))):
            size, start = sizes[index], sum(sizes[:index])
            with self.graph.inserting_before(x.next):
                piece = buffer
                if len(sizes) > 1:
                    piece = self.call(aten.view.default, buffer, [num, cap, *trail], like=x)
                    piece = self.call(aten.slice.Tensor, piece, 1, start, start + size, like=x)
                    piece = self.call(aten.reshape.default, piece, [num * size, *trail], like=x)
                if self.ep > 1:
                    piece = self.send(piece, local, size, trail)
            exit_ = self.run_chain(block, nodes, piece, local, size * self.ep, index > 0, x)
            first_exit = exit_
            with self.graph.inserting_before(exit_.next):
                y = self.receive(exit_, local, size, out_trail) if self.ep > 1 else exit_
                outs[index] = self.call(aten.view.default, y, [num, size, *out_trail],
                                        like=exit_)
        outs = [outs[i] for i in range(len(sizes))]
        last = outs[-1]
        with self.graph.inserting_before(last.next):
            y = outs[0] if len(outs) == 1 else self.call(aten.cat.default, outs, 1, like=last)
            y = self.call(aten.reshape.default, y, [num * cap, *out_trail], like=last)
            y = self.call(aten.index.Tensor, self.with_zero_row(y, last), [slot], like=last)
        chain = set(nodes)
        (block.exit if block.form == "loop" else first_exit).replace_all_uses_with(
            y, delete_user_cb=lambda u: u not in chain and u not in self.created)
        if block.form == "loop":
            self.drop_loop(block, mine)

    def with_zero_row(self, y: Node, like: Node) -> Node:
        """[y; a row of zeros] (the row the dropped slots read)."""
        zero = self.call(aten.zeros_like.default, self.call(
            aten.slice.Tensor, y, 0, 0, 1, like=like), like=like)
        return self.call(aten.cat.default, [y, zero], like=like)

    def drop_loop(self, block: ExpertBlock, mine: range) -> None:
        """Erase the loop's old split (and its host-synced sizes) and other ranks' chains."""
        dead = [block.exit] + [n for e in range(block.num_experts) if e not in mine
                               for n in block.chains[e] | block.weight_nodes[e]]
        split = block.pieces[0].args[0]
        dead += list(block.pieces) + [split]
        for size in split.args[1]:
            if isinstance(size, Node):
                dead += [size] + [u for u in size.users if u.target in _SCALAR_USERS]
        self.erase(dead)

    def erase(self, nodes) -> None:
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        pending = sorted({n for n in nodes if n in order}, key=order.get, reverse=True)
        for _ in range(3):  # users first; scalar checks reach back several levels
            left = []
            for node in pending:
                if node.users:
                    left.append(node)
                else:
                    self.graph.erase_node(node)
            pending = left

    def run(self) -> None:
        blocks = find_expert_blocks(self.gm)
        if not blocks:
            raise PlanError("moe.capacity_factor found no routed-MoE block (a top-k whose "
                            "indices route tokens to expert weights stacked [E, ...]); unset it")
        for block in blocks:
            self.check(block)
        if self.sharder is not None:
            self.sharder.check_unsharded()
        for block in blocks:
            self.pad(block)
        _sweep(self.graph)
        stable_toposort(self.graph)


def _sweep(graph) -> None:
    """Erase unused nodes without side effects (the routing's host-synced sizes and
    checks the padded form no longer reads)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op == "call_function" and not node.users and not _random(node) and (
                    not node.is_impure() or node.target is aten._assert_scalar.default and
                    _dead_check(node)):
                graph.erase_node(node)
                changed = True


def _random(node: Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _dead_check(node: Node) -> bool:
    """An assert on a value only scalar ops of an `item()` nobody else reads compute."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target is aten.item.default:
            if any(u not in seen and u.target not in _SCALAR_USERS for u in n.users):
                return False
            continue
        if n is not node and n.target not in _SCALAR_USERS:
            return False
        todo.extend(n.all_input_nodes)
    return True


def moe_capacity_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Pad routed experts to their capacity, and shard them over "ep" when ep > 1 (module
    docstring). Returns `gm` unchanged without `Plan.moe.capacity_factor`."""
    if ctx.plan.moe.capacity_factor is None:
        return gm
    padder = _Padder(gm, ctx)
    padder.run()
    local = {}
    if padder.ep > 1:
        for node in padder.params:
            node.meta["ep_shard_dim"] = 0
            local[node] = [node.meta["val"].shape[0] // padder.ep, *node.meta["val"].shape[1:]]
    return repropagate(gm, local)


__all__ = ["moe_capacity_pass"]
