"""Routed mixture-of-experts blocks of a forward graph, found by what they do.

A routed-MoE block is a top-k over per-expert scores whose indices send rows (one per
token and choice) to expert weights, the experts' computation on those rows, and a combine
per token weighted by the scores. `find_expert_blocks(gm)` finds every block from dataflow
and ops alone, starting from the expert weights: parameters stacked on an expert dim
[E, ...] read per expert (a grouped GEMM with offsets, a gather by per-row expert id, a
select of expert e, a batched GEMM over all experts), or each expert's own parameters read
by that expert's rows only. Module and parameter names are read for messages only.

"Row-wise" below: ops that keep dim 0 as the row and compute each output row from the
same input row (pointwise ops, casts, copies, views keeping dim 0, chunk/split/slice along
another dim, norms over the last dims, matmuls with a weight that is not data). N rows,
E experts.

Matches:

  grouped   offs = cumsum(counts) (through casts)      counts [E], any dtype (HF: histc)
            G(X, W, offs) for each expert projection    G: mxgraph::grouped_mm (mxgraph's
                                                        expert_impl="grouped_mm"),
                                                        aten._grouped_mm (HF "grouped_mm"
                                                        experts in bf16),
                                                        transformers::grouped_mm_fallback
                                                        (the same in fp32); W a parameter
                                                        [E, ...] through views keeping dim 0
            row-wise ops between, one exit Y [N, ...]   X [N, ...] sorted by expert
  gathered  W[ids] (aten.index) per row, bmm/matmul     ids [N] per-row expert ids, rows in
            with rows X [N, ...]; row-wise ops, exit Y  token order (HF "batched_mm":
                                                        X = x.repeat_interleave(k)
                                                        .unsqueeze(-1), W[ids] @ X); an
                                                        expert bias B[ids] joins W
  loop      rows of expert e, either                    counts [E]; mask_e a boolean mask
              split_with_sizes(X, [item(counts[e])])[e] of expert e's (token, choice) slots
              (mxgraph's expert_impl="loop"), or
              x[t_e], t_e from where/nonzero(mask_e),   mask_e = select(M, 0, e) or
              mask_e = select(M, 0, e) | eq(ids, e)     eq(ids, e): a loop over range(E)
                                                        with index_add_/scatter_add_
            expert e's row-wise chain reads select(W, 0, e) of stacked weights (or, held
            as a list of modules, parameters of its own: found, not shardable); its output
            goes into one cat (dim 0) in expert order (split) or to its own combine
  capacity  bmm/baddbmm/matmul/einsum reading W [E, ...] whole: a padded [E, C, ...]
            buffer per expert. Recognised so that it is refused by name: not dropless.

Each block also records the routing top-k (or argmax) its counts, ids or masks come from
(None if none: not a routed block) and, where found, the combine (the first op after the
exit that sums rows into tokens: index_add, scatter_add, a sum over the top-k dim). A
match stopped partway is still a block, with `problem` naming the node that stopped it,
why, and what would work. Hugging Face's "eager" experts (a loop over the data-dependent
`expert_hit`) never reach a graph: torch.export refuses them.

Rewrite to: see `shard_ep.py` (expert parallelism), the one user.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxgraph.ir import CAST_OPS, CONVERT_OPS, COPY_LIKE_OPS, VIEW_OPS, op_name, packet

aten = torch.ops.aten

GROUPED_GEMMS = frozenset({"mxgraph::grouped_mm", "aten::_grouped_mm",
                           "transformers::grouped_mm_fallback"})
"""Grouped GEMMs with offsets, by op name (`ir.op_name`): (rows, weights [E, I, O], offs)."""
BATCHED_GEMMS = frozenset({aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
                           aten.einsum.default})
"""Batched matmuls: over per-row gathered weights (gathered), or over experts (capacity)."""
WEIGHT_VIEWS = COPY_LIKE_OPS | {aten.transpose.int, aten.permute.default}
"""Ops between a stacked expert weight [E, ...] and its read that keep dim 0."""
SINKS = frozenset({aten._assert_tensor_metadata.default})
"""Ops that read a value and produce nothing (never an exit's user)."""
ROUTERS = frozenset({aten.topk.default, aten.argmax.default, aten.max.dim})
"""Ops whose indices route rows to experts (argmax and max: top-1)."""
COMBINES = frozenset({aten.index_add.default, aten.index_add_.default,
                      aten.scatter_add.default, aten.scatter_add_.default,
                      aten.index_put.default, aten.index_put_.default,
                      aten.scatter_reduce.two, aten.sum.dim_IntList})
"""Ops that sum expert output rows into tokens."""
_NONZERO = frozenset({aten.nonzero.default, aten.where.default, aten.argwhere.default,
                      aten.nonzero_numpy.default})
_ROW_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                         aten.slice.Tensor, aten.narrow.default, aten.select.int})
_ROW_MATMULS = frozenset({aten.linear.default, aten.mm.default, aten.matmul.default})
_NORMS = frozenset({aten.rms_norm.default, aten.layer_norm.default,
                    aten.native_layer_norm.default})
