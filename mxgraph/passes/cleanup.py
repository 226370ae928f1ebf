"""Clean-up passes: drop nodes that compute nothing, and dead code.

All are bitwise-neutral: they remove work whose result is unused or equal to its input.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from mxgraph.context import CompileContext
from mxgraph.ir import IDENTITY_OPS, is_mutating, is_random

aten = torch.ops.aten


def _is_identity(node: torch.fx.Node) -> bool:
    if node.target in IDENTITY_OPS:
        return True
    if node.target in (aten.dropout.default,):  # dropout(x, p, train)
        return node.args[1] == 0 or node.args[2] is False
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype", "device",
                                                                    "layout"}:
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
                and src.dtype == out.dtype and src.device == out.device)
    return False


def remove_noop_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Replace identity ops (alias, detach, dropout with p=0 or train=False, a copy to the
    same dtype and device) by their input, and drop tensor-metadata asserts.

    Precondition: a functional graph. Guarantee: same outputs. Numerics: bitwise equal.
    Returns `gm` itself when nothing changed.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            changed = True
        elif _is_identity(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
    return dead_code_pass(gm, ctx) if changed else gm


def _has_side_effects(node: torch.fx.Node) -> bool:
    """Random ops advance the generator (removing one would change later draws), mutating
    ops write an input, impure ones act outside the graph."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return node.op == "call_function" and node.is_impure()
    return is_random(node) or is_mutating(node) or node.is_impure()


def dead_code_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Erase nodes whose values are unused, keeping random and mutating ops.

    Guarantee: same outputs and same random stream. Numerics: bitwise equal.
    """
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users and not _has_side_effects(node):
            gm.graph.erase_node(node)
    return gm
