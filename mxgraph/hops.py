"""Higher-order ops with submodules, inlined into the forward graph right after capture.

`torch.export` records a region that changes a mode as a higher-order op (HOP) calling a
submodule of the graph module: `with torch.no_grad():` becomes
`wrap_with_set_grad_enabled(False, submod, *operands)`, `with torch.autocast(...):` becomes
`wrap_with_autocast(device, dtype, enabled, cache, submod, *operands)`. Every later step
(sharding rules keyed by op, fusion patterns, the stage split, AOTAutograd, codegen) works
on plain ATen nodes, so `inline_regions` replaces each such HOP by the nodes of its
submodule, with the mode made explicit in the dataflow:

* grad mode: a node computed with grad disabled records no history in eager, so no
  gradient reaches its inputs through it. Inlined, the region's nodes run under the
  graph's own (enabled) mode and every edge from a grad-disabled node to a grad-enabled
  one (or to the graph's output) is cut with `aten.detach` (floating values only: other
  dtypes carry no gradient), unless the node hands on its grad-enabled input as the same
  tensor (`x.to(x.dtype)`): the tracer then records later reads of `x` as reads of that
  node, and those read `x` again. Any path into a grad-disabled node crosses such an edge before
  it reaches a differentiated value, so the gradients are those of eager, and the forward
  values are bitwise equal (the same ops on the same inputs, detach being an alias). The
  forward `remove_noop` keeps these detaches; the joint one drops them after autograd.
* autocast: each node of an enabled autocast region reads its operands through the casts
  autocast applies to that op (`aten._to_copy(x, dtype=...)` before the op, found by running
  the op on fake values under `torch.autocast` and recording what reaches the dispatcher
  below it), then runs without autocast. The rewrite is checked: the ATen calls below
  autocast must be the same with the explicit casts as under autocast (an op whose
  decomposition casts inside, like `einsum` on some devices, is refused). A disabled region
  (`enabled=False`) outside any enabled one is a plain inline.
* any other HOP with a submodule (`cond`, `while_loop`, `map`, `invoke_subgraph`, ...) is a
  TraceError naming the op and the module: its branches or loop cannot be inlined without
  changing what runs.

Numerics: bitwise equal to eager for the forward; gradients as eager autograd's.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from mxgraph.errors import TraceError
from mxgraph.ir import graph_fake_mode

aten = torch.ops.aten
HOP = torch._ops.HigherOrderOperator
GRAD_MODE = "wrap_with_set_grad_enabled"
AUTOCAST = "wrap_with_autocast"
_GRAD = "mx_grad_enabled"
_AUTOCAST = "mx_autocast"


def region_hops(gm: GraphModule) -> list[Node]:
    """The call_function nodes of `gm` calling a HOP with a submodule among its arguments."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, HOP)
            and any(_submodule(gm, a) is not None for a in n.args)]


def inline_regions(gm: GraphModule) -> GraphModule:
    """Inline every grad-mode and autocast HOP of `gm` (module docstring), in place.

    Precondition: a graph from `torch.export` (training IR). Guarantee: no HOP with a
    submodule is left, the submodules are deleted, every inlined node keeps its meta
    (`nn_module_stack` the HOP's where the submodule's node has none). Returns `gm`."""
    hops = region_hops(gm)
    if not hops:
        return gm
    while hops:
        _inline(gm, hops[0])
        hops = region_hops(gm)
    _cut_no_grad_edges(gm)
    _autocast_casts(gm)
    for node in gm.graph.nodes:
        node.meta.pop(_GRAD, None)
        node.meta.pop(_AUTOCAST, None)
    for name, _ in list(gm.named_children()):
        if not gm.graph.find_nodes(op="get_attr", target=name):
            gm.delete_submodule(name)
    gm.graph.lint()
    gm.recompile()
    return gm


def _submodule(gm: GraphModule, arg) -> GraphModule | None:
    if isinstance(arg, Node) and arg.op == "get_attr":
        value = getattr(gm, arg.target, None)
        return value if isinstance(value, GraphModule) else None
    return None


