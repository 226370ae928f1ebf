"""The small graph toolkit the fusion patterns are written with.

`Rewriter` inserts new nodes with `meta["val"]` computed by running the op on the inputs'
fake values under the graph's fake mode (`mxgraph.ir.insert_call`), and copies the
provenance (`meta["custom"]`, `nn_module_stack`) of the node a fused op replaces, adding
`tags=("fused:<kind>",)` and `fused_from=[names]`. The predicates (`mxgraph.ir.is_op`,
`schema_arg`, and here `skip_casts`, `halves`, ...) read fx nodes
of the torch.export training IR structurally: by op and by the shapes and dtypes in
`meta["val"]`, never by module or parameter names.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from mxgraph.ir import CAST_OPS, graph_fake_mode, insert_call, is_mutating, is_op, schema_arg

aten = torch.ops.aten


# ---- reading nodes ------------------------------------------------------------------------
def val(node):
    """The fake value of a node (None for non-nodes and nodes without one)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node):
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_tensor(node) -> bool:
    return isinstance(val(node), torch.Tensor)


def last_dim(dim: int, ndim: int) -> bool:
    return dim in (-1, ndim - 1)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def is_float_cast(node) -> bool:
    """A dtype conversion between floating dtypes (possibly to the same dtype)."""
    if not is_op(node, *CAST_OPS) or not is_tensor(node.args[0]):
        return False
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
        return False
    src, out = dtype(node.args[0]), dtype(node)
    return src is not None and out is not None and src.is_floating_point and out.is_floating_point


def skip_casts(node):
    """Walk up through float casts: the value before any dtype conversion."""
    while is_float_cast(node):
        node = node.args[0]
    return node


def only_users(node: Node, allowed) -> bool:
    """Every user of `node` is in `allowed` (the matched chain)."""
    return all(user in allowed for user in node.users)


def getitem_of(node, source: Node | None = None, index: int | None = None) -> bool:
    if not isinstance(node, Node) or node.op != "call_function" or node.target is not operator.getitem:
        return False
    return ((source is None or node.args[0] is source)
            and (index is None or node.args[1] == index))


