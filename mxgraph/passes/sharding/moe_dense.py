"""The all-experts form of a routed-MoE block, found by dataflow: every expert runs on every
token through batched GEMMs over expert-stacked weights, weighted by the router's scores,
and the experts' outputs are summed (Llama 4's text experts: `routed_in = x.repeat(E, 1) *
scores.T.reshape(-1, 1)`, `bmm(routed_in.view(E, -1, H), W)`, ..., `.view(E, -1, H).sum(0)`).

x: the tokens [T, ...] (data: computed from the user inputs); E experts; S: scores [T, E]
computed from a routing top-k. Matches:

  entry     R = repeat(x, [E, 1, ...]) (rows e*T + t), or expand(x', [E, ...]) with x' =
            unsqueeze(x, 0) or x itself (rows [e, t])
  per (expert, token) from R:
            views between the [E*T, ...] and [E, T, ...] layouts, transposes, permutes,
            (un)squeezes, casts, copies; pointwise ops whose other operands are block values,
            no-data tensors not spread over experts or tokens, or a layout of S (views,
            transposes, casts of S alone: `scores.T.reshape(-1, 1)`); chunk/split/slice/
            select/softmax/norms, and linear/mm with a no-data weight, along dims that hold
            neither experts nor tokens; bmm/matmul(A [E, T, K], W [E, K, O]) with W a
            parameter stacked on experts (through views keeping dim 0)
  exit      sum(V, [d]) over V's experts dim: Y [T, ...] (tokens leading dim 0)

Layout ("dims"): each dim of a block value is a tuple of factors: "E" (experts), "T" (tokens:
x's dim 0) or a plain size. R from repeat is (("E", "T"), ...), from expand (("E",), ("T",),
...). A view regroups the factors in order (a plain size may split; "E" and "T" never split
across dims, else no match); transposes and permutes move dims. With the factors known a
rewrite that changes E and T (expert parallelism: E/ep local experts over the ep*T tokens of
the group, `sharding/ep_dense.py`) computes every view's new size argument. A block whose
batched GEMMs are not reached this way is no all-experts block (`moe_blocks` then calls it
capacity-padded); one reached with a stop in between is, with the stop as its problem.
Nothing here changes a graph.
"""
from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from mxgraph.ir import CAST_OPS, COPY_LIKE_OPS, VIEW_OPS
from mxgraph.passes.sharding.moe_dataflow import SINKS, expert_weight, is_param, val_of, where

aten = torch.ops.aten
EXPERTS, TOKENS = "E", "T"
_DIM_AT_1 = frozenset({aten.unbind.int, aten.select.int, aten.slice.Tensor, aten.narrow.default,
                       aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                       aten._log_softmax.default})
_DIM_AT_2 = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
_DROPS_DIM = frozenset({aten.unbind.int, aten.select.int})
_LAST_DIM = frozenset({aten.linear.default, aten.mm.default, aten.rms_norm.default,
                       aten.layer_norm.default})
_BATCHED = frozenset({aten.bmm.default, aten.matmul.default})
_LAYOUT = VIEW_OPS | COPY_LIKE_OPS | {aten.transpose.int, aten.t.default, aten.permute.default,
                                      aten.unsqueeze.default, aten.squeeze.dim}


def spread(dim: tuple) -> bool:
    """Whether a dim holds experts or tokens."""
    return EXPERTS in dim or TOKENS in dim


@dataclass
class Score:
    """Router scores S [T, E] and the layout ops (in order) that lay them out per (expert,
    token) for the block op that reads the last one (or S itself)."""

    source: Node
    chain: list[Node]


