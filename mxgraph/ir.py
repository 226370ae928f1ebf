"""What every pass asks of an fx node: op sets, node predicates, graph walks, schema
arguments, and one way to insert a node.

This is the lowest layer of mxgraph: it imports torch and the standard library only.
Op sets hold op overloads (`aten.view.default`) unless their name says packets
(`MATMUL_OPS`, `ATTENTION_OPS`); `is_op` matches either. A pass that needs a union of
sets composes it from these (`VIEW_OPS | COPY_OPS`), so each op's meaning is written once.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Callable, Iterable

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten

# ---- op sets --------------------------------------------------------------------------
VIEW_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
"""Reshapes: the same elements in a new shape given as an argument (a view when possible)."""
IDENTITY_OPS = frozenset({aten.alias.default, aten.detach.default})
"""The input itself: same values, same storage (autograd aside)."""
ALIAS_OPS = IDENTITY_OPS | {aten._unsafe_view.default}
"""Ops that share their input's storage without being views by schema (`is_view`)."""
COPY_OPS = frozenset({aten.clone.default, aten.contiguous.default})
"""The input's values in a fresh (or contiguous) storage."""
CONVERT_OPS = frozenset({aten._to_copy.default, aten.to.dtype})
"""Dtype/device conversions of one tensor, positional form."""
CAST_OPS = CONVERT_OPS | {aten.type_as.default, aten.to.dtype_layout}
"""Every dtype conversion: `CONVERT_OPS`, `type_as` (dtype of a second tensor) and the
keyword form `to.dtype_layout`."""
COPY_LIKE_OPS = IDENTITY_OPS | COPY_OPS | CONVERT_OPS
"""One tensor in, each output element its input element (kept, copied or converted)."""
SHAPE_OPS = VIEW_OPS | COPY_OPS | {aten.expand.default, aten.transpose.int,
                                   aten.permute.default, aten.unsqueeze.default}
"""Ops whose output holds the input's elements, reshaped, transposed, broadcast or copied."""
MATMUL_OPS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul,
                        aten._grouped_mm})
"""Matrix-multiply packets (fused ones: `fused_kind(node) == "matmul"`)."""
ATTENTION_OPS = frozenset({
    aten.scaled_dot_product_attention, aten._scaled_dot_product_attention_math,
    aten._scaled_dot_product_attention_math_for_mps, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_fused_attention_overrideable})
"""Forward scaled-dot-product attention packets (every backend's variant)."""

_ALIAS_PACKETS = frozenset(op.overloadpacket for op in ALIAS_OPS)


# ---- reading nodes --------------------------------------------------------------------
def packet(node: Node):
    """The overload packet of an ATen/custom op node (`aten.mm`), else its target."""
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def op_name(node: Node) -> str:
    """`namespace::name` of an op node (`aten::mm`), else the target's `__name__`."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    return getattr(target, "__name__", str(target))


def is_op(node, *targets) -> bool:
    """`node` is a call of one of `targets` (op overloads, or overload packets)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    target = node.target
    return target in targets or getattr(target, "overloadpacket", None) in targets


def schema_arg(node: Node, name: str, default=None):
    """The value of argument `name` of an op node: positional (unless keyword-only) or
    keyword; when the call leaves it out, `default` if given, else the schema's default
    (None where it has none). KeyError if the op has no such argument and no `default`."""
    for index, arg in enumerate(node.target._schema.arguments):
        if arg.name != name:
            continue
        if not arg.kwarg_only and index < len(node.args):
            return node.args[index]
        if name in node.kwargs:
            return node.kwargs[name]
        if default is not None:
            return default
        return arg.default_value if arg.has_default_value() else None
    if default is not None:
        return default
    raise KeyError(f"{node.target} has no argument {name!r}")