def halves(a, b):
    """(source, dim) when `a` and `b` are the first and second half of `source` along its
    last dim, cut by chunk(2), split, split_with_sizes or two slices; else None."""
    if getitem_of(a) and getitem_of(b) and a.args[0] is b.args[0]:
        cut = a.args[0]
        if (a.args[1], b.args[1]) != (0, 1) or not is_op(cut, aten.chunk, aten.split,
                                                          aten.split_with_sizes):
            return None
        src = cut.args[0]
        n = shape(src)[-1] if shape(src) else None
        if n is None or n % 2:
            return None
        if is_op(cut, aten.chunk):
            ok = cut.args[1] == 2 and last_dim(schema_arg(cut, "dim"), len(shape(src)))
        elif is_op(cut, aten.split):
            ok = (schema_arg(cut, "split_size") == n // 2
                  and last_dim(schema_arg(cut, "dim"), len(shape(src))))
        else:
            ok = (list(schema_arg(cut, "split_sizes")) == [n // 2, n // 2]
                  and last_dim(schema_arg(cut, "dim"), len(shape(src))))
        return (src, -1) if ok else None
    if is_op(a, aten.slice.Tensor) and is_op(b, aten.slice.Tensor) and a.args[0] is b.args[0]:
        src = a.args[0]
        ndim = len(shape(src))
        n = shape(src)[-1]
        if n % 2 or not (last_dim(schema_arg(a, "dim"), ndim) and last_dim(schema_arg(b, "dim"), ndim)):
            return None
        if slice_range(a, n) == (0, n // 2, 1) and slice_range(b, n) == (n // 2, n, 1):
            return src, -1
    return None


def strided_halves(a, b):
    """`source` when `a = source[..., 0::2]` and `b = source[..., 1::2]` (last dim), else None."""
    if not (is_op(a, aten.slice.Tensor) and is_op(b, aten.slice.Tensor) and a.args[0] is b.args[0]):
        return None
    src = a.args[0]
    ndim, n = len(shape(src)), shape(src)[-1]
    if n % 2 or not (last_dim(schema_arg(a, "dim"), ndim) and last_dim(schema_arg(b, "dim"), ndim)):
        return None
    if slice_range(a, n) == (0, n, 2) and slice_range(b, n) == (1, n, 2):
        return src
    return None


def slice_range(node: Node, size: int) -> tuple[int, int, int]:
    """(start, end, step) of an aten.slice with the bounds clamped to `size`."""
    start, end, step = (schema_arg(node, "start"), schema_arg(node, "end"), schema_arg(node, "step"))
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return max(0, min(start, size)), max(0, min(end, size)), step or 1


def commuted(node: Node):
    """The two operands of a binary node, in both orders."""
    a, b = node.args[0], node.args[1]
    return ((a, b), (b, a))


def plain_add(node) -> bool:
    """aten.add.Tensor of two tensors without alpha."""
    return (is_op(node, aten.add.Tensor) and schema_arg(node, "alpha") in (None, 1)
            and is_tensor(node.args[0]) and is_tensor(node.args[1]))


def is_bias_for(bias, x) -> bool:
    """`bias` is a 1-D tensor as long as the last dim of the (>= 1-D) tensor `x`."""
    bs, xs = shape(bias), shape(x)
    return (bs is not None and xs is not None and len(bs) == 1 and len(xs) >= 1
            and bs[0] == xs[-1] and dtype(bias).is_floating_point)


def linear_parts(node):
    """(input, weight, bias) of an aten.linear (bias may be None), else None."""
    if not is_op(node, aten.linear.default):
        return None
    return node.args[0], node.args[1], schema_arg(node, "bias")


# ---- writing nodes ------------------------------------------------------------------------
class Rewriter:
    """Creates nodes with fake values and provenance in one graph module."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.graph: Graph = gm.graph
        self.fake_mode = graph_fake_mode(gm.graph)
        self._grad = None

    def call(self, target, args, kwargs=None, *, like: Node, kind: str, fused_from=None) -> Node:
        """A new node `target(*args, **kwargs)` at the current insertion point, with its fake
        value and `like`'s provenance; `fused_from` (node names) marks the fused op itself."""
        node = insert_call(self.graph, target, args, kwargs, like=like, fake_mode=self.fake_mode)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        custom = node.meta["custom"]
        tag = f"fused:{kind}"
        custom["tags"] = tuple(t for t in custom.get("tags", ()) if t != tag) + (tag,)
        if fused_from is not None:
            custom["fused_from"] = list(fused_from)
        return node

    def outputs(self, node: Node, count: int, *, like: Node, kind: str) -> list[Node]:
        return [self.call(operator.getitem, (node, i), like=like, kind=kind) for i in range(count)]

    def at(self, node: Node):
        """Insert new nodes just before `node`."""
        return self.graph.inserting_before(node)

    # -- analyses
    def needs_grad(self, node) -> bool:
        """`node` depends on a placeholder whose value requires grad (a parameter)."""
        if self._grad is None:
            grad = set()
            for n in self.graph.nodes:
                if n.op == "placeholder":
                    if getattr(n.meta.get("val"), "requires_grad", False):
                        grad.add(n)
                elif any(a in grad for a in n.all_input_nodes):
                    grad.add(n)
            self._grad = grad
        return node in self._grad

    def invalidate(self) -> None:
        self._grad = None

    def position(self) -> dict[Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}


def replace(old: Node, new: Node) -> None:
    old.replace_all_uses_with(new)


def erase_dead(graph: Graph, nodes) -> None:
    """Erase those of `nodes` that are now unused, users first. These are nodes a fused op
    replaced, so random ones go too (SDPA carries the random tag even without dropout; a
    replaced dropout's mask is the fused op's own now)."""
    wanted = set(nodes)
    for n in reversed([n for n in graph.nodes if n in wanted]):
        if n.users or n.op != "call_function":
            continue
        if is_mutating(n):
            continue
        graph.erase_node(n)


# ---- patterns ------------------------------------------------------------------------------
@dataclass
class Match:
    root: Node
    """The node whose value the fused op takes over."""
    nodes: list
    """The matched nodes the fused op replaces (root included): `fused_from`."""
    parts: dict = field(default_factory=dict)
    """What the rewrite needs (inputs, constants)."""


class Pattern:
    """A rewrite: `match(node)` at a candidate root, then `rewrite` before that root.

    Subclasses set `kind` (a name of `mxgraph.plan.FUSION_KINDS`) and say in their
    docstring what they match and what they rewrite to.
    """

    kind = ""

    def match(self, node: Node, rw: Rewriter) -> Match | None:
        raise NotImplementedError

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        raise NotImplementedError

    def apply(self, rw: Rewriter) -> int:
        """Rewrite every match in graph order; returns how many."""
        count = 0
        for node in list(rw.graph.nodes):
            if node.op != "call_function" or not node.users or getattr(node, "_erased", False):
                continue
            m = self.match(node, rw)
            if m is None:
                continue
            with rw.at(m.root):
                done = self.attempt(rw, m, lambda m=m: self.rewrite(rw, m))
            if done:
                erase_dead(rw.graph, m.nodes)
                rw.invalidate()
                count += 1
        return count

    def attempt(self, rw: Rewriter, m: Match, rewrite) -> bool:
        """Run `rewrite`; if the fused op refuses the inputs (its fake implementation raises),
        erase what the rewrite created, warn, and leave the match as it was."""
        before = set(rw.graph.nodes)
        try:
            rewrite()
            return True
        except Exception as error:  # noqa: BLE001 - the graph stays correct without this fusion
            for n in reversed(list(rw.graph.nodes)):
                if n not in before and not n.users:
                    rw.graph.erase_node(n)
            warnings.warn(f"fusion {self.kind}: left {m.root.name} unfused: {type(error).__name__}: "
                          f"{error}", stacklevel=2)
            return False

    def fused(self, rw: Rewriter, m: Match, target, args, kwargs=None) -> Node:
        """The fused op's node, marked with the names of the nodes it replaces."""
        return rw.call(target, args, kwargs, like=m.root, kind=self.kind,
                       fused_from=[n.name for n in m.nodes])

    def helper(self, rw: Rewriter, m: Match, target, args, kwargs=None) -> Node:
        """A node the rewrite needs besides the fused op (a view, a bias-free linear)."""
        return rw.call(target, args, kwargs, like=m.root, kind=self.kind)