_ALONG_DIM = frozenset({aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                        aten._log_softmax.default})


@dataclass
class Problem:
    """Why a block found cannot be sharded: the node that stopped the match, what it is,
    and what would work."""

    node: Node
    reason: str
    remedy: str


@dataclass
class ExpertWeight:
    """A parameter holding experts, and the nodes that read it per expert."""

    param: Node
    """The parameter placeholder ([E, ...] when stacked)."""
    reads: list[Node]
    """grouped: the GEMMs (weight operand); gathered: the `index` gathers; loop: the
    `select(W, 0, e)`s; capacity: the batched GEMMs."""
    views: list[Node] = field(default_factory=list)
    """Views between the placeholder and its reads (they keep dim 0)."""


@dataclass
class ExpertBlock:
    """One routed-MoE block (module docstring). Fields a form does not use stay empty."""

    form: str
    """"grouped", "gathered", "loop" or "capacity"."""
    num_experts: int
    weights: list[ExpertWeight]
    topk: Node | None = None
    """The routing top-k/argmax node its counts, ids or masks come from."""
    rows: Node | None = None
    """The rows entering the experts [N, ...]: sorted by expert (grouped, loop by split),
    in token order (gathered); None for a loop that gathers each expert's rows apart."""
    counts: Node | None = None
    """Per-expert row counts [E] (grouped: the cumsum's input; loop by split)."""
    offsets: list[Node] = field(default_factory=list)
    """grouped: the offsets the GEMMs read, and the cast/cumsum chain below each."""
    expert_ids: Node | None = None
    """gathered: each row's expert [N]."""
    gemms: list[Node] = field(default_factory=list)
    """grouped, gathered, capacity: the GEMMs that read expert weights."""
    nodes: set[Node] = field(default_factory=set)
    """grouped, gathered: the experts' computation, `rows` to `exit` (rows excluded)."""
    exit: Node | None = None
    """The experts' output rows [N, ...] (grouped, gathered; loop by split: the cat)."""
    pieces: list[Node] = field(default_factory=list)
    """loop: expert e's rows."""
    chains: list[set[Node]] = field(default_factory=list)
    """loop: expert e's row-wise computation (from its piece, included, to its output)."""
    outputs: list[Node] = field(default_factory=list)
    """loop: expert e's output rows."""
    masks: list[Node] = field(default_factory=list)
    """loop by gather: mask_e, whose nonzero entries are expert e's rows."""
    selects: list[list[Node]] = field(default_factory=list)
    """loop: expert e's `select(W, 0, e)` reads of stacked weights."""
    weight_nodes: list[set[Node]] = field(default_factory=list)
    """loop: the nodes computed from expert e's weights alone (its selects included)."""
    stacked: bool = True
    """loop: the experts' weights are stacked [E, ...] (False: each expert's own)."""
    combine: Node | None = None
    problem: Problem | None = None

    @property
    def module(self) -> str:
        return module_of(self.first())

    def first(self) -> Node:
        """A node of the block's experts (for messages)."""
        return (self.gemms or self.pieces or [self.weights[0].reads[0]])[0]