def has_random_tag(node: Node) -> bool:
    """The op is tagged `nondeterministic_seeded`: it may draw random numbers, whatever its
    arguments (SDPA carries the tag with `dropout_p=0` too). `is_random` is the refined
    question; this one is for callers that keep every tagged op in place (`split_bw`)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


def is_random(node: Node) -> bool:
    """The node draws random numbers: its op is tagged `nondeterministic_seeded`, except
    an op whose randomness its arguments switch off: a `dropout_p` argument equal to 0
    (attention without dropout is deterministic; the tag covers its dropout path).
    `native_dropout`/`dropout` with p=0 stay random: they still consume the generator."""
    if not has_random_tag(node):
        return False
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" in names:
        value = schema_arg(node, "dropout_p", 0.0)
        return not (isinstance(value, (int, float)) and value == 0)
    return True


def is_mutating(node: Node) -> bool:
    """The op writes one of its inputs (its schema is mutable)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def graph_device(gm: GraphModule) -> torch.device | None:
    """The device of the graph's first tensor input (its fake value's); None without one."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def is_backward(node: Node) -> bool:
    """A node of a joint graph's backward part (AOTAutograd's `partitioner_tag`)."""
    return node.meta.get("partitioner_tag") == "is_backward"


def is_forward_op(node: Node) -> bool:
    """A call_function node of the forward part (any call of a forward-only graph)."""
    return node.op == "call_function" and not is_backward(node)


def from_sdpa(node: Node) -> bool:
    """A forward op of a `scaled_dot_product_attention` call the trace decomposed into math
    (`meta["torch_fn"]`: the Python call it came from, as (name, qualified function))."""
    torch_fn = node.meta.get("torch_fn")
    return bool(torch_fn) and str(torch_fn[-1]).endswith("scaled_dot_product_attention")


def is_alias(node: Node) -> bool:
    """`node`'s value shares the storage of its first input: a view op (`is_view`), an op
    of `ALIAS_OPS`, a getitem of a view-returning op (split, unbind), or an op marked
    `_mxgraph_alias`. A getitem of any other multi-output op owns its storage."""
    if node.op != "call_function":
        return False
    target = node.target
    if getattr(target, "_mxgraph_alias", False):
        return True
    if getattr(target, "__name__", "") == "getitem":
        parent = node.args[0]
        return isinstance(parent, Node) and parent.op == "call_function" and isinstance(
            parent.target, torch._ops.OpOverload) and parent.target.is_view
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target.overloadpacket in _ALIAS_PACKETS)


def storage_roots(gm: GraphModule) -> dict[Node, Node]:
    """node -> the node that owns its storage (itself unless `is_alias`)."""
    roots: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if is_alias(node) and node.all_input_nodes:
            base = node.args[0] if isinstance(node.args[0], Node) else node.all_input_nodes[0]
            roots[node] = roots.get(base, base)
        else:
            roots[node] = node
    return roots


# ---- fused kernels --------------------------------------------------------------------
FUSED_KINDS = ("norm", "act", "attn", "rope", "matmul", "moe", "residual", "loss")
"""What a fused op computes, for rules that group nodes by role (remat regions)."""
_FUSED: dict[object, tuple[str, bool]] = {}


def register_fused_kind(op, kind: str, *, backward: bool = False) -> None:
    """Record the kind of an mxgraph op (the kernel registry calls this as it registers
    each op, so every op that can be in a graph has its entry)."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"fused kind {kind!r} is not one of {FUSED_KINDS}")
    _FUSED[op] = (kind, backward)


def fused_kind(node: Node, *, backward: bool = False) -> str | None:
    """The kind of the fused op `node` calls, None for any other node. Backward ops
    (`rmsnorm_backward`, `grouped_mm_wgrad`) count only with `backward=True`."""
    entry = _FUSED.get(node.target) if node.op == "call_function" else None
    if entry is None or (entry[1] and not backward):
        return None
    return entry[0]


