"""Clean-up passes: drop nodes that compute nothing, and dead code; make the views the
tracer recorded independent of strides.

All are bitwise-neutral: they remove work whose result is unused or equal to its input, or
replace an op by one that computes the same values.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from mxgraph.context import CompileContext
from mxgraph.ir import IDENTITY_OPS, is_mutating, is_random

aten = torch.ops.aten


def _is_identity(node: torch.fx.Node, identities: frozenset) -> bool:
    if node.target in identities:
        return True
    if node.target in (aten.dropout.default,):  # dropout(x, p, train)
        return node.args[1] == 0 or node.args[2] is False
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype", "device",
                                                                    "layout"}:
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
                and src.dtype == out.dtype and src.device == out.device)
    return False


def _is_legacy_empty(arg) -> bool:
    """A 1-D tensor without elements: `torch.cat` skips it beside operands of any rank (its
    legacy rule), as in the first concatenation of a key/value cache created in the forward."""
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.ndim == 1 and val.shape[0] == 0


def _drop_empty_operands(node: torch.fx.Node) -> bool:
    """Drop the legacy-empty operands of a `cat` whose other operands give its dtype; a cat
    left with one operand is replaced by it. True if the graph changed."""
    tensors, out = list(node.args[0]), node.meta.get("val")
    kept = [t for t in tensors if not _is_legacy_empty(t)]
    if len(kept) == len(tensors) or not kept or not isinstance(out, torch.Tensor) or any(
            t.meta.get("val") is None or t.meta["val"].dtype != out.dtype for t in kept):
        return False
    if len(kept) == 1:
        node.replace_all_uses_with(kept[0])
        node.graph.erase_node(node)
    else:
        node.args = (kept, *node.args[1:])
    return True


def remove_noop_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Replace identity ops of a forward graph (alias, dropout with p=0 or train=False, a
    copy to the same dtype and device) by their input, drop tensor-metadata asserts, and drop
    the empty 1-D operands of `cat` (a cache's first concatenation: `cat([tensor([]), k], -2)`).
    A `detach` stays: before autograd it stops gradients (the model's own `.detach()`, the
    edges out of a `torch.no_grad()` region, `mxgraph.hops`).

    Precondition: a functional forward graph. Guarantee: same outputs, same gradients.
    Numerics: bitwise equal. Returns `gm` itself when nothing changed.
    """
    return _remove_noop(gm, ctx, frozenset({aten.alias.default}))


def remove_noop_joint_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """`remove_noop_pass` on a joint graph, where `detach` is an identity too (the backward
    is derived already; AOTAutograd leaves detaches of saved values).

    Precondition: a functional joint graph. Guarantee: same outputs. Numerics: bitwise
    equal. Returns `gm` itself when nothing changed.
    """
    return _remove_noop(gm, ctx, IDENTITY_OPS)


def _remove_noop(gm: GraphModule, ctx: CompileContext, identities: frozenset) -> GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            changed = True
        elif _is_identity(node, identities):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
        elif node.target is aten.cat.default and _drop_empty_operands(node):
            changed = True
    return dead_code_pass(gm, ctx) if changed else gm


def merges_dims(src_shape, dst_shape) -> bool:
    """Whether reshaping `src_shape` to `dst_shape` folds two or more input dimensions of
    size > 1 into one group (`[2, 16, 2, 4] -> [2, 16, 8]`, `[6, 4] -> [4, 6]`): only such a
    view depends on the input's strides. Splitting a dimension and adding or dropping dims
    of size 1 is a view for any strides; an empty tensor views in any shape. Unknown
    (symbolic) sizes count as merging."""
    if not all(isinstance(d, int) for d in (*src_shape, *dst_shape)):
        return True
    if 0 in src_shape:
        return False
    src, dst = [d for d in src_shape if d != 1], [d for d in dst_shape if d != 1]
    i = j = 0
    while i < len(src):
        size_src, size_dst, first = src[i], dst[j], i
        while size_src != size_dst:
            if size_src < size_dst:
                i += 1
                size_src *= src[i]
            else:
                j += 1
                size_dst *= dst[j]
        if i > first:
            return True
        i, j = i + 1, j + 1
    return False


def safe_views_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Turn every `view` / `_unsafe_view` that merges dimensions (`merges_dims`) into
    `reshape`.

    Why: AOTAutograd decomposed eager's `reshape` (the backward of every `view`) into `view`
    where the *fake* strides allowed one, and an op may lay its output out otherwise at run
    time (torch's meta of `softplus_backward` says contiguous where the CPU kernel follows
    its gradient's transposed layout; a `cat` of such values is then channels-last and its
    `view` fails); in a forward graph, a user's `view` that eager's layout allowed may read
    the output of an op a forward pass put in (a fused kernel, a collective) laid out
    otherwise. `reshape` is that same view when the real strides allow one and a copy
    otherwise, as in eager.

    Precondition: a functional graph (no value's aliasing is observed). Guarantee: same
    outputs, same nodes (target changed in place; meta, provenance and names kept); no view
    in the graph depends on its input's strides. Numerics: bitwise equal. Returns `gm`.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.view.default, aten._unsafe_view.default):
            continue
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)) or merges_dims(
                tuple(src.shape), tuple(out.shape)):
            node.target = aten.reshape.default
    return gm


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
