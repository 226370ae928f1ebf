"""Routed mixture-of-experts blocks of a forward graph, found by what they do (the op sets
and row-wise regions it walks: `sharding/moe_dataflow.py`).

A routed-MoE block: a top-k over per-expert scores whose indices send rows (one per token
and choice) to expert weights, the experts' computation on those rows, and a combine per
token weighted by the scores. `find_expert_blocks(gm)` finds every block from dataflow and
ops alone, starting from the expert weights: parameters stacked on an expert dim [E, ...]
read per expert (a grouped GEMM with offsets, a gather by per-row expert id, a select of
expert e, a batched GEMM over all experts), or parameters of each expert's own read by
that expert's rows only. Module and parameter names serve messages only.

"Row-wise": ops that keep dim 0 as the row, each output row from the same input row
(pointwise ops, casts, views keeping dim 0, chunk/split/slice along another dim, norms,
matmuls with a weight that is no data). N rows, E experts. Matches:

  grouped   offs = cumsum(counts [E]) (through casts; HF counts with histc);
            G(X, W, offs) per projection, G one of mxgraph::grouped_mm (mxgraph's
            expert_impl="grouped_mm"), aten._grouped_mm (HF "grouped_mm" experts in bf16),
            transformers::grouped_mm_fallback (the same in fp32); W a parameter [E, ...]
            through views keeping dim 0; X [N, ...] sorted by expert; row-wise ops between
            the GEMMs; one exit Y [N, ...]
  gathered  ids [N] per-row expert ids, rows in token order; W[ids] (aten.index) per row
            into bmm/matmul with rows X [N, ...]; row-wise ops; one exit Y (HF
            "batched_mm": X = x.repeat_interleave(k).unsqueeze(-1), bmm(W[ids], X)); an
            expert bias B[ids] joins W
  loop      expert e's rows are split_with_sizes(X, [item(counts[e]) ...])[e] (mxgraph's
            expert_impl="loop") or x[t_e] with t_e a column of where/nonzero(mask_e),
            mask_e = select(M, 0, e) or eq(ids, e) (a loop over range(E), combined by
            index_add_/scatter_add_); expert e's row-wise chain reads select(W, 0, e) of
            stacked weights (held as one module per expert: parameters of its own, found
            and refused); its output goes into one cat (dim 0) in expert order (split) or
            to its own combine (gather)
  dense     every expert on every token (`sharding/moe_dense.py`): the tokens x [T, ...]
            repeated per expert (repeat(x, [E, 1]) or expand to [E, T, ...]), per-(expert,
            token) ops weighted by a layout of the router's scores S [T, E], bmm with W
            [E, ...] read whole, one sum over the experts (Llama 4's text experts)
  capacity  bmm/baddbmm/matmul/einsum reading W [E, ...] whole, not reached as above: a
            padded [E, C, ...] buffer per expert; recognised to be refused by name (not
            dropless)

Each block records its routing top-k (or argmax; None: not a routed block) and the
combine (the first op after the exit that sums rows into tokens). A match stopped partway
is still a block, its `problem` naming the node that stopped it, why, and what would
work. HF's "eager" experts (a loop over the data-dependent `expert_hit`) never reach a
graph: torch.export refuses them. Rewrite to: see `sharding/ep.py`, the user.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxgraph.ir import CONVERT_OPS, VIEW_OPS, ancestors, descendants, packet
from mxgraph.passes.sharding.moe_dataflow import (
    BATCHED_GEMMS,
    GROUPED_GEMMS,
    SINKS,
    WEIGHT_VIEWS,
    RowRegions,
    count_of,
    expert_weight,
    grouped_args,
    is_dim0,
    is_grouped_gemm,
    is_param,
    val_of,
    where,
)
from mxgraph.passes.sharding.moe_dense import DenseMatch, find_dense

aten = torch.ops.aten
_NONZERO = frozenset({aten.nonzero.default, aten.where.default, aten.argwhere.default,
                      aten.nonzero_numpy.default})
_DROPLESS = ("ep needs a dropless form (grouped GEMM with offsets, per-row gathered expert "
             "weights, or a loop over experts); set ep=1")


@dataclass
class Problem:
    """Why a block cannot be sharded: the node that stopped the match, why, what works."""

    node: Node
    reason: str
    remedy: str = _DROPLESS


@dataclass
class ExpertWeight:
    """A parameter holding experts ([E, ...] when stacked) and the nodes reading it per
    expert (grouped: the GEMMs; gathered: the `index` gathers; loop: the `select(W, 0, e)`s;
    capacity: the batched GEMMs), through `views` that keep dim 0."""

    param: Node
    reads: list[Node]
    views: list[Node] = field(default_factory=list)


@dataclass
class ExpertBlock:
    """One routed-MoE block (module docstring); fields a form does not use stay empty."""

    form: str  # "grouped", "gathered", "loop", "dense" or "capacity"
    num_experts: int
    weights: list[ExpertWeight]
    topk: Node | None = None  # the routing top-k/argmax its counts, ids or masks come from
    rows: Node | None = None  # rows entering the experts [N, ...]: sorted by expert (grouped,
    # loop by split), in token order (gathered); None: a loop gathering each expert's rows
    counts: Node | None = None  # per-expert row counts [E] (grouped, loop by split)
    offsets: list[Node] = field(default_factory=list)  # grouped: offs, its casts, the cumsum
    expert_ids: Node | None = None  # gathered: each row's expert [N]
    gemms: list[Node] = field(default_factory=list)  # GEMMs reading the expert weights
    gathers: list[Node] = field(default_factory=list)  # grouped: B[ids] of per-expert tensors
    nodes: set[Node] = field(default_factory=set)  # grouped, gathered: rows -> exit (no rows)
    exit: Node | None = None  # the experts' output rows [N, ...] (loop by split: the cat)
    pieces: list[Node] = field(default_factory=list)  # loop: expert e's rows
    chains: list[set[Node]] = field(default_factory=list)  # loop: piece e -> output e
    outputs: list[Node] = field(default_factory=list)  # loop: expert e's output rows
    masks: list[Node] = field(default_factory=list)  # loop by gather: mask_e
    selects: list[list[Node]] = field(default_factory=list)  # loop: select(W, 0, e)s of e
    weight_nodes: list[set[Node]] = field(default_factory=list)  # loop: from e's weights alone
    stacked: bool = True  # loop: weights stacked [E, ...] (False: one module per expert)
    combine: Node | None = None
    problem: Problem | None = None
    dense: DenseMatch | None = None  # dense: the match (layout of every value, scores)

    def first(self) -> Node:
        """A node of the block's experts (for messages)."""
        return (self.gemms or self.pieces or [self.weights[0].reads[0]])[0]


