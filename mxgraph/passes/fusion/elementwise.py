"""Elementwise fusion patterns: SwiGLU (and bias-SwiGLU), bias-GELU, bias-dropout-add.

Each pattern's docstring says what it matches and what it rewrites to. Matching reads op
and shape/dtype only; the sub-chains a fused op replaces must have no other users.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from mxgraph.ir import is_op, schema_arg
from mxgraph.passes.fusion.rewriter import (
    Match,
    Pattern,
    Rewriter,
    commuted,
    dtype,
    getitem_of,
    is_bias_for,
    is_tensor,
    linear_parts,
    only_users,
    plain_add,
    replace,
    shape,
)

aten = torch.ops.aten
mx = torch.ops.mxgraph


def _silu_input(node):
    """`a` when `node` computes silu(a) as aten.silu(a) or a * sigmoid(a) (either order)."""
    if is_op(node, aten.silu.default):
        return node.args[0], [node]
    if is_op(node, aten.mul.Tensor):
        for a, s in commuted(node):
            if is_op(s, aten.sigmoid.default) and s.args[0] is a and only_users(s, {node}):
                return a, [node, s]
    return None


class SwiGLU(Pattern):
    """Matches: ``mul(silu(a), b)`` with silu as ``aten.silu(a)`` (``F.silu``, ``nn.SiLU``, an
    ``ACT2FN`` lookup) or ``a * sigmoid(a)``, operands in either order; ``a`` and ``b`` of one
    shape and floating dtype. When ``a`` and ``b`` are both biased linears, or the two halves
    (``chunk``/``split`` on the last dim) of one biased linear, the biases move into the op.

    Rewrite to: ``mxgraph.swiglu(a, b)``, or ``mxgraph.bias_swiglu(a', b', bias_a, bias_b)``
    where ``a'``, ``b'`` come from the same linears without their bias.
    """

    kind = "swiglu"

    def match(self, node: Node, rw: Rewriter):
        if not is_op(node, aten.mul.Tensor):
            return None
        for act, b in commuted(node):
            found = _silu_input(act)
            if found is None or not is_tensor(b):
                continue
            a, chain = found
            if not only_users(act, {node}) or shape(a) != shape(b) or dtype(a) != dtype(b):
                continue
            if not dtype(a).is_floating_point:
                continue
            m = Match(node, [node] + chain, {"a": a, "b": b})
            self._biases(m)
            return m
        return None

    def _biases(self, m: Match) -> None:
        a, b = m.parts["a"], m.parts["b"]
        inside = set(m.nodes)
        la, lb = linear_parts(a), linear_parts(b)
        if (la and lb and la[2] is not None and lb[2] is not None
                and only_users(a, inside) and only_users(b, inside)):
            m.parts["split"] = None
            m.parts["linears"] = (la, lb)
            m.nodes += [a, b]
            return
        if getitem_of(a, index=0) and getitem_of(b, index=1) and a.args[0] is b.args[0]:
            cut = a.args[0]
            whole = linear_parts(cut.args[0])
            n = shape(a)[-1]
            if (whole and whole[2] is not None and is_op(cut, aten.chunk, aten.split,
                                                         aten.split_with_sizes)
                    and shape(cut.args[0])[-1] == 2 * n and len(cut.users) == 2
                    and only_users(cut.args[0], {cut}) and only_users(a, inside)
                    and only_users(b, inside) and _last_dim_halves(cut, n)):
                m.parts["split"] = whole
                m.nodes += [a, b, cut, cut.args[0]]

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        if "linears" in p:
            (xa, wa, ba), (xb, wb, bb) = p["linears"]
            a = self.helper(rw, m, aten.linear.default, (xa, wa))
            b = self.helper(rw, m, aten.linear.default, (xb, wb))
            out = self.fused(rw, m, mx.bias_swiglu.default, (a, b, ba, bb))
        elif p.get("split") is not None:
            x, w, bias = p["split"]
            n = shape(p["a"])[-1]
            whole = self.helper(rw, m, aten.linear.default, (x, w))
            a = self.helper(rw, m, aten.slice.Tensor, (whole, -1, 0, n))
            b = self.helper(rw, m, aten.slice.Tensor, (whole, -1, n, 2 * n))
            ba = self.helper(rw, m, aten.slice.Tensor, (bias, 0, 0, n))
            bb = self.helper(rw, m, aten.slice.Tensor, (bias, 0, n, 2 * n))
            out = self.fused(rw, m, mx.bias_swiglu.default, (a, b, ba, bb))
        else:
            out = self.fused(rw, m, mx.swiglu.default, (p["a"], p["b"]))
        replace(m.root, out)


def _last_dim_halves(cut: Node, n: int) -> bool:
    ndim = len(shape(cut.args[0]))
    dim = schema_arg(cut, "dim")
    if dim not in (-1, ndim - 1):
        return False
    if is_op(cut, aten.chunk):
        return cut.args[1] == 2
    if is_op(cut, aten.split):
        return schema_arg(cut, "split_size") == n
    return list(schema_arg(cut, "split_sizes")) == [n, n]


class BiasGelu(Pattern):
    """Matches: ``gelu(add(x, bias))`` (operands in either order) with ``bias`` 1-D as long as
    ``x``'s last dim, and ``gelu(linear(x, W, bias))``; ``approximate`` "none" (erf) or "tanh".

    Rewrite to: ``mxgraph.bias_gelu(x, bias, approximate)``; the biased linear becomes
    ``linear(x, W)`` feeding it.
    """

    kind = "bias_gelu"

    def match(self, node: Node, rw: Rewriter):
        if not is_op(node, aten.gelu.default):
            return None
        approximate = schema_arg(node, "approximate")
        if approximate not in ("none", "tanh"):
            return None
        src = node.args[0]
        if not only_users(src, {node}):
            return None
        if plain_add(src):
            for x, bias in commuted(src):
                if is_bias_for(bias, x) and len(shape(x)) >= 2 and dtype(x) == dtype(node):
                    return Match(node, [node, src], {"x": x, "bias": bias, "approximate": approximate})
        parts = linear_parts(src)
        if parts and parts[2] is not None and is_bias_for(parts[2], src):
            return Match(node, [node, src], {"linear": parts, "approximate": approximate})
        return None

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        if "linear" in p:
            x_in, w, bias = p["linear"]
            x = self.helper(rw, m, aten.linear.default, (x_in, w))
        else:
            x, bias = p["x"], p["bias"]
        out = self.fused(rw, m, mx.bias_gelu.default, (x, bias, p["approximate"]))
        replace(m.root, out)


class BiasDropoutAdd(Pattern):
    """Matches: ``add(residual, dropout(add(x, bias), p, train=True))`` (every add in either
    order), the same without the bias add or with the bias of a linear (``dropout(linear(x, W,
    b))``, split out as for bias-GELU), and ``add(residual, add(x, bias))`` (dropout off:
    `remove_noop` has already dropped an identity dropout); ``bias`` 1-D as long as ``x``'s last
    dim, ``x`` and ``residual`` of one shape and dtype.

    Rewrite to: ``mxgraph.bias_dropout_add(x, bias, residual, p, training, seed, offset)``.
    The mask is a hash of (seed, element index): each site draws its ``seed`` every step in
    the graph, just before it runs, from torch's CPU generator (``randint`` then ``item``: no
    device sync), so the same ``torch.manual_seed`` gives the same masks, and a pipeline
    split keeps each site's seed in its stage.
    """

    kind = "bias_dropout_add"

    def match(self, node: Node, rw: Rewriter):
        if not plain_add(node):
            return None
        for residual, branch in commuted(node):
            p, training, inner = 0.0, False, branch
            if is_op(branch, aten.dropout.default):
                p, training, inner = schema_arg(branch, "p"), schema_arg(branch, "train"), branch.args[0]
                if not only_users(branch, {node}):
                    continue
            x, bias, linear = inner, None, None
            if plain_add(inner) and only_users(inner, {node, branch}):
                for xx, bb in commuted(inner):
                    if is_bias_for(bb, xx) and len(shape(xx)) >= 2:
                        x, bias = xx, bb
                        break
            parts = linear_parts(inner)
            if (training and p > 0 and parts and parts[2] is not None and only_users(inner, {branch})
                    and is_bias_for(parts[2], inner)):
                bias, linear = parts[2], parts  # dropout(linear(x, W, b)): the bias moves into the op
            if bias is None and not (training and p > 0):
                continue
            if shape(inner if linear else x) != shape(residual) or dtype(residual) != dtype(node) \
                    or dtype(inner if linear else x) != dtype(node) or not dtype(node).is_floating_point:
                continue
            nodes = [node] + ([branch] if branch is not inner else []) + ([inner] if bias is not None else [])
            x = x if linear is None else None  # the bias-free linear is made by the rewrite
            return Match(node, nodes, {"x": x, "bias": bias, "residual": residual, "p": float(p),
                                       "training": bool(training and p > 0), "linear": linear})
        return None

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        seed = 0
        if p["training"]:  # a fresh seed per site and step, drawn where the site runs
            draw = self.helper(rw, m, aten.randint.low, (0, 2 ** 31 - 1, []),
                               {"dtype": torch.int64, "device": torch.device("cpu")})
            seed = self.helper(rw, m, aten._local_scalar_dense.default, (draw,))
        x = p["x"]
        if p["linear"] is not None:
            x = self.helper(rw, m, aten.linear.default, p["linear"][:2])
        out = self.fused(rw, m, mx.bias_dropout_add.default,
                         (x, p["bias"], p["residual"], p["p"], p["training"], seed, 0))
        replace(m.root, out)
