"""Fold a residual gradient into the fused RMSNorm backward that it is added to.

Autograd sums the gradients of a value used twice: when the input ``h`` of a fused RMSNorm also
feeds a residual connection (the first layer's norm reads the embedding, which the residual
stream carries on), the joint graph ends with ``add(grad_residual, rmsnorm_backward(...)[0])``.
``mxgraph::rmsnorm_backward`` takes that addend itself (``grad_residual``): one pass over memory
less on a GPU, and on the CPU the sum eager autograd does, ``(grad_residual + direct) + through
the mean square``, so fusing changes no bit of the gradient.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext

_NORM_BACKWARD = "mxgraph::rmsnorm_backward"


def _is_norm_backward(node: Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.name() == _NORM_BACKWARD)


def _same_layout(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype)


def _foldable_add(norm: Node, order: dict[Node, int]) -> tuple[Node, Node, Node] | None:
    """(getitem of grad_h, the add, the residual gradient) when ``grad_h``'s one use is
    ``add(residual_grad, grad_h)`` and the residual gradient exists before the norm's backward."""
    if len(norm.args) > 4 and norm.args[4] is not None:
        return None
    grad_h = [u for u in norm.users if u.target is operator.getitem and u.args[1] == 0]
    if len(grad_h) != 1 or len(grad_h[0].users) != 1:
        return None
    add = next(iter(grad_h[0].users))
    if add.target is not torch.ops.aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    residual = add.args[0]
    if (add.args[1] is not grad_h[0] or not isinstance(residual, Node) or order[residual] > order[norm]
            or not _same_layout(residual, grad_h[0])):
        return None
    return grad_h[0], add, residual


def fuse_residual_grad_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Rewrite ``add(r, rmsnorm_backward(g, h, w, rstd, None)[0])`` to
    ``rmsnorm_backward(g, h, w, rstd, r)[0]`` when ``r`` is computed before the backward op
    and has ``grad_h``'s shape and dtype.

    Precondition: a joint graph. Guarantee: same outputs; on the CPU bitwise equal to eager
    autograd of the unfused norm (the residual gradient is the first addend there too).
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for norm in [n for n in gm.graph.nodes if _is_norm_backward(n)]:
        found = _foldable_add(norm, order)
        if found is None:
            continue
        grad_h, add, residual = found
        args = list(norm.args) + [None] * (5 - len(norm.args))
        args[4] = residual
        norm.args = tuple(args)
        add.replace_all_uses_with(grad_h)
        gm.graph.erase_node(add)
    return gm
