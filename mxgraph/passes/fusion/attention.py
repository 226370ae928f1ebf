"""Attention fusion patterns: RoPE on q and k, and Repeat-GQA attention."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from mxgraph.ir import VIEW_OPS, is_op, schema_arg
from mxgraph.passes.fusion.rewriter import (
    Match,
    Pattern,
    Rewriter,
    commuted,
    dtype,
    erase_dead,
    getitem_of,
    halves,
    is_float_cast,
    last_dim,
    norm_dim,
    only_users,
    plain_add,
    replace,
    shape,
    slice_range,
    strided_halves,
)

aten = torch.ops.aten
mx = torch.ops.mxgraph
_RESHAPES = VIEW_OPS | {aten.flatten.using_ints}


# ---- RoPE ----------------------------------------------------------------------------------
def _rotation(r):
    """(x, interleaved, nodes) when `r` is rotate-half(x) or rotate-every-two(x)."""
    if is_op(r, aten.cat.default) and len(r.args[0]) == 2 and last_dim(schema_arg(r, "dim"), len(shape(r))):
        neg, x1 = r.args[0]
        if is_op(neg, aten.neg.default):
            found = halves(x1, neg.args[0])
            if found is not None:
                return found[0], False, [r, neg, x1, neg.args[0]] + _cut(x1)
    if is_op(r, *_RESHAPES) and is_op(r.args[0], aten.stack.default):
        stack = r.args[0]
        parts = stack.args[0]
        if len(parts) != 2 or not is_op(parts[0], aten.neg.default):
            return None
        neg, x1 = parts
        x2 = neg.args[0]
        ndim = len(shape(x1))
        dim = norm_dim(schema_arg(stack, "dim"), ndim + 1)
        nodes = [r, stack, neg, x1, x2]
        if dim == ndim:                   # pairs (2i, 2i+1): interleaved
            src = strided_halves(x1, x2)
            if src is not None and shape(r) == shape(src):
                return src, True, nodes
        elif dim == ndim - 1:             # [.., 2, half] flattened: rotate-half
            found = halves(x1, x2)
            if found is not None and shape(r) == shape(found[0]):
                return found[0], False, nodes + _cut(x1)
    return None


def _cut(half) -> list:
    return [half.args[0]] if getitem_of(half) else []


def _base(node):
    while is_op(node, aten.unsqueeze.default, *VIEW_OPS):
        node = node.args[0]
    return node


@dataclass
class _Site:
    x: Node           # rotated tensor, [B, S, H, R] (or [B, H, S, R] when seq_dim == 2)
    out: Node         # node whose value the rotated tensor replaces
    tables: tuple     # ("real", cos, sin) or ("complex", freqs)
    key: tuple        # sites with equal keys may share one op (q and k)
    seq_dim: int
    interleaved: bool
    nodes: list
    rot: int


class RoPE(Pattern):
    """Matches: ``add(mul(X, cos), mul(rotate(X), sin))`` (operands in any order) where
    ``rotate`` is rotate-half, ``cat((-x2, x1), -1)`` or ``stack((-x2, x1), -2).flatten(-2)`` of
    the halves, or rotate-every-two, ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``
    (interleaved); and complex RoPE, ``view_as_real(view_as_complex(X.reshape(..., -1, 2)) *
    freqs).flatten(3)``. ``X`` is 4-D ``[B, S, H, R]`` or ``[B, H, S, R]``, ``cos``/``sin`` (or
    ``freqs``) broadcast from ``[S, R]`` and need no gradient; a cast of ``X`` to float32
    and back folds in, and so does a partial rotary ``cat((rope(x[..., :R]), x[..., R:]), -1)``.
    Two sites with the same tables (q and k) share one op.

    Rewrite to: ``mxgraph.rope(q, k, cos[S, R], sin[S, R], interleaved)`` (transposed to and
    from ``[B, S, H, D]`` when the sequence is dim 2); an unpaired site passes its input twice.
    """

    kind = "rope"

    def apply(self, rw: Rewriter) -> int:
        sites = []
        for node in list(rw.graph.nodes):
            if node.op == "call_function" and node.users:
                site = self._site(node, rw)
                if site is not None:
                    sites.append(site)
        taken: set = set()
        count = 0
        for i, site in enumerate(sites):
            if id(site) in taken:
                continue
            partner = None
            for other in sites[i + 1:]:
                if id(other) not in taken and other.key == site.key and self._can_pair(rw, site, other):
                    partner = other
                    break
            taken.add(id(site))
            if partner is not None:
                taken.add(id(partner))
            m = Match(site.out, site.nodes + (partner.nodes if partner else []))
            if self.attempt(rw, m, lambda m=m, site=site, partner=partner: self._rewrite(rw, m, site, partner)):
                erase_dead(rw.graph, m.nodes)
                rw.invalidate()
                count += 1
        return count

    # -- matching
    def _site(self, node: Node, rw: Rewriter):
        found = self._core(node) or self._complex(node)
        if found is None:
            return None
        x, tables, interleaved, nodes = found
        if not all(only_users(n, set(nodes)) for n in nodes if n is not node):
            return None
        if len(shape(x)) != 4 or any(rw.needs_grad(t) for t in tables[1:]):
            return None
        rot = shape(x)[-1]
        table_shape = (1,) * (4 - len(shape(tables[1]))) + shape(tables[1])
        if tables[0] == "real":
            if shape(tables[1]) != shape(tables[2]) or table_shape[-1] != rot:
                return None
        elif table_shape[-1] * 2 != rot:
            return None
        seq_dims = [d for d in range(3) if table_shape[d] != 1]
        seq_dim = seq_dims[0] if len(seq_dims) == 1 else (1 if shape(x)[1] == 1 and not seq_dims else None)
        if seq_dim not in (1, 2) or table_shape[seq_dim] != shape(x)[seq_dim]:
            return None
        out = node
        if is_float_cast(x) and len(node.users) == 1:
            user = next(iter(node.users))
            if is_float_cast(user) and dtype(user) == dtype(x.args[0]) and user.args[0] is node:
                nodes.append(user)
                x, out = x.args[0], user
        if dtype(out) != dtype(x):
            return None
        full = self._partial(out, x)
        if full is not None:
            nodes.append(full[0])
            out, x = full
        key = (tables[0],) + tuple(_base(t) for t in tables[1:]) + (interleaved, seq_dim, rot,
                                                                    dtype(x), shape(x)[0],
                                                                    shape(x)[seq_dim])
        return _Site(x, out, tables, key, seq_dim, interleaved, nodes, rot)

    def _core(self, node):
        if not plain_add(node):
            return None
        for m1, m2 in commuted(node):
            if not (is_op(m1, aten.mul.Tensor) and is_op(m2, aten.mul.Tensor)):
                continue
            for x, cos in commuted(m1):
                for r, sin in commuted(m2):
                    rot = _rotation(r)
                    if rot is not None and rot[0] is x and isinstance(cos, Node) and isinstance(sin, Node):
                        return x, ("real", cos, sin), rot[1], [node, m1, m2] + rot[2]
        return None

    def _complex(self, node):
        if not is_op(node, *_RESHAPES) or not is_op(node.args[0], aten.view_as_real.default):
            return None
        real = node.args[0]
        prod = real.args[0]
        if not is_op(prod, aten.mul.Tensor):
            return None
        for c, freqs in commuted(prod):
            if not is_op(c, aten.view_as_complex.default) or not isinstance(freqs, Node):
                continue
            pairs = c.args[0]
            if not is_op(pairs, *VIEW_OPS) or shape(pairs)[-1] != 2:
                continue
            x = pairs.args[0]
            if shape(x) == shape(node) and shape(pairs)[:-2] == shape(x)[:-1]:
                return x, ("complex", freqs), True, [node, real, prod, c, pairs]
        return None

    def _partial(self, out, x):
        """(cat, whole) when `out` is only the first part of `cat((out, pass), -1)` and `x`
        and `pass` are the first R and the remaining channels of `whole`."""
        if len(out.users) != 1:
            return None
        cat = next(iter(out.users))
        if not is_op(cat, aten.cat.default) or len(cat.args[0]) != 2 or cat.args[0][0] is not out:
            return None
        if not last_dim(schema_arg(cat, "dim"), len(shape(cat))):
            return None
        rest = cat.args[0][1]
        if not (is_op(x, aten.slice.Tensor) and is_op(rest, aten.slice.Tensor) and x.args[0] is rest.args[0]):
            return None
        whole = x.args[0]
        n, r = shape(whole)[-1], shape(x)[-1]
        ndim = len(shape(whole))
        if not (last_dim(schema_arg(x, "dim"), ndim) and last_dim(schema_arg(rest, "dim"), ndim)):
            return None
        if slice_range(x, n) != (0, r, 1) or slice_range(rest, n) != (r, n, 1):
            return None
        return cat, whole

    def _can_pair(self, rw: Rewriter, a: _Site, b: _Site) -> bool:
        pos = rw.position()
        inputs = [a.x, b.x] + list(a.tables[1:])
        users = [u for s in (a, b) for u in s.out.users]
        return bool(users) and max(pos[n] for n in inputs) < min(pos[u] for u in users)

    # -- rewriting
    def _rewrite(self, rw: Rewriter, m: Match, a: _Site, b: _Site | None) -> None:
        pos = rw.position()
        users = [u for s in (a, b) if s is not None for u in s.out.users]
        first = min(users, key=pos.__getitem__)
        with rw.at(first):
            cos, sin = self._tables(rw, m, a)
            q = self._to_bshd(rw, m, a.x, a.seq_dim)
            k = self._to_bshd(rw, m, b.x, b.seq_dim) if b else q
            fused = self.fused(rw, m, mx.rope.default, (q, k, cos, sin, a.interleaved))
            q_out, k_out = rw.outputs(fused, 2, like=a.out, kind=self.kind)
            replace(a.out, self._from_bshd(rw, m, q_out, a.seq_dim))
            if b is not None:
                replace(b.out, self._from_bshd(rw, m, k_out, b.seq_dim))

    def _tables(self, rw, m, site: _Site):
        seq = shape(site.x)[site.seq_dim]
        if site.tables[0] == "real":
            return tuple(self.helper(rw, m, aten.reshape.default, (t, [seq, site.rot]))
                         for t in site.tables[1:])
        pairs = self.helper(rw, m, aten.view_as_real.default, (site.tables[1],))
        pairs = self.helper(rw, m, aten.reshape.default, (pairs, [seq, site.rot // 2, 2]))
        out = []
        for part in (0, 1):
            half = self.helper(rw, m, aten.select.int, (pairs, -1, part))
            out.append(self.helper(rw, m, aten.repeat_interleave.self_int, (half, 2, -1)))
        return tuple(out)

    def _to_bshd(self, rw, m, x, seq_dim):
        return x if seq_dim == 1 else self.helper(rw, m, aten.transpose.int, (x, 1, 2))

    def _from_bshd(self, rw, m, x, seq_dim):
        return x if seq_dim == 1 else self.helper(rw, m, aten.transpose.int, (x, 1, 2))


# ---- Repeat-GQA ----------------------------------------------------------------------------
def _unrepeat(node):
    """(base, rep, head_dim, layout ops, nodes) when `node` is, through transposes/permutes,
    a repeat of `base`'s heads: repeat_interleave(base, rep, dim) or
    reshape(expand(unsqueeze(base, h + 1), ...)) merging dims h and h + 1."""
    layout = []
    while is_op(node, aten.transpose.int, aten.permute.default):
        layout.append(node)
        node = node.args[0]
    if is_op(node, aten.repeat_interleave.self_int):
        base, rep, dim = node.args[0], schema_arg(node, "repeats"), schema_arg(node, "dim")
        if dim is None or not isinstance(rep, int):
            return None
        return base, rep, norm_dim(dim, len(shape(base))), layout[::-1], layout + [node]
    if is_op(node, *VIEW_OPS) and is_op(node.args[0], aten.expand.default):
        expand = node.args[0]
        unsq = expand.args[0]
        if not is_op(unsq, aten.unsqueeze.default):
            return None
        base = unsq.args[0]
        while is_op(base, aten.slice.Tensor) and slice_range(base, shape(base.args[0])[norm_dim(
                schema_arg(base, "dim"), len(shape(base)))]) == (0, shape(base)[norm_dim(
                    schema_arg(base, "dim"), len(shape(base)))], 1) and shape(base) == shape(base.args[0]):
            base = base.args[0]           # x[:, :, :] full slices
        bs = shape(base)
        u = norm_dim(unsq.args[1], len(bs) + 1)
        if u == 0:
            return None
        h = u - 1
        rep = shape(expand)[u]
        merged = bs[:h] + (bs[h] * rep,) + bs[h + 1:]
        if shape(node) != merged or shape(expand)[:u] + shape(expand)[u + 1:] != bs:
            return None
        return base, rep, h, layout[::-1], layout + [node, expand, unsq]
    return None


def _moves_to(layout, h: int, ndim: int):
    """The dim that `h` lands on after the transposes/permutes of `layout` (base outward)."""
    perm = list(range(ndim))
    for op in layout:
        if is_op(op, aten.transpose.int):
            d0, d1 = norm_dim(op.args[1], ndim), norm_dim(op.args[2], ndim)
            perm[d0], perm[d1] = perm[d1], perm[d0]
        else:
            perm = [perm[norm_dim(d, ndim)] for d in op.args[1]]
    return perm.index(h)


def repeated_kv(k, v):
    """(K's, V's `_unrepeat` findings) when `k` and `v` of a [B, H, S, D] attention both
    repeat their heads by one factor of at least 2, the head dim landing on dim 1; else None."""
    found = _unrepeat(k), _unrepeat(v)
    if found[0] is None or found[1] is None or found[0][1] != found[1][1] or found[0][1] < 2:
        return None
    if any(_moves_to(layout, h, 4) != 1 for _, _, h, layout, _ in found):
        return None
    return found


class RepeatGQA(Pattern):
    """Matches: ``scaled_dot_product_attention(q, K, V, attn_mask=None, dropout_p=0, is_causal,
    scale)`` on 4-D ``[B, H, S, D]`` where ``K`` and ``V`` repeat the heads of ``k`` and ``v`` by
    the same factor: ``repeat_interleave(k, rep, dim=h)`` or ``k[:, :, :, None].expand(...)
    .reshape(...)`` (head ``h`` serves query heads ``h*rep .. h*rep+rep-1``), optionally through
    transposes/permutes that bring the head dim to dim 1; and SDPA with ``enable_gqa=True``
    on fewer kv heads (it repeats them itself).

    Rewrite to: ``mxgraph.gqa_attention(q, k', v', is_causal, scale)[0]`` with ``k'``, ``v'`` the
    un-repeated tensors in the same layout (the repeat is never materialised).
    """

    kind = "gqa"

    def match(self, node: Node, rw: Rewriter):
        if not is_op(node, aten.scaled_dot_product_attention.default):
            return None
        if schema_arg(node, "attn_mask") is not None or schema_arg(node, "dropout_p") != 0.0:
            return None
        q, k, v = node.args[:3]
        if len(shape(q)) != 4 or shape(k) != shape(v):
            return None
        scale = schema_arg(node, "scale")
        scale = 1.0 / math.sqrt(shape(q)[-1]) if scale is None else float(scale)
        causal = bool(schema_arg(node, "is_causal"))
        if schema_arg(node, "enable_gqa"):  # SDPA repeats the kv heads itself
            if shape(k)[1] == shape(q)[1] or shape(q)[1] % shape(k)[1]:
                return None
            return Match(node, [node], {"q": q, "k": (k, 1, 1, [], []), "v": (v, 1, 1, [], []),
                                        "scale": scale, "causal": causal})
        found = repeated_kv(k, v)
        if found is None:
            return None
        found_k, found_v = found
        nodes = [node] + found_k[4] + found_v[4]
        if not all(only_users(n, set(nodes)) for n in nodes[1:]):
            return None
        return Match(node, nodes, {"q": q, "k": found_k, "v": found_v, "scale": scale, "causal": causal})

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        kv = []
        for base, _, _, layout, _ in (p["k"], p["v"]):
            x = base
            for op in layout:
                x = self.helper(rw, m, op.target, (x,) + tuple(op.args[1:]))
            kv.append(x)
        fused = self.fused(rw, m, mx.gqa_attention.default, (p["q"], kv[0], kv[1], p["causal"], p["scale"]))
        out, _ = rw.outputs(fused, 2, like=m.root, kind=self.kind)
        replace(m.root, out)
