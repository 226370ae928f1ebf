"""Fusion patterns for RMSNorm (with the residual add) and the linear + cross-entropy loss."""
from __future__ import annotations

import torch
from torch.fx import Node

from mxgraph.ir import VIEW_OPS, is_op, schema_arg
from mxgraph.passes.fusion.rewriter import (
    Match,
    Pattern,
    Rewriter,
    commuted,
    dtype,
    is_bias_for,
    is_float_cast,
    last_dim,
    linear_parts,
    only_users,
    plain_add,
    replace,
    shape,
    skip_casts,
)

aten = torch.ops.aten
mx = torch.ops.mxgraph


def _normalized(node):
    """(X, eps, chain) when `node` = mul(X, rsqrt(add(mean(pow(X, 2), [-1], keepdim), eps)))
    (products in either order, X*X for the square), else None."""
    if not is_op(node, aten.mul.Tensor):
        return None
    for x, r in commuted(node):
        if not is_op(r, aten.rsqrt.default):
            continue
        add = r.args[0]
        if not is_op(add, aten.add.Tensor, aten.add.Scalar) or not isinstance(add.args[1], float):
            continue
        mean = add.args[0]
        if not is_op(mean, aten.mean.dim) or not schema_arg(mean, "keepdim"):
            continue
        dims = schema_arg(mean, "dim")
        if dims is None or len(dims) != 1 or not last_dim(dims[0], len(shape(x))):
            continue
        sq = mean.args[0]
        squared = ((is_op(sq, aten.pow.Tensor_Scalar) and sq.args[0] is x and sq.args[1] == 2)
                   or (is_op(sq, aten.mul.Tensor) and sq.args[0] is x and sq.args[1] is x))
        chain = [node, r, add, mean, sq]
        if squared and all(only_users(n, set(chain)) for n in chain[1:]):
            return x, add.args[1], chain
    return None


class RMSNorm(Pattern):
    """Matches: ``aten.rms_norm(x, [N], weight, eps)``, and ``mul(cast(mul(X, rsqrt(add(mean(
    pow(X, 2), [-1], keepdim=True), eps)))), weight)`` with ``X`` = ``x`` or ``x`` cast to
    float32, the cast back optional, products in either order, ``weight`` ``[N]``. When ``x``
    is ``add(a, r)`` (same shape and dtype, no broadcast), the residual add folds in.

    Rewrite to: ``mxgraph.rmsnorm(x, weight, eps)[0]``, or ``mxgraph.add_rmsnorm(a, r, weight,
    eps)`` whose ``(y, h)`` replace the norm and the add.
    """

    kind = "rmsnorm"

    def match(self, node: Node, rw: Rewriter):
        if is_op(node, aten.rms_norm.default):
            x, weight, eps = node.args[0], schema_arg(node, "weight"), schema_arg(node, "eps")
            if weight is None or len(schema_arg(node, "normalized_shape")) != 1:
                return None
            eps = torch.finfo(dtype(x)).eps if eps is None else eps
            return self._finish(Match(node, [node], {"weight": weight, "eps": float(eps)}), x)
        if not is_op(node, aten.mul.Tensor):
            return None
        for normed, weight in commuted(node):
            inner = skip_casts(normed)
            found = _normalized(inner)
            if found is None or not is_bias_for(weight, inner):
                continue
            x32, eps, chain = found
            casts = _cast_chain(normed, inner)
            nodes = [node] + casts + chain
            if not all(only_users(n, set(nodes)) for n in nodes[1:]):
                continue
            x = skip_casts(x32)
            if dtype(x) != dtype(node):
                x = x32
            if dtype(x) != dtype(node):
                continue
            return self._finish(Match(node, nodes, {"weight": weight, "eps": float(eps)}), x)
        return None

    def _finish(self, m: Match, x):
        if shape(m.parts["weight"]) != shape(x)[-1:] or dtype(x) != dtype(m.root):
            return None
        m.parts["x"] = x
        if plain_add(x) and shape(x.args[0]) == shape(x.args[1]) == shape(x) and \
                dtype(x.args[0]) == dtype(x.args[1]) == dtype(x) and _defined_before(m.parts["weight"], x):
            m.parts["add"] = x
        return m

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        if "add" in p:
            add = p["add"]
            m.nodes.append(add)
            residual, branch = add.args
            # right after the add: nodes between the add and the norm may read the sum
            with rw.at(add.next):
                fused = self.fused(rw, m, mx.add_rmsnorm.default,
                                   (branch, residual, p["weight"], p["eps"]))
                y, h, _ = rw.outputs(fused, 3, like=m.root, kind=self.kind)
            replace(m.root, y)
            replace(add, h)
        else:
            fused = self.fused(rw, m, mx.rmsnorm.default, (p["x"], p["weight"], p["eps"]))
            y, _ = rw.outputs(fused, 2, like=m.root, kind=self.kind)
            replace(m.root, y)