def _where(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else "<root>"
    return path.removeprefix("L['self'].") or "<root>"


def _inline(gm: GraphModule, hop: Node) -> None:
    """Replace `hop` by its submodule's nodes; record each node's grad mode and autocast."""
    name = hop.target.name()
    grad, autocast = hop.meta.get(_GRAD, True), hop.meta.get(_AUTOCAST)
    if name == GRAD_MODE:
        grad, sub_arg, operands = bool(hop.args[0]), hop.args[1], hop.args[2:]
    elif name == AUTOCAST:
        device, dtype, enabled, cache = hop.args[:4]
        sub_arg, operands = hop.args[4], hop.args[5:]
        autocast = (device, dtype) if enabled else None
        if not enabled and hop.meta.get(_AUTOCAST) is not None:
            raise TraceError(f"module {_where(hop)}: an autocast region disabled inside an "
                             f"enabled one; mxgraph inlines enabled regions and disabled ones "
                             f"outside them only")
    else:
        raise TraceError(f"module {_where(hop)}: higher-order op {name} runs a submodule "
                         f"(control flow or a wrapped subgraph); mxgraph inlines grad-mode "
                         f"(torch.no_grad / enable_grad) and autocast regions only: write the "
                         f"branch with torch.where or move it out of the traced forward")
    if hop.kwargs:
        raise TraceError(f"module {_where(hop)}: {name} with keyword arguments {list(hop.kwargs)}")
    sub = _submodule(gm, sub_arg)
    graph = gm.graph
    env: dict[Node, object] = {}
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(operands):
        raise TraceError(f"module {_where(hop)}: {name} passes {len(operands)} operands to a "
                         f"submodule of {len(placeholders)} inputs")
    env.update(zip(placeholders, operands, strict=True))
    outputs = ()
    with graph.inserting_before(hop):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = node.args[0]
                continue
            if node.op == "get_attr":  # a nested region's submodule: moved up to `gm`
                target = _fresh_name(gm, node.target)
                gm.add_submodule(target, getattr(sub, node.target))
                env[node] = graph.get_attr(target)
                env[node].meta = dict(node.meta)
                continue
            new = graph.node_copy(node, lambda arg: env[arg])
            if not new.meta.get("nn_module_stack") and hop.meta.get("nn_module_stack"):
                new.meta["nn_module_stack"] = dict(hop.meta["nn_module_stack"])
            new.meta[_GRAD], new.meta[_AUTOCAST] = grad, autocast
            env[node] = new
    for user in list(hop.users):
        if user.target is not operator.getitem:
            raise TraceError(f"module {_where(hop)}: {name}'s result is read by "
                             f"{user.format_node()} (expected getitem)")
        user.replace_all_uses_with(env[outputs[user.args[1]]]
                                   if isinstance(outputs[user.args[1]], Node) else outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(hop)
    if not sub_arg.users:
        graph.erase_node(sub_arg)


def _fresh_name(gm: GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_inlined{i}"):
        i += 1
    return f"{base}_inlined{i}"


def _cut_no_grad_edges(gm: GraphModule) -> None:
    """Read every floating value a grad-disabled node computes through one `detach` where a
    grad-enabled node or the output reads it."""
    graph = gm.graph
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.meta.get(_GRAD, True) or not isinstance(val, torch.Tensor) or \
                not (val.is_floating_point() or val.is_complex()):
            continue
        readers = [u for u in node.users if u.op == "output" or u.meta.get(_GRAD, True)]
        if not readers:
            continue
        source = node
        while not source.meta.get(_GRAD, True) and _returns_input(source) is not None:
            source = _returns_input(source)
        if source.meta.get(_GRAD, True):  # eager hands the grad-enabled tensor itself on
            for user in readers:
                user.replace_input_with(node, source)
            continue
        with graph.inserting_after(node):
            detach = graph.call_function(aten.detach.default, (node,))
        detach.meta.update({k: v for k, v in node.meta.items() if k in (
            "nn_module_stack", "stack_trace", "custom", "torch_fn")})
        with graph_fake_mode(graph) or contextlib.nullcontext():
            detach.meta["val"] = val.detach()
        for user in readers:
            user.replace_input_with(node, detach)


def _returns_input(node: Node) -> Node | None:
    """The input a node hands on as the very same tensor in eager (`x.to(x.dtype)`, a
    contiguous `x.contiguous()`), or None. A later read of `x` then traces as a read of the
    node, even outside the grad-disabled region the node ran in."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    source, val = node.args[0], node.meta.get("val")
    before = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(before, torch.Tensor):
        return None
    if node.target in _TO_SELF and not node.kwargs.get("copy") and \
            node.kwargs.get("memory_format") in (None, torch.preserve_format) and \
            (val.dtype, val.device) == (before.dtype, before.device):
        return source
    if node.target is aten.contiguous.default and before.is_contiguous():
        return source
    return None


_TO_SELF = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other)


class _Recorder(TorchDispatchMode):
    """The ATen calls that reach the dispatcher below autocast: the casts of the watched
    tensors (operand path -> dtype), and every other call (op, operand dtypes and shapes)."""

    def __init__(self, watched: dict[int, list[tuple]]):
        super().__init__()
        self.watched = watched
        self.calls: list[tuple] = []
        self.casts: dict[tuple, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._to_copy.default and id(args[0]) in self.watched:
            for path in self.watched[id(args[0])]:
                self.casts.setdefault(path, out.dtype)
        elif func is not torch.ops.prim.device.default:  # a metadata query
            leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            self.calls.append((func, tuple((x.dtype, tuple(x.shape)) for x in leaves)))
        return out


def _autocast_casts(gm: GraphModule) -> None:
    """Make the casts of every node inlined from an enabled autocast region explicit."""
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    made: dict[tuple[Node, torch.dtype], Node] = {}
    for node in list(graph.nodes):
        mode = node.meta.get(_AUTOCAST)
        if mode is None or node.op != "call_function" or node.target is operator.getitem:
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise TraceError(f"module {_where(node)}: {node.target} inside an autocast region "
                             f"is no ATen op; mxgraph makes autocast's casts explicit per op")
        for path, dtype in _casts_of(node, mode, fake_mode).items():
            operand = _get(node.args, node.kwargs, path)
            key = (operand, dtype)
            if key not in made:
                with graph.inserting_before(node):  # first reader: after every placeholder
                    made[key] = graph.call_function(aten._to_copy.default, (operand,),
                                                    {"dtype": dtype})
                made[key].meta.update({k: v for k, v in node.meta.items() if k in (
                    "nn_module_stack", "stack_trace", "custom")})
                with fake_mode or contextlib.nullcontext():
                    made[key].meta["val"] = operand.meta["val"].to(dtype)
            args, kwargs = list(node.args), dict(node.kwargs)
            _set(args, kwargs, path, made[key])
            node.args, node.kwargs = tuple(args), kwargs


def _operands(node: Node) -> list[tuple]:
    """The path of every Node among the argument leaves: (position or keyword,) or
    (position, index in a list argument)."""
    found = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, Node):
            found.append((i,))
        elif isinstance(arg, (list, tuple)):
            found += [(i, j) for j, a in enumerate(arg) if isinstance(a, Node)]
    found += [(key,) for key, arg in node.kwargs.items() if isinstance(arg, Node)]
    return found


def _casts_of(node: Node, mode: tuple, fake_mode) -> dict[tuple, torch.dtype]:
    """operand path -> the dtype autocast casts it to before running `node`'s op, checked:
    with these casts made beforehand, the op without autocast makes the same ATen calls."""
    device, dtype = mode
    paths = _operands(node)

    def run(casts: dict[tuple, torch.dtype], autocast: bool) -> _Recorder:
        args = list(tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, node.args))
        kwargs = dict(tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, node.kwargs))
        watched: dict[int, list[tuple]] = {}
        for path in paths:
            value = _get(args, kwargs, path)
            if isinstance(value, torch.Tensor):
                watched.setdefault(id(value), []).append(path)
        recorder = _Recorder(watched)
        with fake_mode or contextlib.nullcontext(), torch.no_grad(), \
                torch.autocast(device, dtype=dtype, enabled=autocast), recorder:
            for path, to in casts.items():
                _set(args, kwargs, path, _get(args, kwargs, path).to(to))
            node.target(*args, **kwargs)
        return recorder

    under = run({}, True)
    replay = run(under.casts, False)
    if replay.calls != under.calls or replay.casts != under.casts:
        raise TraceError(f"module {_where(node)}: {node.target} under autocast casts inside its "
                         f"decomposition; mxgraph cannot make its casts explicit: move it out of "
                         f"the autocast region")
    return under.casts


def _get(args, kwargs, path):
    value = args[path[0]] if isinstance(path[0], int) else kwargs[path[0]]
    return value[path[1]] if len(path) > 1 else value


def _set(args: list, kwargs: dict, path: tuple, new) -> None:
    if len(path) > 1:
        container = list(_get(args, kwargs, path[:1]))
        container[path[1]] = new
        new, path = container, path[:1]
    if isinstance(path[0], int):
        args[path[0]] = new
    else:
        kwargs[path[0]] = new
