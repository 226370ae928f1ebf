"""Expert parallelism on the forward graph: routed experts split over the "ep" group.

Rank r of the group keeps experts [r*E/ep, (r+1)*E/ep). Blocks are found by structure
and op, never by names. A dropless expert block is rows X [N, ...] sorted by expert,
per-expert row counts [E] (`counts`), and the experts' computation on those rows, in
one of two forms:

  grouped:  offs = cumsum(counts); mxgraph::grouped_mm(rows, W, offs) for expert
            weights W = a parameter [E, ...] (through transposes/permutes that keep dim 0
            and dtype casts), with row-wise pointwise ops between them, from X to one
            exit Y [N, ...].
  loop:     split_with_sizes(X, [item(counts[e]) for e]); piece e runs through its own
            chain of ops that reads expert weights only as select(W, 0, e); the chains'
            outputs are concatenated (dim 0) into Y.

Rewrite to (the all-to-all ops are `mxgraph.runtime.collectives_ep`):

  recv = ep_counts(counts)                       [ep, E/ep]: rows from each rank
  local = recv.sum(0); total = item(...)         rows per local expert; their sum
  X_l = ep_dispatch(X, counts, recv, total)      rows sorted by local expert
  ... the local experts on X_l (grouped: offs = cumsum(local); loop: split by local,
      chains of experts r*E/ep + l kept with select(W, 0, l), the others removed) ...
  Y = ep_combine(Y_l, counts, recv, N)           back in the original row order

Received row counts are data-dependent: `total` (grouped) or each local count (loop)
is an `item()` in the graph, an unbacked SymInt when traced, so every buffer has its
exact size (no padding to the ep*N worst case); the counts must reach the host anyway
for the all-to-all's split sizes.

Precondition: placeholders carry meta["mx_slot_kind"]; runs before shard_tp. Guarantee:
expert parameter placeholders carry meta["ep_shard_dim"] = 0 and their local shape
[E/ep, ...]; meta["val"] is re-propagated. A parameter of 3 or more dims read by select,
index or a batched GEMM outside a matched block (e.g. the capacity-padded form) raises
PlanError, as does finding no block at all. Numerics: each row meets the same expert
weights; only the order of the weight-gradient sums changes (not bitwise). Returns `gm`
unchanged when ep == 1.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import mxgraph.codegen.kernels  # noqa: F401 - registers mxgraph::grouped_mm
import mxgraph.runtime.collectives_ep  # noqa: F401 - registers the all-to-all ops
from mxgraph.capture import set_parameter
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import COPY_LIKE_OPS, ancestors, closure, descendants, insert_call, is_op
from mxgraph.passes.sharding import repropagate
from mxgraph.plan import divisors

aten = torch.ops.aten
mx = torch.ops.mxgraph

GROUPED_MM = mx.grouped_mm.default  # (rows, weights [G, I, O], offs [G]) -> rows
WEIGHT_VIEWS = COPY_LIKE_OPS | {aten.transpose.int, aten.permute.default}
"""Ops between an expert weight [E, ...] and its GEMM that keep dim 0 (permutes checked)."""
ROW_OPS = COPY_LIKE_OPS | {aten.type_as.default}
"""Row-wise ops allowed between expert GEMMs, besides pointwise ones."""
SINKS = {aten._assert_tensor_metadata.default}  # read a value, produce nothing
EXPERT_READS = {aten.select.int, aten.index.Tensor, aten.bmm.default, aten.baddbmm.default,
                aten.matmul.default, aten.einsum.default}
HINT = ("expert parallelism shards dropless MoE blocks (expert_impl='grouped_mm' or "
        "'loop', capacity_factor=None); use expert_impl='grouped_mm' or set ep=1")


def _is_grouped_mm(node: Node) -> bool:
    return is_op(node, GROUPED_MM)


def _where(node: Node) -> str:
    module = (node.meta.get("custom") or {}).get("module") or "<root>"
    return f"{node.name} ({node.target}) in module {module}"


def _expert_weight(node: Node) -> tuple[Node, list[Node]] | None:
    """The parameter placeholder read whole through views that keep dim 0, and the views."""
    chain = []
    while node.op == "call_function" and node.target in WEIGHT_VIEWS:
        ndim = node.args[0].meta["val"].dim()
        if node.target is aten.transpose.int and 0 in (d % ndim for d in node.args[1:3]):
            return None
        if node.target is aten.permute.default and node.args[1][0] % ndim != 0:
            return None
        chain.append(node)
        node = node.args[0]
    if node.op == "placeholder" and node.meta.get("mx_slot_kind") == "param":
        return node, chain
    return None


def _count_of(value) -> tuple[Node, int] | None:
    """(counts, e) when `value` is item(unbind(counts)[e]) or item(select(counts, 0, e))."""
    if not isinstance(value, Node) or value.target is not aten.item.default:
        return None
    src = value.args[0]
    if src.target is operator.getitem and src.args[0].target is aten.unbind.int and \
            (src.args[0].args[1:] or (0,))[0] == 0:
        return src.args[0].args[0], src.args[1]
    if src.target is aten.select.int and src.args[1] == 0:
        return src.args[0], src.args[2]
    return None


class _ExpertSharder:
    def __init__(self, gm: GraphModule, ctx: CompileContext):
        self.gm, self.graph = gm, gm.graph
        self.ep = ctx.mesh.sizes["ep"]
        self.rank = ctx.mesh.coords["ep"]
        self.group = ctx.mesh.group_name("ep")
        self.params: dict[Node, int] = {}  # expert weight placeholder -> E
        self.covered: set[Node] = set()  # nodes allowed to read expert weights
        self.dead: list[Node] = []  # nodes to remove once unused
        self.data = self._data_dependent()
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}

    def _data_dependent(self) -> set[Node]:
        data = set()
        for node in self.graph.nodes:
            if (node.op == "placeholder" and node.meta.get("mx_slot_kind") == "input") or (
                    node.op == "call_function" and any(a in data for a in node.all_input_nodes)):
                data.add(node)
        return data

    # ---- helpers ----------------------------------------------------------------------
    def call(self, target, args, like: Node) -> Node:
        """`target(*args)` at the insertion point, with `like`'s provenance and no fake value
        (the pass re-propagates)."""
        return insert_call(self.graph, target, args, like=like, val=None)

    def num_experts(self, counts: Node, where: Node) -> int:
        value = counts.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise PlanError(f"ep={self.ep}: the expert counts of {_where(where)} are not a "
                            f"1-D tensor; {HINT}")
        num = int(value.shape[0])
        if num % self.ep:
            raise PlanError(f"ep={self.ep} does not divide the number of routed experts "
                            f"{num} ({_where(where)}); choose ep in {divisors(num)} (ep must "
                            f"also divide dp)")
        return num

    def add_param(self, param: Node, num: int, where: Node) -> None:
        if int(param.meta["val"].shape[0]) != num:
            raise PlanError(f"ep={self.ep}: {param.name} {list(param.meta['val'].shape)} is "
                            f"read as expert weights by {_where(where)}, but the block has "
                            f"{num} experts; {HINT}")
        self.params[param] = num

    def exchange(self, counts: Node, like: Node) -> tuple[Node, Node]:
        """recv = ep_counts(counts); local = recv.sum(0), before `like`."""
        with self.graph.inserting_before(like):
            recv = self.call(mx.ep_counts.default, (counts, self.group), like)
            local = self.call(aten.sum.dim_IntList, (recv, [0]), like)
        return recv, local

    def item(self, tensor: Node, like: Node, upper: int) -> Node:
        """item(tensor), a received row count, with torch._check(0 <= value <= upper)
        (the bound gives memory estimates a worst case), before `like`."""
        with self.graph.inserting_before(like):
            value = self.call(aten.item.default, (tensor,), like)
            for compare, bound in ((operator.ge, 0), (operator.le, upper)):
                check = self.call(compare, (value, bound), like)
                self.call(aten._assert_scalar.default,
                          (check, f"expert parallelism: {like.name} receives a row count "
                                  f"outside [0, {upper}]"), like)
        return value

    def combine(self, y: Node, counts: Node, recv: Node, rows: int) -> Node:
        with self.graph.inserting_after(y):
            out = self.call(mx.ep_combine.default, (y, counts, recv, rows, self.group), y)
        y.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)
        return out

    def static_rows(self, x: Node, where: Node) -> int:
        rows = x.meta["val"].shape[0]
        if not isinstance(rows, int):
            raise PlanError(f"ep={self.ep}: the sorted rows {x.name} of {_where(where)} have "
                            f"a data-dependent count {rows}; {HINT}")
        return rows

    def check_outside(self, node: Node, where: Node) -> None:
        if node in self.data:
            raise PlanError(f"ep={self.ep}: {_where(where)} reads {node.name}, a value with "
                            f"rows other than the expert block's sorted rows; {HINT}")

    # ---- grouped form -----------------------------------------------------------------
    def grouped(self, gmms: list[Node]) -> None:
        offs = gmms[0].args[2]
        if offs.target is not aten.cumsum.default or offs.args[1] not in (0, -1):
            raise PlanError(f"ep={self.ep}: the offsets {offs.name} of {_where(gmms[0])} are "
                            f"not cumsum(per-expert counts); {HINT}")
        counts = offs.args[0]
        num = self.num_experts(counts, gmms[0])
        for gmm in gmms:
            found = _expert_weight(gmm.args[1])
            if found is None:
                raise PlanError(f"ep={self.ep}: the weights of {_where(gmm)} are not a "
                                f"parameter [E, ...] read whole; {HINT}")
            self.add_param(found[0], num, gmm)
            self.covered.update(found[1] + [gmm])
        gset = set(gmms)
        region = self._between(gmms)
        entries = {g.args[0] for g in gmms if g.args[0] not in region}
        if len(entries) != 1:
            raise PlanError(f"ep={self.ep}: the expert GEMMs around {_where(gmms[0])} read "
                            f"rows from {len(entries)} tensors, not one sorted-rows tensor; "
                            f"{HINT}")
        x = entries.pop()
        for node in region - gset:
            if node.op != "call_function" or not (
                    node.target in ROW_OPS or (isinstance(node.target, torch._ops.OpOverload)
                                               and torch.Tag.pointwise in node.target.tags)):
                raise PlanError(f"ep={self.ep}: {_where(node)} between expert GEMMs is not "
                                f"row-wise; {HINT}")
            for arg in node.all_input_nodes:
                if arg not in region and arg is not x:
                    self.check_outside(arg, node)
        exits = [n for n in region if any(u not in region and u.target not in SINKS
                                          for u in n.users)]
        if len(exits) != 1:
            raise PlanError(f"ep={self.ep}: the expert block of {_where(gmms[0])} has "
                            f"{len(exits)} outputs, not one; {HINT}")
        rows = self.static_rows(x, gmms[0])
        first = min(gmms, key=lambda n: self.order[n])
        recv, local = self.exchange(counts, first)
        with self.graph.inserting_before(first):
            total_t = self.call(aten.sum.default, (local,), first)
        total = self.item(total_t, first, self.ep * rows)  # ep ranks send <= N rows
        with self.graph.inserting_before(first):
            x_local = self.call(mx.ep_dispatch.default, (x, counts, recv, total, self.group),
                                first)
            offs_local = insert_call(self.graph, aten.cumsum.default,
                                     (local,) + tuple(offs.args[1:]), offs.kwargs, like=offs,
                                     val=None)
        for node in region:
            node.replace_input_with(x, x_local)
        for gmm in gmms:
            gmm.replace_input_with(offs, offs_local)
        self.combine(exits[0], counts, recv, rows)

    def _between(self, gmms: list[Node]) -> set[Node]:
        """Nodes on a path from one expert GEMM to another (the GEMMs included)."""
        down = descendants(gmms)
        up = ancestors(gmms, keep=down.__contains__)
        return down & up

    # ---- loop form --------------------------------------------------------------------
    def loop(self, split: Node) -> None:
        sizes = split.args[1]
        sources = [_count_of(s) for s in sizes]
        counts = sources[0][0]
        num = self.num_experts(counts, split)
        if len(sizes) != num or any(s is None or s != (counts, e)
                                    for e, s in enumerate(sources)):
            raise PlanError(f"ep={self.ep}: {_where(split)} does not split the sorted rows "
                            f"by the per-expert counts in expert order; {HINT}")
        x = split.args[0]
        rows = self.static_rows(x, split)
        pieces = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        if sorted(pieces) != list(range(num)) or len(split.users) != num:
            raise PlanError(f"ep={self.ep}: not every expert's rows of {_where(split)} are "
                            f"used once; {HINT}")

        def is_cat(n):  # of every expert's output
            return n.target is aten.cat.default and len(n.args[0]) == num

        chains = [closure([pieces[e]], lambda n: n.users, stop=is_cat) for e in range(num)]
        cats = {n for chain in chains for n in chain if is_cat(n)}
        cat = cats.pop() if len(cats) == 1 else None
        if cat is None or (cat.args[1:] or (0,))[0] != 0:
            raise PlanError(f"ep={self.ep}: the expert outputs of {_where(split)} are not "
                            f"concatenated by one cat along dim 0 in expert order; {HINT}")
        checked = [self._chain(e, chains[e] - {cat}, pieces[e], cat, num) for e in range(num)]
        local = num // self.ep
        first = self.rank * local
        recv, local_counts = self.exchange(counts, split)
        with self.graph.inserting_before(split):
            unbound = self.call(aten.unbind.int, (local_counts,), split)
            parts = [self.call(operator.getitem, (unbound, i), split) for i in range(local)]
        sizes_local = [self.item(p, split, self.ep * rows) for p in parts]
        with self.graph.inserting_before(split):
            total = sizes_local[0]
            for size in sizes_local[1:]:
                total = self.call(operator.add, (total, size), split)
            x_local = self.call(mx.ep_dispatch.default, (x, counts, recv, total, self.group),
                                split)
            new_split = self.call(aten.split_with_sizes.default, (x_local, sizes_local), split)
            new_pieces = [self.call(operator.getitem, (new_split, i), split)
                          for i in range(local)]
        for i in range(local):
            pieces[first + i].replace_all_uses_with(new_pieces[i])
            for select in checked[first + i][0]:
                select.args = (select.args[0], 0, i)
        with self.graph.inserting_before(cat):
            y_local = self.call(aten.cat.default,
                                ([cat.args[0][first + i] for i in range(local)], 0), cat)
        self.combine(cat, counts, recv, rows)
        cat.replace_all_uses_with(y_local)  # the combine read `cat`; now it reads y_local
        self.dead += [cat, split] + list(pieces.values())
        for e in range(num):
            if not first <= e < first + local:
                self.dead += list(chains[e] - {cat}) + checked[e][1]

    def _chain(self, e: int, chain: set[Node], piece: Node, cat: Node, num: int
               ) -> tuple[list[Node], list[Node]]:
        """Check expert e's chain: its rows come from `piece` only, expert weights are read
        as select(W, 0, e), its value leaves only through cat input e. Returns the selects
        and the other nodes the chain reads (weights, constants: removed with the chain
        when unused)."""
        if cat.args[0][e] not in chain:
            raise PlanError(f"ep={self.ep}: expert {e}'s output is not input {e} of "
                            f"{_where(cat)}; {HINT}")
        for node in chain:
            outside = [u for u in node.users if u not in chain and u.target not in SINKS]
            if outside and (outside != [cat] or node is not cat.args[0][e]):
                raise PlanError(f"ep={self.ep}: {_where(node)} of expert {e} is read outside "
                                f"the expert ({outside[0].name}); {HINT}")
        weight_side, selects = set(), []
        todo = [a for n in chain - {piece} for a in n.all_input_nodes if a not in chain]
        while todo:
            node = todo.pop()
            if node in weight_side:
                continue
            self.check_outside(node, cat)
            weight_side.add(node)
            if node.target is aten.select.int and node.args[0].op == "placeholder" and \
                    node.args[0].meta.get("mx_slot_kind") == "param" and \
                    node.args[0].meta["val"].dim() >= 3:
                if node.args[1] != 0 or node.args[2] != e:
                    raise PlanError(f"ep={self.ep}: expert {e}'s rows meet {_where(node)}, "
                                    f"not select(weights, 0, {e}); {HINT}")
                self.add_param(node.args[0], num, node)
                selects.append(node)
            elif node.op == "call_function":
                todo.extend(node.all_input_nodes)
        derived = descendants(selects, keep=weight_side.__contains__)
        for node in derived:
            if any(u not in chain and u not in weight_side for u in node.users):
                raise PlanError(f"ep={self.ep}: {_where(node)} feeds expert {e} and other "
                                f"computation; {HINT}")
        self.covered.update(selects)
        return selects, [n for n in weight_side if n.op == "call_function"]

    # ---- driver -----------------------------------------------------------------------
    def run(self) -> None:
        by_offs: dict[Node, list[Node]] = {}
        splits = []
        for node in self.graph.nodes:
            if _is_grouped_mm(node):
                by_offs.setdefault(node.args[2], []).append(node)
            elif node.target is aten.split_with_sizes.default and \
                    _count_of(node.args[1][0]) is not None:
                splits.append(node)
        if not by_offs and not splits:
            self.check_unsharded()
            raise PlanError(f"ep={self.ep}: found no dropless expert block to shard; {HINT}")
        for gmms in by_offs.values():
            self.grouped(gmms)
        for split in splits:
            self.loop(split)
        self.check_unsharded()
        for node in sorted(set(self.dead), key=lambda n: self.order[n], reverse=True):
            if not node.users:
                self.graph.erase_node(node)

    def check_unsharded(self) -> None:
        """Every read of an expert weight is covered; no other expert-like weight is read
        per expert (a form this pass does not know would be left unsharded)."""
        for param, num in self.params.items():
            for user in param.users:
                if user not in self.covered:
                    raise PlanError(f"ep={self.ep}: expert weights {param.name} are also read "
                                    f"by {_where(user)}; {HINT}")
        for node in self.graph.find_nodes(op="placeholder"):
            if node in self.params or node.meta.get("mx_slot_kind") != "param" or \
                    node.meta["val"].dim() < 3:
                continue
            reads = closure([node], lambda n: n.users if n is node or (
                n.target in WEIGHT_VIEWS) else [])
            bad = [n for n in reads if n.target in EXPERT_READS or _is_grouped_mm(n)]
            if bad:
                raise PlanError(f"ep={self.ep}: {node.name} {list(node.meta['val'].shape)} is "
                                f"read per expert by {_where(bad[0])}, a form expert "
                                f"parallelism cannot shard; {HINT}")


def shard_ep_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Shard routed experts over the "ep" group (see module docstring)."""
    if ctx.mesh is None or ctx.mesh.sizes["ep"] == 1:
        return gm
    sharder = _ExpertSharder(gm, ctx)
    sharder.run()
    for node in sharder.params:
        node.meta["ep_shard_dim"] = 0
    return repropagate(gm, {node: [node.meta["val"].shape[0] // sharder.ep,
                                   *node.meta["val"].shape[1:]] for node in sharder.params})


def shard_expert_parameters(model: torch.nn.Module, gm: GraphModule,
                            ctx: CompileContext) -> set[int]:
    """Replace each expert parameter the pass sharded by this rank's experts (dim 0), in
    the model itself (every alias too). Returns the ids of the local expert parameters
    (their gradients are reduced over "edp", not "dp")."""
    if ctx.mesh is None or ctx.mesh.sizes["ep"] == 1:
        return set()
    ep, rank = ctx.mesh.sizes["ep"], ctx.mesh.coords["ep"]
    named = dict(model.named_parameters(remove_duplicate=False))
    ids = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.meta.get("ep_shard_dim") is None:
            continue
        full = named[node.meta["mx_slot_key"]]
        if full.shape == node.meta["val"].shape:
            ids.add(id(full))  # already sharded by an earlier compile
            continue
        shard = torch.nn.Parameter(full.detach().chunk(ep, 0)[rank].clone(),
                                   requires_grad=full.requires_grad)
        for name, param in named.items():
            if param is full:
                set_parameter(model, name, shard)
        ids.add(id(shard))
    return ids