def module_of(node: Node) -> str:
    return (node.meta.get("custom") or {}).get("module") or "<top>"


def where(node: Node) -> str:
    """`aten.bmm at layers.1.mlp.experts` (for messages)."""
    return f"{packet(node)} at {module_of(node)}"


def _is_param(node) -> bool:
    return isinstance(node, Node) and node.op == "placeholder" and \
        node.meta.get("mx_slot_kind") == "param"


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _same(a, b) -> bool:
    return a is b or (a is not None and b is not None and statically_known_true(a == b))


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _is_grouped(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        op_name(node) in GROUPED_GEMMS


def grouped_args(node: Node) -> tuple[Node, Node, Node]:
    """(rows, weights, offs) of a grouped GEMM, positional or keyword."""
    names = [a.name for a in node.target._schema.arguments[:3]]
    return tuple(node.args[i] if i < len(node.args) else node.kwargs[n]
                 for i, n in enumerate(names))


def expert_weight(node: Node) -> tuple[Node, list[Node]] | None:
    """The parameter placeholder `node` reads whole through views keeping dim 0, and the
    views (outermost last)."""
    chain = []
    while node.op == "call_function" and node.target in WEIGHT_VIEWS:
        ndim = node.args[0].meta["val"].dim()
        if node.target is aten.transpose.int and 0 in (_norm_dim(d, ndim) for d in node.args[1:3]):
            return None
        if node.target is aten.permute.default and _norm_dim(node.args[1][0], ndim) != 0:
            return None
        chain.append(node)
        node = node.args[0]
    return (node, chain) if _is_param(node) else None


def count_of(value) -> tuple[Node, int] | None:
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


def data_dependent(graph: Graph) -> set[Node]:
    """The user inputs and every node computed from them."""
    data = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.meta.get("mx_slot_kind") == "input") or (
                node.op == "call_function" and any(a in data for a in node.all_input_nodes)):
            data.add(node)
    return data


def _dim_arg(node: Node, index: int, default: int = 0):
    return node.args[index] if len(node.args) > index else node.kwargs.get("dim", default)