def _defined_before(value, node: Node) -> bool:
    """`value` (a node) comes before `node` in the graph: the fused add+norm goes at `node`."""
    if value.op == "placeholder":
        return True
    cursor = node.prev
    while cursor.op != "root":
        if cursor is value:
            return True
        cursor = cursor.prev
    return False


def _cast_chain(top, bottom) -> list:
    chain = []
    while top is not bottom:
        chain.append(top)
        top = top.args[0]
    return chain


def _through_views_and_casts(node, allowed_cast_to=torch.float32):
    """Walk up from `node` through reshapes/views/flattens and float casts to fp32; returns
    (source, chain of walked nodes)."""
    chain = []
    while True:
        if is_op(node, *VIEW_OPS, aten.flatten.using_ints):
            chain.append(node)
            node = node.args[0]
        elif is_float_cast(node) and dtype(node) == allowed_cast_to:
            chain.append(node)
            node = node.args[0]
        else:
            return node, chain


class LinearCrossEntropy(Pattern):
    """Matches: ``cross_entropy_loss(L, t)`` with mean reduction, no class weights and no label
    smoothing, where ``L`` is ``linear(h, W)`` (no bias) seen through reshape/view/flatten to
    ``[N, V]`` and casts to float32, in any order, used only by the loss.

    Rewrite to: ``mxgraph.linear_cross_entropy(h.reshape(N, D), W, t, chunk, ignore_index)[0]``,
    chunked so that at most ~64M logits exist at once.
    """

    kind = "linear_cross_entropy"

    def match(self, node: Node, rw: Rewriter):
        if not is_op(node, aten.cross_entropy_loss.default):
            return None
        if (schema_arg(node, "weight") is not None or schema_arg(node, "reduction") != 1
                or schema_arg(node, "label_smoothing") != 0.0 or dtype(node) != torch.float32):
            return None
        logits, targets = node.args[0], node.args[1]
        if len(shape(logits)) != 2 or len(shape(targets)) != 1:
            return None
        src, chain = _through_views_and_casts(logits)
        parts = linear_parts(src)
        if parts is None or parts[2] is not None:
            return None
        nodes = [node] + chain + [src]
        if not all(only_users(n, set(nodes)) for n in nodes[1:]):
            return None
        h, w, _ = parts
        n, v = shape(logits)
        if shape(src)[-1] != v or shape(w)[0] != v:
            return None
        return Match(node, nodes, {"h": h, "w": w, "targets": targets, "n": n,
                                   "ignore_index": schema_arg(node, "ignore_index")})

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        h = p["h"]
        d = shape(h)[-1]
        if len(shape(h)) != 2:
            h = self.helper(rw, m, aten.reshape.default, (h, [p["n"], d]))
        v = shape(p["w"])[0]
        chunk = max(1, min(int(p["n"]), (1 << 26) // max(1, int(v))))
        fused = self.fused(rw, m, mx.linear_cross_entropy.default,
                           (h, p["w"], p["targets"], chunk, p["ignore_index"]))
        loss, _ = rw.outputs(fused, 2, like=m.root, kind=self.kind)
        replace(m.root, loss)
