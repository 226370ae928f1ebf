"""What the runner checks after every pass (`runner.run_pass`); each rule raises `PassError`
naming the pass and the node.

* the graph is well formed (`Graph.lint`);
* every functional collective (`_c10d_functional.*`) has a `wait_tensor` user;
* a node the pass created: is no mutating op (graphs stay functional until codegen); has
  `meta["val"]` (later passes and the analyses read shapes from it); draws no random
  numbers unless the pass declares it (`PassSpec.adds_random`); and, if it is an
  mxgraph collective (an op with a `group_name` argument), is known to the communication
  report (`collectives.groups.KIND`) and names a group of this compile's mesh;
* no output of the graph that was not an alias of an input before the pass is one after.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from mxgraph.ir import is_mutating, is_random, schema_arg, storage_roots
from mxgraph.runtime.collectives.groups import KIND


class PassError(RuntimeError):
    """A pass broke an invariant of the graph."""


def is_collective(node: Node) -> bool:
    """A functional collective's start (`_c10d_functional.*` but `wait_tensor`)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "_c10d_functional" and
            target.overloadpacket is not torch.ops._c10d_functional.wait_tensor)


def check_graph(gm: GraphModule, where: str) -> None:
    """Lint and the collective/wait rule."""
    try:
        gm.graph.lint()
    except Exception as error:  # noqa: BLE001 - re-raised with the pass name
        raise PassError(f"pass {where} left a malformed graph: {error}") from error
    waits = torch.ops._c10d_functional.wait_tensor.default
    for node in gm.graph.nodes:
        if is_collective(node):
            # multi-output collectives are read through getitem, each waited on
            leaves = [v for u in node.users for v in (
                u.users if u.target is not waits and not isinstance(u.target, torch._ops.OpOverload)
                else [u])]
            if not any(getattr(u, "target", None) is waits for u in leaves):
                raise PassError(f"pass {where}: collective {node.name} has no wait_tensor")


def check_new_nodes(nodes: list[Node], where: str, mesh, adds_random: bool) -> None:
    for node in nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if is_mutating(node):
            raise PassError(f"pass {where} introduced the mutating op {target} ({node.name}); "
                            "graphs stay functional until codegen")
        returns = not isinstance(target, torch._ops.OpOverload) or target._schema.returns
        if returns and "val" not in node.meta:  # (a check like _assert_scalar returns none)
            raise PassError(f"pass {where} created {node.name} ({target}) without meta['val']; "
                            "set it from the op's fake implementation")
        if not adds_random and is_random(node):
            raise PassError(f"pass {where} introduced the random op {target} ({node.name}) "
                            "without declaring it (PassSpec.adds_random)")
        _check_collective(node, where, mesh)


def _check_collective(node: Node, where: str, mesh) -> None:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "mxgraph" or \
            "group_name" not in [a.name for a in target._schema.arguments]:
        return
    name = target._schema.name.split("::", 1)[1]
    if name not in KIND:
        raise PassError(f"pass {where} inserted the collective mxgraph::{name} ({node.name}), "
                        "unknown to the communication report: add it to collectives.groups.KIND")
    group = schema_arg(node, "group_name")
    if mesh is None:
        raise PassError(f"pass {where} inserted mxgraph::{name} ({node.name}) in a one-device "
                        "compile (no mesh)")
    try:
        mesh.axis_of(group)
    except KeyError as error:
        raise PassError(f"pass {where}: mxgraph::{name} ({node.name}) names group {group!r}, "
                        f"which is no axis of this mesh") from error


def aliased_outputs(gm: GraphModule) -> set[int]:
    """Positions of the graph's outputs whose storage is a placeholder's."""
    roots = storage_roots(gm)
    output = gm.graph.find_nodes(op="output")[0]
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    return {i for i, value in enumerate(values) if isinstance(value, Node) and
            value.op != "placeholder" and roots.get(value, value).op == "placeholder"}


def check_aliases(gm: GraphModule, before: set[int], where: str) -> None:
    new = aliased_outputs(gm) - before
    if new:
        raise PassError(f"pass {where} made output(s) {sorted(new)} an alias of an input; "
                        "return a copy")