class _Finder:
    def __init__(self, gm: GraphModule):
        self.graph = gm.graph
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.data = data_dependent(self.graph)

    # ---- row-wise regions ---------------------------------------------------------------
    def keeps_rows(self, node: Node, region: set[Node], rows) -> bool:
        """`node`, reading region values, keeps dim 0 as the row (module docstring)."""
        target = node.target
        if target is operator.getitem:
            return node.args[0] in region
        if not isinstance(target, torch._ops.OpOverload):
            return False
        value, first = _val(node), node.args[0]
        if target in _ROW_SPLITS or target is aten.unbind.int:
            dim = _dim_arg(node, 1 if target in (aten.unbind.int, aten.select.int,
                                                  aten.slice.Tensor, aten.narrow.default)
                           else 2)
            return first in region and _norm_dim(dim, first.meta["val"].dim()) != 0
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or \
                not _same(value.shape[0], rows):
            return False
        ins = [a for a in node.all_input_nodes if a in region]
        if target in COPY_LIKE_OPS or target in CAST_OPS or torch.Tag.pointwise in target.tags:
            return all(a.meta["val"].dim() == value.dim() for a in ins)
        if target in VIEW_OPS:
            return True  # dim 0 kept (checked above)
        if target is aten.transpose.int:
            return 0 not in (_norm_dim(d, value.dim()) for d in node.args[1:3])
        if target is aten.permute.default:
            return _norm_dim(node.args[1][0], value.dim()) == 0
        if target in (aten.unsqueeze.default, aten.squeeze.dim):
            return _norm_dim(node.args[1], value.dim() + (target is aten.unsqueeze.default)) != 0
        if target in _NORMS:
            return ins == [first]
        if target in _ALONG_DIM:
            return _norm_dim(node.args[1], value.dim()) != 0
        if target in _ROW_MATMULS:
            return ins == [first]
        if target in (aten.bmm.default, aten.baddbmm.default):
            return True  # the batch dim is the row (shape checked above)
        return _is_grouped(node) and grouped_args(node)[0] in region

    def region(self, start: Node, allowed=lambda user, value: False
               ) -> tuple[set[Node], list[Node]]:
        """`start` and the nodes computed from it row-wise (`keeps_rows`) whose other
        inputs are not data-dependent (or `allowed(user, value)`), in graph order; and the
        boundary: users of region nodes refused (the op that stopped the region)."""
        rows = start.meta["val"].shape[0]
        region, boundary, seen = {start}, [], {start}
        todo = [(self.order[u], u) for u in start.users]
        heapq.heapify(todo)
        while todo:
            _, node = heapq.heappop(todo)
            if node in seen:
                continue
            seen.add(node)
            if node.target in SINKS:
                continue
            ok = node.op == "call_function" and \
                self.keeps_rows(node, region, rows) and \
                all(a in region or a not in self.data or allowed(node, a)
                    for a in node.all_input_nodes)
            if not ok:
                boundary.append(node)
                continue
            region.add(node)
            for user in node.users:
                if user not in seen:
                    heapq.heappush(todo, (self.order[user], user))
        return region, boundary

    def exits(self, region: set[Node]) -> list[Node]:
        return sorted((n for n in region if any(u not in region and u.target not in SINKS
                                                 for u in n.users)), key=self.order.get)

    def stopper(self, boundary: list[Node], target: Node) -> Node:
        """The boundary node on the way to `target` (else the first boundary node)."""
        on_way = [b for b in boundary if b is target or self._reaches(b, target)]
        return min(on_way or boundary or [target], key=self.order.get)

    def _reaches(self, node: Node, target: Node) -> bool:
        limit = self.order[target]
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            if n is target:
                return True
            if n in seen or self.order[n] > limit:
                continue
            seen.add(n)
            todo.extend(n.users)
        return False

    def ancestors_before(self, nodes: list[Node]) -> set[Node]:
        """Every node the `nodes` read, transitively."""
        seen, todo = set(), [a for n in nodes for a in n.all_input_nodes]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.all_input_nodes)
        return seen

    # ---- expert weights -----------------------------------------------------------------
    def weight_reads(self) -> list[tuple[str, Node, Node, list[Node]]]:
        """(kind, read, parameter, views) for each per-expert read of a parameter of 3 or
        more dims: kind "grouped", "gathered", "select" or "batched"."""
        reads = []
        for param in self.graph.find_nodes(op="placeholder"):
            if not _is_param(param) or param.meta["val"].dim() < 3:
                continue
            todo = [(param, [])]
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
        if _is_grouped(user) and grouped_args(user)[1] is value:
            return "grouped"
        if user.target is aten.index.Tensor and user.args[0] is value and \
                len(user.args[1]) == 1 and _val(user.args[1][0]) is not None and \
                user.args[1][0].meta["val"].dim() == 1:
            return "gathered"
        if user.target is aten.select.int and _norm_dim(user.args[1], value.meta["val"].dim()) == 0:
            return "select"
        if user.target in BATCHED_GEMMS:
            return "batched"
        return None

    # ---- forms ----------------------------------------------------------------------------
    def grouped(self, reads) -> list[ExpertBlock]:
        by_offs: dict[Node, list] = {}
        for kind, read, param, views in reads:
            if kind == "grouped":
                by_offs.setdefault(grouped_args(read)[2], []).append((read, param, views))
        return [self._grouped_block(offs, group) for offs, group in by_offs.items()]

    def _grouped_block(self, offs: Node, group) -> ExpertBlock:
        gemms = [g for g, _, _ in group]
        weights = _weights((param, read, views) for read, param, views in group)
        num = int(group[0][1].meta["val"].shape[0])
        block = ExpertBlock("grouped", num, weights, gemms=gemms)
        chain, node = [offs], offs
        while node.target in CONVERT_OPS:
            node = node.args[0]
            chain.append(node)
        if node.target is not aten.cumsum.default or node.args[1] not in (0, -1):
            block.problem = Problem(offs, f"its offsets {offs.name} are not a cumulative sum of "
                                    f"per-expert row counts", _DROPLESS)
            return block
        block.counts, block.offsets = node.args[0], chain
        counts_val = _val(block.counts)
        if not isinstance(counts_val, torch.Tensor) or counts_val.dim() != 1 or \
                counts_val.shape[0] != num:
            block.problem = Problem(node, f"its offsets count {counts_val and list(counts_val.shape)}"
                                    f" groups for {num} experts", _DROPLESS)
            return block
        gemm_out = set(gemms) | self._descendants(gemms)
        entries = {grouped_args(g)[0] for g in gemms} - gemm_out
        if len(entries) != 1:
            block.problem = Problem(gemms[0], f"its expert GEMMs read rows from {len(entries)} "
                                    f"tensors, not one tensor of rows sorted by expert",
                                    _DROPLESS)
            return block
        block.rows = entries.pop()
        gemm_set = set(gemms)
        allowed = set(chain) | {grouped_args(g)[1] for g in gemms}
        return self._rows_to_exit(block, lambda user, value: user in gemm_set and value in allowed)

    def gathered(self, reads) -> list[ExpertBlock]:
        by_ids: dict[Node, list] = {}
        for kind, read, param, views in reads:
            if kind == "gathered":
                by_ids.setdefault(read.args[1][0], []).append((read, param, views))
        return [self._gathered_block(ids, group) for ids, group in by_ids.items()]

    def _gathered_block(self, ids: Node, group) -> ExpertBlock:
        num = int(group[0][1].meta["val"].shape[0])
        for user in ids.users:  # an expert bias [E, O] read by the same ids
            if user.target is aten.index.Tensor and user.args[1] == [ids] and \
                    all(user is not r for r, _, _ in group):
                found = expert_weight(user.args[0])
                if found is not None and found[0].meta["val"].shape[0] == num:
                    group.append((user, found[0], found[1]))
        weights = _weights((param, read, views) for read, param, views in group)
        block = ExpertBlock("gathered", num, weights, expert_ids=ids)
        side = set()  # the gathered weights, through views
        for read, _, _ in group:
            side |= self._views_of(read)
        gemms = sorted({u for n in side for u in n.users if u.target in BATCHED_GEMMS},
                       key=self.order.get)
        odd = [u for n in side for u in n.users if u not in side and u.target not in BATCHED_GEMMS
               and u.op == "call_function" and u.target not in (aten.add.Tensor, aten.add_.Tensor)]
        if odd or not gemms:
            stop = odd[0] if odd else group[0][0]
            block.problem = Problem(stop, "per-row gathered expert weights are read by "
                                    f"{packet(stop)}, not a batched GEMM", _DROPLESS)
            return block
        block.gemms = gemms
        gemm_out = set(gemms) | self._descendants(gemms)
        entries = {a for g in gemms for a in g.all_input_nodes if a not in side} - gemm_out
        if len(entries) != 1:
            block.problem = Problem(gemms[0], f"its expert GEMMs read rows from {len(entries)} "
                                    "tensors, not one", _DROPLESS)
            return block
        block.rows = entries.pop()
        if not _same(block.rows.meta["val"].shape[0], ids.meta["val"].shape[0]):
            block.problem = Problem(gemms[0], f"its rows {block.rows.name} are not one per "
                                    f"expert id ({ids.name})", _DROPLESS)
            return block
        return self._rows_to_exit(block, lambda user, value: value in side)

    def _views_of(self, read: Node) -> set[Node]:
        out, todo = set(), [read]
        while todo:
            n = todo.pop()
            out.add(n)
            todo.extend(u for u in n.users if u.target in VIEW_OPS | WEIGHT_VIEWS | {
                aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default})
        return out

    def _rows_to_exit(self, block: ExpertBlock, allowed) -> ExpertBlock:
        region, boundary = self.region(block.rows, allowed)
        missing = [g for g in block.gemms if g not in region]
        if missing:
            stop = self.stopper(boundary, missing[0])
            block.problem = Problem(stop, f"{where(stop)} between the expert GEMMs is not "
                                    "row-wise (each row of the rows sorted by expert computed "
                                    "on its own)", _DROPLESS)
            return block
        exits = self.exits(region - {block.rows})
        if len(exits) != 1:
            block.problem = Problem(exits[1] if exits else block.gemms[-1],
                                    f"its experts have {len(exits)} outputs, not one", _DROPLESS)
            return block
        block.nodes, block.exit = region - {block.rows}, exits[0]
        return block

    def _descendants(self, nodes) -> set[Node]:
        seen, todo = set(), [u for n in nodes for u in n.users]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.users)
        return seen

    def capacity(self, reads) -> list[ExpertBlock]:
        """One block per routing top-k of the batched GEMMs over all experts."""
        by_router: dict[Node | None, list] = {}
        for kind, read, param, views in reads:
            if kind == "batched":
                data = [a for a in read.all_input_nodes if a in self.data]
                by_router.setdefault(self.nearest_router(data), []).append((param, read, views))
        blocks = []
        for topk, group in by_router.items():
            block = ExpertBlock("capacity", int(group[0][0].meta["val"].shape[0]),
                                _weights(group), topk=topk, gemms=[r for _, r, _ in group])
            block.problem = Problem(group[0][1], "a capacity-padded form",
                                    _DROPLESS + " or route without capacity")
            blocks.append(block)
        return blocks

    # ---- loops ----------------------------------------------------------------------------
    def loops(self) -> list[ExpertBlock]:
        blocks = []
        gathers: dict[tuple[Node, Node], dict[int, tuple[Node, Node]]] = {}
        for node in self.graph.nodes:
            if node.target is aten.split_with_sizes.default:
                sources = [count_of(s) for s in node.args[1]]
                if sources and all(s is not None and s[0] is sources[0][0] for s in sources) \
                        and [s[1] for s in sources] == list(range(len(sources))):
                    blocks.append(self._split_loop(node, sources[0][0]))
            elif node.target is aten.index.Tensor and len(node.args[1]) == 1:
                found = self._selection(node.args[1][0])
                if found is not None:
                    key, e, mask = found
                    gathers.setdefault((key, node.args[0]), {}).setdefault(e, (node, mask))
        for key, by_e in gathers.items():
            if sorted(by_e) == list(range(len(by_e))) and len(by_e) > 1:
                blocks.append(self._gather_loop([by_e[e] for e in range(len(by_e))]))
        return [b for b in blocks if b is not None]

    def _selection(self, index: Node) -> tuple[Node, int, Node] | None:
        """(M or ids, e, mask_e) when `index` is a column of where/nonzero(mask_e)."""
        node = index
        while node.target in (operator.getitem, aten.select.int, aten.squeeze.dim,
                              aten.squeeze.default, *VIEW_OPS) and node.op == "call_function":
            node = node.args[0]
            if node.target in _NONZERO:
                break
        if node.target not in _NONZERO:
            return None
        mask = node.args[0]
        if mask.target is aten.select.int and mask.args[1] == 0:
            return mask.args[0], mask.args[2], mask
        if mask.target is aten.eq.Scalar and isinstance(mask.args[1], int):
            return mask.args[0], mask.args[1], mask
        return None

    def _split_loop(self, split: Node, counts: Node) -> ExpertBlock | None:
        num = len(split.args[1])
        pieces = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        block = self._loop_chains([pieces.get(e, split) for e in range(num)], num)
        if block is None:
            return None
        block.rows, block.counts = split.args[0], counts
        if sorted(pieces) != list(range(num)) or len(split.users) != num:
            block.problem = Problem(split, "not every expert's rows are used once", _DROPLESS)
            return block
        cats = {u for o in block.outputs for u in o.users if u.target is aten.cat.default}
        cat = cats.pop() if len(cats) == 1 else None
        if cat is None or list(cat.args[0]) != block.outputs or (cat.args[1:] or (0,))[0] != 0 \
                or any(u is not cat and u.target not in SINKS for o in block.outputs
                       for u in o.users if u not in block.chains[block.outputs.index(o)]):
            block.problem = Problem(block.outputs[0], "its experts' outputs are not "
                                    "concatenated by one cat along dim 0 in expert order",
                                    _DROPLESS)
            return block
        block.exit = cat
        return block

    def _gather_loop(self, selections: list[tuple[Node, Node]]) -> ExpertBlock | None:
        block = self._loop_chains([piece for piece, _ in selections], len(selections))
        if block is not None:
            block.masks = [mask for _, mask in selections]
        return block

    def _loop_chains(self, pieces: list[Node], num: int) -> ExpertBlock | None:
        """The loop block of expert e's rows `pieces[e]`; None if no chain reads expert
        weights (a split that is no expert block)."""
        chains, outputs, per_expert = [], [], []
        problem = None
        for e, piece in enumerate(pieces):
            chain, _ = self.region(piece) if piece.op == "call_function" and \
                piece.target is not aten.split_with_sizes.default else ({piece}, [])
            chains.append(chain)
            exits = self.exits(chain)
            outputs.append(exits[0] if exits else piece)
            if len(exits) != 1 and problem is None:
                problem = Problem(exits[1] if exits else piece,
                                  f"expert {e}'s computation has {len(exits)} outputs, not one",
                                  _DROPLESS)
            per_expert.append(self._chain_weights(chain, e, num))
        stacked = {w for reads, _, _, _ in per_expert for w in reads}
        own = [ps for _, ps, _, _ in per_expert]
        if not stacked and not any(own):
            return None
        readers: dict[Node, int] = {}
        for params in own:
            for p in params:
                readers[p] = readers.get(p, 0) + 1
        own = [sorted((p for p in params if readers[p] == 1), key=lambda p: min(
            self.order[u] for u in p.users)) for params in own]  # in the order they are read
        weights = _weights((*expert_weight(w.args[0])[:1], w, expert_weight(w.args[0])[1])
                           for reads, _, _, _ in per_expert for w in reads)
        block = ExpertBlock("loop", num, weights, pieces=pieces, chains=chains,
                            outputs=outputs, problem=problem,
                            selects=[reads for reads, _, _, _ in per_expert],
                            weight_nodes=[side for _, _, _, side in per_expert])
        bad = next((p for _, _, p, _ in per_expert if p is not None), None)
        if bad is not None and block.problem is None:
            block.problem = bad
        if any(own):
            block.stacked = False
            block.weights += [ExpertWeight(p, list(p.users)) for params in own for p in params]
            if block.problem is None:
                names = ", ".join(f"{p.meta.get('mx_slot_key', p.name)} "
                                  f"{list(p.meta['val'].shape)}" for p in own[0])
                block.problem = Problem(
                    min(own[0][0].users, key=self.order.get), f"experts held as one module each (expert 0's "
                    f"own parameters: {names})",
                    "ep needs each projection's expert weights stacked in one parameter "
                    "[E, ...] (as transformers' MoE experts hold them); stack them or set "
                    "ep=1")
        return block

    def _chain_weights(self, chain: set[Node], e: int, num: int):
        """(select(W, 0, e) reads, parameters read directly, a Problem or None) of expert
        e's chain: the non-data values it reads, back to parameters."""
        selects, params, problem, weight_side = [], [], None, set()
        todo = [a for n in chain for a in n.all_input_nodes if a not in chain]
        seen = set()
        while todo:
            node = todo.pop()
            if node in seen or node in self.data:
                continue
            seen.add(node)
            if node.target is aten.select.int and expert_weight(node.args[0]) is not None and \
                    _norm_dim(node.args[1], node.args[0].meta["val"].dim()) == 0 and \
                    node.args[0].meta["val"].shape[0] == num:
                if node.args[2] % num != e and problem is None:
                    problem = Problem(node, f"expert {e}'s rows meet expert {node.args[2]}'s "
                                      f"weights", _DROPLESS)
                side, walk = set(), [node]  # the weight's values up to the chain
                while walk:
                    n = walk.pop()
                    if n not in side and n not in chain:
                        side.add(n)
                        walk.extend(n.users)
                leak = [u for n in side for u in n.users
                        if u not in side and u not in chain and u.target not in SINKS]
                if leak and problem is None:
                    problem = Problem(leak[0], f"expert {e}'s weights also feed other "
                                      "computation", _DROPLESS)
                selects.append(node)
                weight_side |= side
            elif _is_param(node):
                params.append(node)
            else:
                todo.extend(node.all_input_nodes)
        return selects, params, problem, weight_side

    # ---- routing --------------------------------------------------------------------------
    def router(self, block: ExpertBlock) -> Node | None:
        """The nearest top-k/argmax whose indices the block's routing values come from."""
        if block.form == "capacity":
            return block.topk
        return self.nearest_router([n for n in (block.counts, block.expert_ids)
                                    if n is not None] + [m.args[0] for m in block.masks])

    def nearest_router(self, starts: list[Node]) -> Node | None:
        todo, seen = list(starts), set()
        while todo:
            node = todo.pop(0)
            if node in seen:
                continue
            seen.add(node)
            if node.target is operator.getitem and node.args[0].target in ROUTERS:
                if node.args[1] == 1:
                    return node.args[0]
                continue
            if node.target in (aten.argmax.default,):
                return node
            todo.extend(node.all_input_nodes)
        return None

    def combine_of(self, block: ExpertBlock) -> Node | None:
        start = block.exit or (block.outputs[0] if block.outputs else None)
        if start is None:
            return None
        todo, seen = [(self.order[u], u) for u in start.users], set()
        heapq.heapify(todo)
        while todo:
            _, node = heapq.heappop(todo)
            if node in seen:
                continue
            seen.add(node)
            if node.target in COMBINES:
                return node
            for u in node.users:
                heapq.heappush(todo, (self.order[u], u))
        return None

    def run(self) -> list[ExpertBlock]:
        reads = self.weight_reads()
        blocks = self.grouped(reads) + self.gathered(reads) + self.loops() + \
            self.capacity(reads)
        covered = {r for b in blocks for w in b.weights for r in w.reads}
        for kind, read, param, views in reads:  # per-expert reads no block explains
            if read not in covered and kind == "select":
                block = ExpertBlock("loop", int(param.meta["val"].shape[0]),
                                    _weights([(param, read, views)]))
                block.problem = Problem(read, f"it reads one expert ({param.name}[{read.args[2]}]"
                                        ") for rows that are not that expert's rows split by "
                                        "per-expert counts or selected by a routing mask",
                                        _DROPLESS)
                blocks.append(block)
        for block in blocks:
            block.topk = self.router(block)
            block.combine = self.combine_of(block)
            if block.topk is None and block.problem is None and block.form != "capacity":
                block.problem = Problem(block.first(), "its rows are not routed by a top-k "
                                        "(the expert counts or ids come from no topk/argmax)",
                                        "ep shards routed experts only; set ep=1")
        return sorted(blocks, key=lambda b: self.order[b.first()])