@dataclass
class DenseMatch:
    """One all-experts block (module docstring); `problem` (node, reason) when it stops."""

    num: int  # E
    tokens: int  # T
    x: Node
    entry: Node
    dims: dict[Node, object] = field(default_factory=dict)  # block + score-chain nodes
    nodes: set[Node] = field(default_factory=set)  # the entry and every per-(e, t) node
    gemms: list[Node] = field(default_factory=list)
    weights: list[tuple[Node, Node, list[Node]]] = field(default_factory=list)
    scores: list[Score] = field(default_factory=list)
    exit: Node | None = None
    problem: tuple[Node, str] | None = None

    def size(self, factor, ep: int = 1) -> int:
        """A factor's size with E/ep experts over ep*T tokens."""
        return self.num // ep if factor == EXPERTS else self.tokens * ep \
            if factor == TOKENS else factor

    def sizes(self, node: Node, literal, ep: int) -> list[int]:
        """`node`'s size argument (a view's shape, an expand's sizes) for E/ep experts over
        ep*T tokens; -1 entries stay."""
        return [-1 if old == -1 else math.prod(self.size(f, ep) for f in dim)
                for old, dim in zip(literal, self.dims[node], strict=True)]


def regroup(dims: tuple, shape, size) -> tuple | None:
    """The factors of `dims` grouped in order into `shape` (a view), or None when a factor
    other than a plain size would have to split."""
    flat = [f for dim in dims for f in dim if size(f) != 1]
    out, i = [], 0
    for n in shape:
        group, prod = [], 1
        while prod < n and i < len(flat):
            f = flat[i]
            if isinstance(f, int) and prod * f > n and n % prod == 0 and f % (n // prod) == 0:
                group.append(n // prod)
                flat[i], prod = f // (n // prod), n
                break
            group.append(f)
            prod, i = prod * size(f), i + 1
        if prod != n:
            return None
        out.append(tuple(group))
        while i < len(flat) and flat[i] == 1:
            i += 1
    return tuple(out) if i == len(flat) else None


def _plain(shape) -> tuple:
    return tuple((int(s),) if s != 1 else () for s in shape)


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


class _Walk:
    """The per-(expert, token) region from one entry (module docstring)."""

    def __init__(self, finder, match: DenseMatch, entry_dims: tuple):
        self.finder, self.m = finder, match
        self.m.dims[match.entry] = entry_dims
        self.m.nodes.add(match.entry)
        self.boundary: list[Node] = []
        self.exits: list[Node] = []

    def run(self) -> DenseMatch:
        order = self.finder.order
        todo = [(order[u], u) for u in self.m.entry.users]
        heapq.heapify(todo)
        seen = set()
        while todo:
            _, node = heapq.heappop(todo)
            if node in seen or node.target in SINKS:
                continue
            seen.add(node)
            dims = self.place(node) if node.op == "call_function" else None
            if dims == "exit":
                self.exits.append(node)
            elif dims is None:
                self.boundary.append(node)
            else:
                self.m.dims[node] = dims
                self.m.nodes.add(node)
                for user in node.users:
                    heapq.heappush(todo, (order[user], user))
        if self.boundary:
            stop = min(self.boundary, key=order.get)
            self.m.problem = (stop, f"{where(stop)} between the expert GEMMs is not per "
                              f"(expert, token)")
        elif len(self.exits) != 1:
            self.m.problem = (self.exits[1] if self.exits else self.m.gemms[-1] if self.m.gemms
                              else self.m.entry, f"its experts have {len(self.exits)} sums over "
                              "the experts, not one")
        else:
            self.m.exit = self.exits[0]
        return self.m

    # ---- one op ------------------------------------------------------------------------
    def place(self, node: Node):
        """`node`'s dims, "exit" for the sum over experts, None where the region stops."""
        target, dims, m = node.target, self.m.dims, self.m
        first = node.args[0] if node.args else None
        if target is operator.getitem:
            parts = dims.get(first) if first in m.nodes else None
            return parts[node.args[1]] if isinstance(parts, list) else None
        value = val_of(node)
        if not isinstance(target, torch._ops.OpOverload) or \
                (isinstance(value, torch.Tensor) and not _static(value.shape)):
            return None
        if target in CAST_OPS or torch.Tag.pointwise in target.tags:
            return self.pointwise(node)
        if first not in m.nodes:
            return None
        if target in _LAYOUT:
            return self.layout(node, dims[first])
        if target in _BATCHED:
            return self.gemm(node)
        if target is aten.sum.dim_IntList:
            return self.combine(node)
        if target in _DIM_AT_1 or target in _DIM_AT_2:
            return self.along(node)
        if target in _LAST_DIM:
            if any(a in self.finder.data for a in node.all_input_nodes if a is not first) or \
                    spread(dims[first][-1]):
                return None
            return dims[first][:-1] + (_plain(value.shape[-1:]) if target in (
                aten.linear.default, aten.mm.default) else dims[first][-1:])
        return None

    def layout(self, node: Node, dims: tuple):
        """dims after a view, transpose, permute, (un)squeeze, cast or copy (score chains
        too); None when the factors do not follow."""
        target, value = node.target, val_of(node)
        if target in VIEW_OPS:
            return regroup(dims, value.shape, self.m.size)
        if target in (aten.transpose.int, aten.t.default):
            a, b = (d % len(dims) for d in node.args[1:3]) if node.args[1:] else (0, len(dims) - 1)
            out = list(dims)
            out[a], out[b] = dims[b], dims[a]
            return tuple(out)
        if target is aten.permute.default:
            return tuple(dims[d % len(dims)] for d in node.args[1])
        if target is aten.unsqueeze.default:
            at = node.args[1] % (len(dims) + 1)
            return dims[:at] + ((),) + dims[at:]
        if target is aten.squeeze.dim:
            at = node.args[1] % len(dims)
            return dims[:at] + dims[at + 1:] if not dims[at] else None
        return dims  # casts, copies

    def gemm(self, node: Node):
        a, w = node.args[0], node.args[1]
        dims = self.m.dims[a]
        found = expert_weight(w) if isinstance(w, Node) else None
        if found is None or len(dims) != 3 or dims[0] != (EXPERTS,) or spread(dims[2]) or \
                w.meta["val"].dim() != 3 or found[0].meta["val"].shape[0] != self.m.num:
            return None
        self.m.gemms.append(node)
        self.m.weights.append((found[0], node, found[1]))
        return (dims[0], dims[1], _plain(node.meta["val"].shape[-1:])[0])

    def combine(self, node: Node):
        dims = self.m.dims[node.args[0]]
        over = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if over is None or len(over) != 1 or keepdim:
            return None
        at = over[0] % len(dims)
        rest = dims[:at] + dims[at + 1:]
        if dims[at] != (EXPERTS,) or not rest or not rest[0] or rest[0][0] != TOKENS:
            return None
        return "exit"

    def along(self, node: Node):
        """Ops along one dim holding neither experts nor tokens."""
        dims, target = self.m.dims[node.args[0]], node.target
        index = 1 if target in _DIM_AT_1 else 2
        dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
        at = dim % len(dims)
        if spread(dims[at]) or any(a in self.finder.data for a in node.all_input_nodes[1:]):
            return None
        value = node.meta["val"]

        def cut(shape):
            return dims[:at] + dims[at + 1:] if target in _DROPS_DIM else \
                dims[:at] + _plain(shape[at:at + 1]) + dims[at + 1:]
        if isinstance(value, (list, tuple)):
            return [cut(v.shape) for v in value]
        return cut(value.shape)

    def pointwise(self, node: Node):
        """Broadcast: every other operand a block value of the same dims, a layout of the
        scores, or a no-data tensor not spread over experts or tokens."""
        value, m = node.meta["val"], self.m
        base = next((m.dims[a] for a in node.all_input_nodes
                     if a in m.nodes and len(m.dims[a]) == value.dim()), None)
        if base is None:
            return None
        for a in node.all_input_nodes:
            if a in m.nodes:
                have, plain = m.dims[a], False
            elif a in self.finder.data:
                have, plain = self.score(a, node), False
            elif is_param(a) or expert_weight(a) is not None:
                return None  # a parameter over the experts' values: not built
            else:
                have, plain = _plain(a.meta["val"].shape), True
            if have is None or len(have) > len(base):
                return None
            for mine, theirs in zip(have[::-1], base[::-1], strict=False):
                if mine == theirs or math.prod(m.size(f) for f in mine) == 1:
                    continue
                if not (plain and not spread(theirs) and
                        math.prod(m.size(f) for f in mine) == math.prod(m.size(f) for f in theirs)):
                    return None
        return base

    def score(self, value: Node, reader: Node) -> tuple | None:
        """The dims of `value` when it is a layout of scores S [T, E] (the farthest node of
        that shape back through layout ops of one input), recording the chain."""
        path, node, found = [], value, None
        while True:
            path.append(node)
            shape = list(val_of(node).shape) if isinstance(val_of(node), torch.Tensor) else None
            if shape == [self.m.tokens, self.m.num]:
                found = len(path)
            if node.op == "call_function" and node.target in _LAYOUT and \
                    len(node.all_input_nodes) == 1 and node.args[0] is node.all_input_nodes[0]:
                node = node.args[0]
                continue
            break
        if found is None:
            return None
        source, chain = path[found - 1], path[:found - 1][::-1]
        dims = ((TOKENS,), (EXPERTS,))
        for step in chain:
            dims = self.layout(step, dims)
            if dims is None:
                return None
            self.m.dims.setdefault(step, dims)
        if not any(s.source is source and s.chain == chain for s in self.m.scores):
            self.m.scores.append(Score(source, chain))
        return dims


def _entry(node: Node, data: set[Node], nums: set[int]):
    """(x, E, dims) when `node` spreads tokens x over E experts (module docstring)."""
    x, size = node.args[0] if node.args else None, node.args[1] if len(node.args) > 1 else None
    if not isinstance(x, Node) or not isinstance(val_of(x), torch.Tensor) or size is None:
        return None
    if node.target is aten.repeat.default:
        if len(size) != x.meta["val"].dim() or size[0] not in nums or \
                any(r != 1 for r in size[1:]):
            return None
        shape, dims = x.meta["val"].shape, lambda: ((EXPERTS, TOKENS),) + _plain(shape[1:])
    elif node.target is aten.expand.default:
        if x.target is aten.unsqueeze.default and x.args[1] == 0:
            x = x.args[0]
        if len(size) != x.meta["val"].dim() + 1 or size[0] not in nums:
            return None
        shape, dims = x.meta["val"].shape, lambda: ((EXPERTS,), (TOKENS,)) + _plain(shape[1:])
    else:
        return None
    if x not in data or not _static(shape) or len(shape) == 0 or shape[0] < 2:
        return None
    return x, size[0], dims()


def find_dense(finder, batched: list[tuple[Node, Node, list[Node]]]) -> list[DenseMatch]:
    """Every all-experts block whose batched GEMMs (`batched`: (param, read, views) of the
    finder's batched reads) are reached from an entry; the finder is a `RowRegions` with
    `nearest_router`."""
    nums = {int(p.meta["val"].shape[0]) for p, _, _ in batched}
    reads = {read for _, read, _ in batched}
    matches = []
    for node in finder.graph.nodes:
        found = _entry(node, finder.data, nums) if node.op == "call_function" else None
        if found is None:
            continue
        x, num, dims = found
        match = _Walk(finder, DenseMatch(num, int(x.meta["val"].shape[0]), x, node), dims).run()
        if match.gemms and set(match.gemms) <= reads:
            matches.append(match)
    return matches


__all__ = ["DenseMatch", "Score", "find_dense", "regroup", "spread"]