def _weights(triples) -> list[ExpertWeight]:
    """ExpertWeight per parameter from (parameter, read, views), in first-read order."""
    out: dict[Node, ExpertWeight] = {}
    for param, read, views in triples:
        weight = out.setdefault(param, ExpertWeight(param, []))
        weight.reads += [read] if read not in weight.reads else []
        weight.views += [v for v in views if v not in weight.views]
    return list(out.values())



class _Finder(RowRegions):
    # ---- the experts' rows --------------------------------------------------------------
    def rows_to_exit(self, block: ExpertBlock, allowed) -> ExpertBlock:
        """The block's `nodes` and `exit`: the row-wise region from its rows, which must
        hold every expert GEMM and leave by one node."""
        region, boundary = self.region(block.rows, allowed)
        missing = [g for g in block.gemms if g not in region]
        if missing:
            on_way = ancestors(missing) & set(boundary)
            stop = min(on_way or boundary or missing, key=self.order.get)
            block.problem = Problem(stop, f"{where(stop)} between the expert GEMMs is not "
                                    "row-wise (each row sorted by expert computed on its own)")
            return block
        exits = self.exits(region - {block.rows})
        if len(exits) != 1:
            block.problem = Problem(exits[1] if exits else block.gemms[-1],
                                    f"its experts have {len(exits)} outputs, not one")
            return block
        block.nodes, block.exit = region - {block.rows}, exits[0]
        return block

    def entry(self, block: ExpertBlock, operands) -> bool:
        """Set `block.rows`: the one GEMM row operand that no expert GEMM computes."""
        later = descendants(block.gemms)
        entries = {a for g in block.gemms for a in operands(g)} - later
        if len(entries) != 1:
            block.problem = Problem(block.gemms[0], f"its expert GEMMs read rows from "
                                    f"{len(entries)} tensors, not one tensor of rows")
            return False
        block.rows = entries.pop()
        return True

    # ---- expert weights -----------------------------------------------------------------
    def weight_reads(self) -> list[tuple[str, Node, Node, list[Node]]]:
        """(kind, read, parameter, views) for each per-expert read of a parameter of 3 or
        more dims: kind "grouped", "gathered", "select" or "batched"."""
        reads = []
        for param in self.graph.find_nodes(op="placeholder"):
            todo = [(param, [])] if is_param(param) and param.meta["val"].dim() >= 3 else []
            while todo:
                node, views = todo.pop()
                for user in node.users:
                    kind = self._read_kind(user, node)
                    if kind == "view":
                        todo.append((user, views + [user]))
                    elif kind is not None:
                        reads.append((kind, user, param, views))
        return sorted(reads, key=lambda r: self.order[r[1]])

    def _read_kind(self, user: Node, value: Node) -> str | None:
        if user.target in WEIGHT_VIEWS and expert_weight(user) is not None:
            return "view"
        if is_grouped_gemm(user) and grouped_args(user)[1] is value:
            return "grouped"
        if user.target is aten.index.Tensor and user.args[0] is value and \
                len(user.args[1]) == 1 and val_of(user.args[1][0]) is not None and \
                user.args[1][0].meta["val"].dim() == 1:
            return "gathered"
        if user.target is aten.select.int and is_dim0(user.args[1], value.meta["val"].dim()):
            return "select"
        return "batched" if user.target in BATCHED_GEMMS else None

    # ---- forms ----------------------------------------------------------------------------
    def by_key(self, reads, kind: str, key) -> dict[Node, list]:
        groups: dict[Node, list] = {}
        for k, read, param, views in reads:
            if k == kind:
                groups.setdefault(key(read), []).append((param, read, views))
        return groups

    def grouped(self, offs: Node, group) -> ExpertBlock:
        num = int(group[0][0].meta["val"].shape[0])
        block = ExpertBlock("grouped", num, _weights(group), gemms=[r for _, r, _ in group])
        chain, node = [offs], offs
        while node.target in CONVERT_OPS:
            node = node.args[0]
            chain.append(node)
        counts = node.args[0] if node.target is aten.cumsum.default and \
            node.args[1] in (0, -1) else None
        if counts is None or not isinstance(val_of(counts), torch.Tensor) or \
                list(counts.meta["val"].shape) != [num]:
            block.problem = Problem(offs, f"its offsets {offs.name} are not a cumulative sum "
                                    f"of {num} per-expert row counts")
            return block
        block.counts, block.offsets = counts, chain
        if not self.entry(block, lambda g: [grouped_args(g)[0]]):
            return block
        gemms, allowed = set(block.gemms), set(chain) | {grouped_args(g)[1] for g in block.gemms}
        gathers = self.row_gathers(num, block.rows.meta["val"].shape[0],
                                   self.nearest_router([block.counts]))
        self.rows_to_exit(block, lambda user, value: (user in gemms and value in allowed) or
                          value in gathers)
        if block.problem is None:
            gathers = {g: v for g, v in gathers.items() if set(g.users) & block.nodes}
            leak = [u for g in gathers for u in g.users if u not in block.nodes and
                    u.target not in SINKS]
            if leak:
                block.problem = Problem(leak[0], "a per-expert tensor gathered for its rows "
                                        "is also read outside the experts")
            block.gathers = sorted(gathers, key=self.order.get)
            block.weights += _weights((v[0], g, v[1]) for g, v in gathers.items())
        return block

    def gathered(self, ids: Node, group) -> ExpertBlock:
        num = int(group[0][0].meta["val"].shape[0])
        for user in ids.users:  # an expert bias [E, O] read by the same ids
            found = expert_weight(user.args[0]) if user.target is aten.index.Tensor and \
                user.args[1] == [ids] and all(user is not r for _, r, _ in group) else None
            if found is not None and found[0].meta["val"].shape[0] == num:
                group.append((found[0], user, found[1]))
        block = ExpertBlock("gathered", num, _weights(group), expert_ids=ids)
        side = descendants([r for _, r, _ in group], keep=lambda u: u.target in VIEW_OPS | (
            WEIGHT_VIEWS | {aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default}))
        block.gemms = sorted({u for n in side for u in n.users if u.target in BATCHED_GEMMS},
                             key=self.order.get)
        odd = [u for n in side for u in n.users if u not in side and u.op == "call_function"
               and u.target not in BATCHED_GEMMS | {aten.add.Tensor, aten.add_.Tensor}]
        if odd or not block.gemms:
            stop = odd[0] if odd else group[0][1]
            block.problem = Problem(stop, f"per-row gathered expert weights are read by "
                                    f"{packet(stop)}, not a batched GEMM")
            return block
        if not self.entry(block, lambda g: [a for a in g.all_input_nodes if a not in side]):
            return block
        if not statically_known_true(block.rows.meta["val"].shape[0] == ids.meta["val"].shape[0]):
            block.problem = Problem(block.gemms[0], f"its rows {block.rows.name} are not one "
                                    f"per expert id ({ids.name})")
            return block
        return self.rows_to_exit(block, lambda user, value: value in side)

    def dense(self, match: DenseMatch) -> ExpertBlock:
        problem = Problem(match.problem[0], match.problem[1], "the all-experts form runs under "
                          "ep when every op between its expert GEMMs is per (expert, token) and "
                          "one sum over the experts combines them; set ep=1") \
            if match.problem else None
        return ExpertBlock("dense", match.num, _weights(match.weights), rows=match.x,
                           gemms=match.gemms, nodes=match.nodes, exit=match.exit,
                           problem=problem, dense=match)

    def capacity(self, reads) -> list[ExpertBlock]:
        """One block per routing top-k of the batched GEMMs over all experts."""
        groups = self.by_key(reads, "batched", lambda read: self.nearest_router(
            [a for a in read.all_input_nodes if a in self.data]))
        blocks = []
        for topk, group in groups.items():
            blocks.append(ExpertBlock(
                "capacity", int(group[0][0].meta["val"].shape[0]), _weights(group), topk=topk,
                gemms=[r for _, r, _ in group], problem=Problem(
                    group[0][1], "a capacity-padded form", _DROPLESS + " or route without "
                    "capacity")))
        return blocks

    # ---- loops ----------------------------------------------------------------------------
    def loops(self) -> list[ExpertBlock]:
        blocks, gathers = [], {}
        for node in self.graph.nodes:
            if node.target is aten.split_with_sizes.default:
                sources = [count_of(s) for s in node.args[1]]
                if sources and all(s is not None and s[0] is sources[0][0] for s in sources) \
                        and [s[1] for s in sources] == list(range(len(sources))):
                    blocks.append(self.split_loop(node, sources[0][0]))
            elif node.target is aten.index.Tensor and len(node.args[1]) == 1:
                found = self._selection(node.args[1][0])
                if found is not None:  # by (M or ids, rows gathered): expert e -> (piece, mask)
                    gathers.setdefault((found[0], node.args[0]), {}).setdefault(
                        found[1], (node, found[2]))
        for by_e in gathers.values():
            if sorted(by_e) == list(range(len(by_e))) and len(by_e) > 1:
                block = self.loop_chains([by_e[e][0] for e in range(len(by_e))])
                if block is not None:
                    block.masks = [by_e[e][1] for e in range(len(by_e))]
                blocks.append(block)
        return [b for b in blocks if b is not None]

    def _selection(self, index: Node) -> tuple[Node, int, Node] | None:
        """(M or ids, e, mask_e) when `index` is a column of where/nonzero(mask_e)."""
        node = index
        while node.op == "call_function" and node.target not in _NONZERO and node.target in (
                operator.getitem, aten.select.int, aten.squeeze.dim, aten.squeeze.default,
                *VIEW_OPS):
            node = node.args[0]
        mask = node.args[0] if node.target in _NONZERO else None
        if mask is not None and mask.target is aten.select.int and mask.args[1] == 0:
            return mask.args[0], mask.args[2], mask
        if mask is not None and mask.target is aten.eq.Scalar and isinstance(mask.args[1], int):
            return mask.args[0], mask.args[1], mask
        return None

    def split_loop(self, split: Node, counts: Node) -> ExpertBlock | None:
        num = len(split.args[1])
        pieces = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        block = self.loop_chains([pieces.get(e, split) for e in range(num)])
        if block is None:
            return None
        block.rows, block.counts = split.args[0], counts
        if sorted(pieces) != list(range(num)) or len(split.users) != num:
            block.problem = Problem(split, "not every expert's rows are used once")
            return block
        cats = {u for o in block.outputs for u in o.users if u.target is aten.cat.default}
        cat = cats.pop() if len(cats) == 1 else None
        if cat is None or list(cat.args[0]) != block.outputs or (cat.args[1:] or (0,))[0] != 0 \
                or any(u is not cat and u.target not in SINKS and u not in chain
                       for o, chain in zip(block.outputs, block.chains, strict=True) for u in o.users):
            block.problem = Problem(block.outputs[0], "its experts' outputs are not "
                                    "concatenated by one cat along dim 0 in expert order")
            return block
        block.exit = cat
        return block

    def loop_chains(self, pieces: list[Node]) -> ExpertBlock | None:
        """The loop block of expert e's rows `pieces[e]`; None if no chain reads expert
        weights (a split that is no expert block)."""
        num, problems = len(pieces), []
        block = ExpertBlock("loop", num, [], pieces=pieces)
        own: list[list[Node]] = []
        for e, piece in enumerate(pieces):
            chain = self.region(piece)[0] if piece.target is not \
                aten.split_with_sizes.default else {piece}
            exits = self.exits(chain)
            block.chains.append(chain)
            block.outputs.append(exits[0] if exits else piece)
            if len(exits) != 1:
                problems.append(Problem(exits[1] if exits else piece, f"expert {e}'s "
                                        f"computation has {len(exits)} outputs, not one"))
            selects, params, side = self.chain_weights(chain, e, num, problems)
            block.selects.append(selects)
            block.weight_nodes.append(side)
            own.append(params)
        readers = [p for params in own for p in params]
        own = [sorted((p for p in params if readers.count(p) == 1),  # read by this expert only
                      key=lambda p: min(self.order[u] for u in p.users)) for params in own]
        if not any(block.selects) and not any(own):
            return None
        block.weights = _weights((*expert_weight(s.args[0])[:1], s, expert_weight(s.args[0])[1])
                                 for selects in block.selects for s in selects)
        if any(own):
            block.stacked = False
            block.weights += [ExpertWeight(p, list(p.users)) for params in own for p in params]
            names = ", ".join(f"{p.meta.get('mx_slot_key', p.name)} {list(p.meta['val'].shape)}"
                              for p in own[0])
            problems.append(Problem(
                min(own[0][0].users, key=self.order.get), f"experts held as one module each "
                f"(expert 0's own parameters: {names})", "ep needs each projection's expert "
                "weights stacked in one parameter [E, ...] (as transformers' MoE experts hold "
                "them); stack them or set ep=1"))
        block.problem = problems[0] if problems else None
        return block

    def chain_weights(self, chain: set[Node], e: int, num: int, problems: list[Problem]):
        """(select(W, 0, e) reads, parameters read directly, nodes from the selects alone)
        of expert e's chain: the values it reads that are no data, back to parameters."""
        selects, params, weight_side, seen = [], [], set(), set()
        todo = [a for n in chain for a in n.all_input_nodes if a not in chain]
        while todo:
            node = todo.pop()
            if node in seen or node in self.data:
                continue
            seen.add(node)
            if node.target is aten.select.int and expert_weight(node.args[0]) is not None and \
                    is_dim0(node.args[1], node.args[0].meta["val"].dim()) and \
                    node.args[0].meta["val"].shape[0] == num:
                side = descendants([node], keep=lambda u: u not in chain)
                leak = [u for n in side for u in n.users
                        if u not in side and u not in chain and u.target not in SINKS]
                if node.args[2] % num != e:
                    problems.append(Problem(node, f"expert {e}'s rows meet expert "
                                            f"{node.args[2]}'s weights"))
                elif leak:
                    problems.append(Problem(leak[0], f"expert {e}'s weights also feed other "
                                            "computation"))
                selects.append(node)
                weight_side |= side
            elif is_param(node):
                params.append(node)
            else:
                todo.extend(node.all_input_nodes)
        return selects, params, weight_side

    def run(self) -> list[ExpertBlock]:
        reads = self.weight_reads()
        blocks = [self.grouped(offs, group) for offs, group in self.by_key(
            reads, "grouped", lambda read: grouped_args(read)[2]).items()]
        taken = {g for block in blocks for g in block.gathers}  # a grouped block's B[ids]
        reads = [r for r in reads if r[1] not in taken]
        blocks += [self.gathered(ids, group) for ids, group in self.by_key(
            reads, "gathered", lambda read: read.args[1][0]).items()]
        dense = [self.dense(match) for match in find_dense(
            self, [(param, read, views) for kind, read, param, views in reads if kind == "batched"])]
        in_dense = {g for block in dense for g in block.gemms}
        blocks += self.loops() + dense + self.capacity([r for r in reads if r[1] not in in_dense])
        covered = {r for b in blocks for w in b.weights for r in w.reads}
        for kind, read, param, views in reads:  # per-expert reads no block explains
            if read not in covered and kind == "select":
                blocks.append(ExpertBlock("loop", int(param.meta["val"].shape[0]),
                                          _weights([(param, read, views)]), problem=Problem(
                    read, "it reads one expert for rows that are neither that expert's rows "
                    "split by per-expert counts nor selected by a routing mask")))
        for block in blocks:
            if block.form != "capacity":
                block.topk = self.nearest_router(
                    [n for n in (block.counts, block.expert_ids) if n is not None] +
                    [m.args[0] for m in block.masks] +
                    [score.source for score in (block.dense.scores if block.dense else [])])
            block.combine = self.combine_of(block.exit or (block.outputs or [None])[0])
            if block.topk is None and block.problem is None:
                block.problem = Problem(block.first(), "its rows are not routed by a top-k (the "
                                        "expert counts or ids come from no topk/argmax)",
                                        "ep shards routed experts only; set ep=1")
        return sorted(blocks, key=lambda b: self.order[b.first()])


def find_expert_blocks(gm: GraphModule) -> list[ExpertBlock]:
    """Every routed-MoE block of the forward graph `gm`, in graph order (module docstring).
    Placeholders carry meta["mx_slot_kind"], nodes meta["val"]; the graph is not changed."""
    return _Finder(gm).run()


__all__ = ["BATCHED_GEMMS", "GROUPED_GEMMS", "SINKS", "ExpertBlock", "ExpertWeight", "Problem",
           "find_expert_blocks", "grouped_args", "where"]