_DROPLESS = ("ep needs a dropless form (grouped GEMM with offsets, per-row gathered expert "
             "weights, or a loop over experts); set ep=1")


def _weights(triples) -> list[ExpertWeight]:
    """ExpertWeight per parameter from (parameter, read, views) triples, in first-read order."""
    out: dict[Node, ExpertWeight] = {}
    for param, read, views in triples:
        weight = out.setdefault(param, ExpertWeight(param, []))
        if read not in weight.reads:
            weight.reads.append(read)
        weight.views += [v for v in views if v not in weight.views]
    return list(out.values())


def find_expert_blocks(gm: GraphModule) -> list[ExpertBlock]:
    """Every routed-MoE block of the forward graph `gm`, in graph order (module docstring).
    Placeholders carry meta["mx_slot_kind"] and every node meta["val"]; the graph is not
    changed."""
    return _Finder(gm).run()


def stable_toposort(graph: Graph) -> None:
    """Reorder `graph` so every node follows its inputs, keeping the current order where
    it already does (a rewrite that made a node read one defined later)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
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
    for before, node in zip(order, order[1:] + output):
        before.append(node)


__all__ = ["ExpertBlock", "ExpertWeight", "Problem", "find_expert_blocks", "grouped_args",
           "stable_toposort", "where"]
