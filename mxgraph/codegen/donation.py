"""Which inputs of a stage's backward programs Inductor may write over (donated buffers).

torch.compile's backward reuses the buffer of a saved activation that nothing reads after
it for one of its own results (AOTAutograd's donated buffers): no fresh allocation, and the
result is written where the input was just read, still in cache. A program here is the same
once its inputs are known to die with it. The executor keeps a micro-batch's values in one
environment: what B reads dies at the end of B unless W reads it too
(`StagePrograms.weight_reads`), and everything dies at the end of W. A value is donated to
its last program when it is a saved value (computed by F or B, never a parameter, buffer,
input or constant), it leaves the stage nowhere (not a stage output, an input gradient or a
parameter gradient), and it owns its storage: it is the result of an ATen op that is not a
view (`_unsafe_view` counted as one), and no view of it is read by the same program or lives
after it. Values of mxgraph's own ops (offload, collectives, fused kernels) are never
donated: their buffers may belong to a pool or a transfer.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from mxgraph.runtime.pipeline.programs import StagePrograms

_ALIASING = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}


def donated(programs: StagePrograms) -> dict[str, frozenset[Node]]:
    """{"B": ..., "W": ...}: the inputs of each backward program it may write over."""
    escaping = set(programs.forward_outputs) | set(programs.input_grads.values()) | \
        {node for _, node in programs.param_grads}
    after_b = escaping | programs.weight_reads
    return {"B": _dying(programs.backward_input.inputs, after_b),
            "W": _dying(programs.backward_weight.inputs, escaping)}


def _dying(inputs: list[Node], live_after: set[Node]) -> frozenset[Node]:
    if not inputs:
        return frozenset()
    roots: dict[Node, Node | None] = {}
    for node in inputs[0].graph.nodes:
        roots[node] = _root(node, roots)
    read = set(inputs)
    family: dict[Node, list[Node]] = {}
    for node, root in roots.items():
        if root is not None:
            family.setdefault(root, []).append(node)
    return frozenset(
        node for node in inputs
        if roots.get(node) is node and isinstance(node.meta.get("val"), torch.Tensor)
        and not any(member in live_after or (member is not node and member in read)
                    for member in family[node]))


def _root(node: Node, roots: dict[Node, Node | None]) -> Node | None:
    """The node whose fresh storage `node`'s value lives in; None when that is not known
    to be an ATen op's own result (a placeholder, a constant, mxgraph's ops)."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        return roots.get(source) if isinstance(source, Node) and _is_view(source.target) \
            else (node if _fresh_op(source) else None)
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if _is_view(target):
        source = node.args[0]
        return roots.get(source) if isinstance(source, Node) else None
    return node if _fresh_op(node) else None


def _fresh_op(node) -> bool:
    target = getattr(node, "target", None)
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims") \
        and not _is_view(target)


def _is_view(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target in _ALIASING or any(r.alias_info is not None for r in target._schema.returns)


__all__ = ["donated"]
