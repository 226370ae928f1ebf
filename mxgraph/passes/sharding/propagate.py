"""The sharding core: one propagation engine over the forward graph for one mesh axis,
used by tensor (+ sequence, vocabulary) parallelism and context parallelism.

    sharder = Sharder(gm, ctx, axis, rules)     # axis: AxisOps of "tp" or "cp"
    sharder.run(seeds)                           # seeds: node -> placement to start from

Every value gets a placement (`sharding/placement.py`: R, S(dim), Partial). Nodes are visited in
graph order (nodes a rule inserts after the current one are visited too); a node whose
inputs are all replicated is replicated, unless its op is in `rules.always` (a linear
chooses its weight's placement even on replicated input). Otherwise the rule registered
for its op (`Rules`, a table keyed by op with a registrar) returns the output placement,
rewriting the node where the local shapes differ (view sizes) and asking for its inputs in
the placement it needs (`need`). A redistribution follows from the placement change and is
inserted once per (value, placement), right before the first consumer that needs it:

| from -> to           | op (`AxisOps`)                                              |
|----------------------|-------------------------------------------------------------|
| Partial -> R         | all-reduce                                                  |
| Partial -> S(d)      | reduce-scatter along d                                      |
| S(d) -> R            | all-gather (its backward reduce-scatters when the consumer is split) |
| R -> S(d)            | this rank's slice                                           |

Gradients: a replicated input of a split computation (an op whose output is not
replicated) gets a partial gradient on each rank: `AxisOps.copy` (TP's `tp_copy`: identity
forward, all-reduce backward) is put in front of it, once per value; CP leaves the partial
gradients to the runtime (`copy=None`: parameter gradients are summed by the buckets).

An op without a rule gathers its inputs: it is listed (`fallbacks`, the dump's
`no_rule_gathers` field) and with `Plan(strict_sharding=True)` raises PlanError naming the
op and where it is. `meta["val"]` holds full (unsharded) shapes while rules run; the
caller re-propagates local shapes at the end (`repropagate`).

In-place writes (`writes.py`): a redistribution on the path of a write (the views between it
and its base) is a lost write, listed in `lost_writes`; the passes keep those bases whole
(`whole`, found by `writes.kept_whole` on copies) and `check_writes` refuses any left. A
value aliased by a write is redistributed anew for each reader, right before it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from mxgraph.errors import PlanError
from mxgraph.ir import COMPUTE, insert_call, op_name
from mxgraph.passes.sharding.placement import P, Partial, R, Replicate, Shard
from mxgraph.passes.sharding.writes import Writes

Rule = Callable[["Sharder", Node], object]


@dataclass
class AxisOps:
    """The collectives of one mesh axis, as custom ops `op(x, [dim,] group_name)`."""

    name: str
    size: int
    rank: int
    group: str
    all_reduce: object
    all_gather: object
    """S -> R for a consumer that computes on the whole value (backward: slice)."""
    gather_split: object
    """S -> R for a split consumer (its gradient is partial; backward: reduce-scatter)."""
    slice: object
    reduce_scatter: object | None = None
    copy: object | None = None
    """R read by a split computation: identity forward, all-reduce backward; None leaves
    the partial gradient to the runtime."""


class Rules:
    """Sharding rules keyed by op: `@rules.register(aten.view.default, ...)`."""

    def __init__(self, *bases: "Rules"):
        self.table: dict[object, Rule] = {}
        self.predicates: list[tuple[Callable[[Node], bool], Rule]] = []
        self.always: set = set()
        for base in bases:
            self.table.update(base.table)
            self.predicates += base.predicates
            self.always |= base.always

    def register(self, *ops, always: bool = False):
        def decorate(fn: Rule) -> Rule:
            for op in ops:
                self.table[op] = fn
                if always:
                    self.always.add(op)
            return fn
        return decorate

    def register_if(self, predicate: Callable[[Node], bool]):
        """A rule for every op `predicate(node)` accepts (pointwise ops, say)."""
        def decorate(fn: Rule) -> Rule:
            self.predicates.append((predicate, fn))
            return fn
        return decorate

    def get(self, node: Node) -> Rule | None:
        if node.target in self.table:
            return self.table[node.target]
        return next((fn for predicate, fn in self.predicates if predicate(node)), None)


@dataclass
class Fallback:
    node: Node
    reason: str
    inputs: dict = field(default_factory=dict)
    """The inputs it gathered, with their placements."""

    def describe(self) -> str:
        module = (self.node.meta.get("custom") or {}).get("module") or "<top>"
        placed_inputs = ", ".join(f"{n.name}: {p}" for n, p in self.inputs.items())
        return f"{op_name(self.node)} at {module}: {self.reason} ({placed_inputs})"


@dataclass
class Sharder:
    gm: GraphModule
    axis: AxisOps
    rules: Rules
    strict: bool = False
    place: dict[Node, object] = field(default_factory=dict)
    params: dict[Node, object] = field(default_factory=dict)
    """Parameter placeholder -> the placement chosen for it."""
    blocks: dict[Node, list[int]] = field(default_factory=dict)
    """Parameter -> sizes of the pieces of a fused projection split along its dim 0."""
    sequence_shard: Callable[[Node], Shard | None] | None = None
    """The shard a partial value is reduce-scattered to (sequence parallelism), if any."""
    local_region: set = field(default_factory=set)
    """Nodes of token-local MoE regions (`sharding/token_local.py`): run on this rank's tokens."""
    keep_replicated: set = field(default_factory=set)
    """Parameters a rule must leave replicated (set between runs by the caller)."""
    whole: set[str] = field(default_factory=set)
    """Names of in-place-written bases kept whole, with every alias of them (`writes.py`)."""
    lost_writes: dict[str, Node] = field(default_factory=dict)
    """Base name -> an op on a write's path whose input was redistributed (`writes.py`)."""
    writes: Writes = field(default_factory=Writes)
    fallbacks: list[Fallback] = field(default_factory=list)
    sharded_reductions: list[Fallback] = field(default_factory=list)
    """Sums over a sharded dim (partial results): correct, but a sign for TP that the
    shard was chosen badly (`shard_tp._blamed`)."""
    _done: dict[tuple[Node, object], Node] = field(default_factory=dict)
    _copies: dict[Node, Node] = field(default_factory=dict)

    @property
    def graph(self):
        return self.gm.graph

    # ---- reading ----------------------------------------------------------------------
    def of(self, value) -> object:
        """The placement of a value (R for constants and unplaced nodes)."""
        if not isinstance(value, Node):
            return R
        return self.place.get(value, R)

    def full(self, value: Node) -> list[int]:
        return list(value.meta["val"].shape)

    def ndim(self, value: Node) -> int:
        return value.meta["val"].dim()

    # ---- writing ----------------------------------------------------------------------
    def insert(self, before: Node, target, args, kwargs=None, val=COMPUTE, placement=R) -> Node:
        """A node before `before` (with its provenance). `val`: its full meta value (by
        default the op run on its inputs' full values); `placement`: its placement (then
        the walk does not visit it), or None to let the walk place it by its rule."""
        node = insert_call(self.graph, target, args, kwargs, before=before, like=before,
                           val=val)
        if placement is not None:
            self.place[node] = placement
        return node

    def collective(self, before: Node, target, args, placement) -> Node:
        """A redistribution: its full meta value is its input's."""
        return self.insert(before, target, args, val=args[0].meta["val"], placement=placement)

    def reduce_target(self, value: Node):
        """Where a partial value goes when a consumer needs it summed: the sequence shard
        with `sequence_shard` (TP's sequence parallelism), else replicated."""
        shard = self.sequence_shard(value) if self.sequence_shard is not None else None
        return shard if shard is not None and self.axis.reduce_scatter is not None else R

    def need(self, user: Node, value, placement, split_user: bool | None = None) -> Node:
        """`value` in `placement` for `user` (redistributed once, before the first user
        that needs it); rewires `user` to read the result."""
        have = self.of(value)
        if not isinstance(value, Node) or have == placement:
            return value
        split = self.is_split(user) if split_user is None else split_user
        key = (value, placement, split)
        base = self.writes.family(value)
        if base is not None:  # written in place: a copy for this reader only, made here
            key += (user,)
            if user in self.writes.path and user.args[0] is value:
                self.lost_writes.setdefault(base.name, user)
        if key not in self._done:
            self._done[key] = self._redistribute(user, value, have, placement, split)
        new = self._done[key]
        user.replace_input_with(value, new)
        return new

    def _redistribute(self, user, value, have, want, split: bool) -> Node:
        ax = self.axis
        if isinstance(have, Partial):
            if isinstance(want, Shard) and want.outer != 1:  # split the dim, scatter, merge
                full = self.full(value)
                runs = full[:want.dim] + [want.outer, full[want.dim] // want.outer] + \
                    full[want.dim + 1:]
                parts = self.insert(user, torch.ops.aten.reshape.default, (value, runs),
                                    placement=have)
                part = self.collective(user, ax.reduce_scatter, (parts, want.dim + 1, ax.group),
                                       Shard(want.dim + 1))
                local = full[:want.dim] + [full[want.dim] // ax.size] + full[want.dim + 1:]
                return self.insert(user, torch.ops.aten.reshape.default, (part, local),
                                   val=value.meta["val"], placement=want)
            if isinstance(want, Shard):
                return self.collective(user, ax.reduce_scatter, (value, want.dim, ax.group), want)
            reduced = self.collective(user, ax.all_reduce, (value, ax.group), R)
            return self._copied(user, reduced) if split else reduced
        if isinstance(have, Shard):
            if have.outer != 1:  # split the merged dim, gather the sharded part, merge back
                full = self.full(value)
                inner = full[have.dim] // have.outer
                runs = full[:have.dim] + [have.outer, inner] + full[have.dim + 1:]
                local = full[:have.dim] + [have.outer, inner // ax.size] + full[have.dim + 1:]
                split_view = self.insert(user, torch.ops.aten.reshape.default, (value, local),
                                         val=value.meta["val"].reshape(runs),
                                         placement=Shard(have.dim + 1))
                whole = self._redistribute(user, split_view, Shard(have.dim + 1), R, split)
                merged = self.insert(user, torch.ops.aten.reshape.default, (whole, full))
                if whole in self._copies:  # a view of the gather: no copy after it either
                    self._copies[merged] = merged
                return self._redistribute(user, merged, R, want, split) if want != R else merged
            gather = ax.gather_split if split else ax.all_gather
            whole = self.collective(user, gather, (value, have.dim, ax.group), R)
            if split:  # its backward already sums the partial gradients: no copy after it
                self._copies[whole] = whole
            return whole if want == R else self._redistribute(user, whole, R, want, split)
        if isinstance(want, Shard) and want.outer != 1:  # split the dim, slice, merge
            full = self.full(value)
            inner = full[want.dim] // want.outer
            runs = full[:want.dim] + [want.outer, inner] + full[want.dim + 1:]
            parts = self.insert(user, torch.ops.aten.reshape.default, (value, runs))
            part = self.collective(user, ax.slice, (parts, want.dim + 1, ax.group),
                                   Shard(want.dim + 1))
            local = full[:want.dim] + [want.outer * inner // ax.size] + full[want.dim + 1:]
            return self.insert(user, torch.ops.aten.reshape.default, (part, local),
                               val=value.meta["val"], placement=want)
        if isinstance(want, Shard):  # R -> S
            return self.collective(user, ax.slice, (value, want.dim, ax.group), want)
        raise PlanError(f"cannot redistribute {value.name} from {have} to {want}")

    def _copied(self, user: Node, value: Node) -> Node:
        if self.axis.copy is None or not _is_float(value):
            return value
        if value not in self._copies:
            self._copies[value] = self.collective(user, self.axis.copy, (value, self.axis.group), R)
        return self._copies[value]

    def is_split(self, node: Node) -> bool:
        """Whether `node`'s output will be sharded or partial (its replicated inputs then
        get partial gradients). Known after its rule ran; before, whether an input is a
        shard (a partial input is summed first: it alone leaves the output whole)."""
        if node in self.place:
            return self.place[node] != R
        return any(isinstance(self.of(a), Shard) for a in node.all_input_nodes)

    def gather_all(self, node: Node, reason: str) -> object:
        """The fallback: every input whole; the node replicated. Listed in `fallbacks`."""
        if self.strict:
            fallback = Fallback(node, reason, {a: self.of(a) for a in node.all_input_nodes
                                               if self.of(a) != R})
            raise PlanError(
                f"strict_sharding: {fallback.describe()}; its inputs would be gathered over "
                f"{self.axis.name}. Write that computation with ops that have a sharding "
                "rule, leave the parameters it reads replicated, or set strict_sharding=False "
                "to gather there (correct, slower)")
        inputs = {arg: self.of(arg) for arg in node.all_input_nodes if self.of(arg) != R}
        for arg in inputs:
            self.need(node, arg, R, split_user=False)
        self.fallbacks.append(Fallback(node, reason, inputs))
        return R

    # ---- the walk ---------------------------------------------------------------------
    def run(self, seeds: dict[Node, object] | None = None) -> None:
        self.writes = Writes.of(self.graph)
        self.place.update(seeds or {})
        node = next(iter(self.graph.nodes))
        while node.op not in ("output", "root"):  # nodes a rule inserts after it: next
            if node.op == "call_function" and node not in self.place:
                self.place[node] = self.visit(node)
                self.copy_replicated_inputs(node)
            node = node.next
        output = self.graph.find_nodes(op="output")[0]
        for value in output.all_input_nodes:
            if self.of(value) != R:
                self.need(output, value, R, split_user=False)

    def visit(self, node: Node) -> object:
        base = self.writes.family(node)
        if base is not None and base.name in self.whole:
            return self._keep_whole(node, base)
        rule = self.rules.get(node)
        if node.target not in self.rules.always and all(self.of(a) == R
                                                         for a in node.all_input_nodes):
            return R
        if node.target is operator.getitem:
            source = self.of(node.args[0])
            return source[node.args[1]] if isinstance(source, tuple) else source
        if rule is None:
            return self.gather_all(node, "no sharding rule: gathered")
        return rule(self, node)

    def _keep_whole(self, node: Node, base: Node) -> object:
        """A written base, an alias of it, or a write into it: replicated, its operands
        gathered (a lost write's fix, `writes.py`)."""
        if node is base:
            return self.gather_all(node, "written in place through a view that needs it whole")
        for arg in node.all_input_nodes:
            if self.of(arg) != R:
                self.need(node, arg, R, split_user=False)
        return R

    def check_writes(self) -> None:
        """PlanError where a write into a redistributed copy would be lost (none is left once
        `writes.kept_whole` chose the bases to keep whole, but for a written input)."""
        for base, user in self.lost_writes.items():
            module = (user.meta.get("custom") or {}).get("module") or "<top>"
            raise PlanError(
                f"{self.axis.name}={self.axis.size}: {base} is written in place through "
                f"{op_name(user)} at {module}, and {self.axis.name} would have to gather or "
                f"slice it there: the write would land in a copy. Write that value out of "
                f"place (torch.cat or torch.stack of the pieces instead of assigning into "
                f"slices), or set {self.axis.name}=1")

    def copy_replicated_inputs(self, node: Node) -> None:
        """Replicated float inputs of a split computation get `AxisOps.copy` (see module
        docstring); parameters the rule left replicated included."""
        if self.axis.copy is None or self.place.get(node) == R or node.target is operator.getitem:
            return
        for arg in list(node.all_input_nodes):
            if self.of(arg) == R and _is_float(arg) and arg.target is not self.axis.copy:
                node.replace_input_with(arg, self._copied(node, arg))


def _is_float(value) -> bool:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def placed(placement, ndim: int):
    """A placement with its dim normalised to [0, ndim)."""
    return placement.at(placement.dim % ndim) if isinstance(placement, Shard) else placement


def repropagate(gm: GraphModule, local_shapes: dict[Node, list[int]]) -> GraphModule:
    """Lint, recompile and re-run fake propagation on `gm` after a sharding pass, with the
    placeholders in `local_shapes` at those shapes."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    fake_mode = torch._guards.detect_fake_mode([n.meta["val"] for n in placeholders])
    inputs = []
    for node in placeholders:
        value = node.meta["val"]
        if node in local_shapes:
            with fake_mode:
                value = torch.empty(local_shapes[node], dtype=value.dtype, device=value.device)
        inputs.append(value)
    gm.graph.lint()
    gm.recompile()
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    return gm


__all__ = ["AxisOps", "Fallback", "P", "Partial", "R", "Replicate", "Rules", "Shard",
           "Sharder", "placed", "repropagate"]