# ---- graph walks ----------------------------------------------------------------------
def closure(starts: Iterable[Node], step: Callable[[Node], Iterable[Node]],
            stop: Callable[[Node], bool] | None = None) -> set[Node]:
    """`starts` and every node reached from them by `step(node)`; a node for which
    `stop(node)` holds is included but not stepped from."""
    seen: set[Node] = set()
    todo = list(starts)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if stop is None or not stop(node):
            todo.extend(step(node))
    return seen


def ancestors(roots, stop=frozenset(), keep: Callable[[Node], bool] | None = None) -> set[Node]:
    """The Node `roots` and every node they read, transitively. Nodes in `stop` are left
    out and not walked through; with `keep`, a node reached is entered only if keep(node)
    (the roots are always included)."""
    return closure([r for r in roots if isinstance(r, Node) and r not in stop],
                   lambda n: [a for a in n.all_input_nodes
                              if a not in stop and (keep is None or keep(a))])


def descendants(starts, keep: Callable[[Node], bool] | None = None) -> set[Node]:
    """`starts` and every node that reads them, transitively; with `keep`, a user is
    entered only if keep(user) (the starts are always included)."""
    return closure(starts, lambda n: [u for u in n.users if keep is None or keep(u)])


def copy_module(gm: GraphModule, copies: dict[Node, Node] | None = None) -> GraphModule:
    """A GraphModule over a copy of `gm`'s graph (same node names; `copies`, when given, is
    filled with original -> copy), for a trial run of a pass that rewrites in place."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {} if copies is None else copies))
    return GraphModule(gm, graph)


# ---- writing nodes --------------------------------------------------------------------
class _Compute:
    def __repr__(self) -> str:
        return "COMPUTE"


COMPUTE = _Compute()
"""`insert_call(val=COMPUTE)`: run the target on the inputs' fake values."""


def graph_fake_mode(graph: Graph):
    """The fake mode of the fake values in `graph` (None if it holds none)."""
    return detect_fake_mode([n.meta["val"] for n in graph.nodes
                             if isinstance(n.meta.get("val"), torch.Tensor)])


def fake_value(target, args, kwargs=None, fake_mode=None):
    """`target(*args, **kwargs)` on the fake values of the Node arguments, under
    `fake_mode` (else the mode those values come from); a getitem just indexes."""
    def unwrap(a):
        return a.meta["val"] if isinstance(a, Node) else a
    args = torch.fx.node.map_aggregate(args, unwrap)
    kwargs = torch.fx.node.map_aggregate(kwargs or {}, unwrap)
    if target is operator.getitem:
        return args[0][args[1]]
    mode = fake_mode if fake_mode is not None else detect_fake_mode((args, kwargs))
    with mode if mode is not None else contextlib.nullcontext():
        return target(*args, **kwargs)


def insert_call(graph: Graph, target, args, kwargs=None, *, before: Node | None = None,
                after: Node | None = None, like: Node | None = None, val=COMPUTE,
                fake_mode=None) -> Node:
    """A new node `target(*args, **kwargs)` right before `before` or after `after` (at the
    graph's current insertion point when neither is given).

    `meta["custom"]` is a copy of `like`'s (provenance: module, layer, stage; `{}` when
    `like` has none; unset without `like`). `meta["val"]`: with `val=COMPUTE` the target
    run on the inputs' fake values (`fake_value`; the node exists before that runs, so a
    caller can erase it when the op refuses its inputs); `val=None` leaves it unset (a
    pass that re-propagates afterwards); any other value is stored as given.
    """
    if before is not None and after is not None:
        raise ValueError("insert_call takes `before` or `after`, not both")
    where = graph.inserting_before(before) if before is not None else \
        graph.inserting_after(after) if after is not None else contextlib.nullcontext()
    with where:
        node = graph.call_function(target, tuple(args), dict(kwargs or {}))
    if like is not None:
        node.meta["custom"] = dict(like.meta.get("custom") or {})
    if val is COMPUTE:
        node.meta["val"] = fake_value(target, node.args, node.kwargs, fake_mode)
    elif val is not None:
        node.meta["val"] = val
    return node
