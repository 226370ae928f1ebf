"""MoE fusion patterns: the top-k router and the token permute/unpermute around the experts."""
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
    getitem_of,
    is_bias_for,
    is_float_cast,
    last_dim,
    only_users,
    replace,
    shape,
    skip_casts,
)

aten = torch.ops.aten
mx = torch.ops.mxgraph
_NORM_EPS = 1e-20  # the op's normalisation epsilon


def _topk(node, index: int):
    """(topk node, k) when `node` is output `index` of a largest, last-dim aten.topk."""
    if not getitem_of(node, index=index) or not is_op(node.args[0], aten.topk.default):
        return None
    topk = node.args[0]
    src = topk.args[0]
    if not last_dim(schema_arg(topk, "dim"), len(shape(src))) or not schema_arg(topk, "largest"):
        return None
    return topk, schema_arg(topk, "k")


def _scores(node):
    """(logits, score_func) when `node` is softmax(logits, -1) or sigmoid(logits)."""
    if is_op(node, aten.sigmoid.default):
        return node.args[0], "sigmoid"
    if is_op(node, aten.softmax.int, aten._softmax.default) and last_dim(node.args[1], len(shape(node))):
        if is_op(node, aten.softmax.int) and schema_arg(node, "dtype") not in (None, dtype(node)):
            return None
        return node.args[0], "softmax"
    return None


def _groups(choice, topk: int):
    """(ungrouped choice, num_groups, topk_groups, k2, nodes) for a group-limited selection
    ``view(masked_fill(grouped, ~scatter(zeros, 1, topk(sum(topk(grouped, k2).values),
    topk_groups).indices, True)[..., None], -inf), [T, E])`` with ``grouped = view(choice,
    [T, G, E/G])``; k2 (the best scores summed per group) becomes the op's ``group_topk``."""
    if not is_op(choice, *VIEW_OPS) or not is_op(choice.args[0], aten.masked_fill.Scalar):
        return None
    fill = choice.args[0]
    grouped, mask = fill.args[0], fill.args[1]
    if fill.args[2] != float("-inf") or not is_op(grouped, *VIEW_OPS) or len(shape(grouped)) != 3:
        return None
    nodes = [choice, fill]
    while is_op(mask, aten.bitwise_not.default, aten.logical_not.default, aten.unsqueeze.default):
        nodes.append(mask)
        mask = mask.args[0]
    if not is_op(mask, aten.scatter.value) or mask.args[1] != 1 or mask.args[3] is not True:
        return None
    kept = _topk(mask.args[2], 1)
    zeros = mask.args[0]
    if kept is None or not is_op(zeros, aten.zeros_like.default):
        return None
    group_sum = kept[0].args[0]
    if not is_op(group_sum, aten.sum.dim_IntList) or zeros.args[0] is not group_sum:
        return None
    best = _topk(group_sum.args[0], 0)
    if best is None or best[0].args[0] is not grouped:
        return None
    num_groups, topk_groups = shape(grouped)[1], kept[1]
    nodes += [mask, mask.args[2], kept[0], zeros, group_sum, group_sum.args[0], best[0], grouped]
    nodes += [u for u in kept[0].users] + [u for u in best[0].users]
    return grouped.args[0], num_groups, topk_groups, best[1], nodes


class MoERouter(Pattern):
    """Matches: ``gather(scores, 1, topk(choice, K).indices)`` (or, HF style, the top-k
    values ``topk(scores, K).values``) with ``scores`` =
    ``softmax(logits, -1)`` or ``sigmoid(logits)``, ``choice`` = ``scores`` or ``scores +
    expert_bias`` (1-D, no gradient), optionally group-limited (DeepSeek-V3 form: per group the
    sum of its best ``k2`` choice scores, the best ``topk_groups`` groups kept,
    ``masked_fill(-inf)``), then optionally ``w / (w.sum(-1, keepdim=True) + 1e-20)`` (or without
    the epsilon) and
    ``w * route_scale``.

    Rewrite to: ``mxgraph.moe_router(logits, expert_bias, K, score_func, num_groups,
    topk_groups, normalize, route_scale, group_topk=k2)`` whose ``(probs, topk_ids)`` replace the gate weights
    and the top-k indices.
    """

    kind = "moe_router"

    def match(self, node: Node, rw: Rewriter):
        if _topk(node, 0) is not None:  # HF form: the top-k values are the gate weights
            topk_node = node.args[0]
            scores = topk_node.args[0]
            ids = next((u for u in topk_node.users if getitem_of(u, index=1)), None)
            if ids is None:
                return None
        elif is_op(node, aten.gather.default) and node.args[1] in (1, -1):
            scores, ids = node.args[0], node.args[2]
        else:
            return None
        found = _scores(scores)
        chosen = _topk(ids, 1)
        if found is None or chosen is None or len(shape(scores)) != 2:
            return None
        logits, score_func = found
        topk_node, k = chosen
        choice = topk_node.args[0]
        nodes = list(dict.fromkeys([node, topk_node] + [u for u in topk_node.users if u is not ids]))
        num_groups, topk_groups, group_topk = 1, 1, 0
        grouped = _groups(choice, k)
        if grouped is not None:
            choice, num_groups, topk_groups, group_topk, group_nodes = grouped
            nodes += group_nodes
        bias = None
        if choice is not scores:
            if not is_op(choice, aten.add.Tensor):
                return None
            others = [b for s, b in commuted(choice) if s is scores]
            if not others or not is_bias_for(others[0], scores) or rw.needs_grad(others[0]):
                return None
            bias = others[0]
            nodes.append(choice)
        root, normalize, route_scale = self._weights(node)
        nodes += root[1]
        inside = set(nodes) | {ids}
        if not all(only_users(n, inside) for n in nodes if n is not root[0]):
            return None
        if dtype(logits) != torch.float32 or dtype(root[0]) != torch.float32:
            return None
        return Match(root[0], nodes, {"logits": logits, "bias": bias, "k": k, "ids": ids,
                                      "args": (score_func, num_groups, topk_groups, normalize,
                                               route_scale, group_topk)})

    def _weights(self, gather: Node):
        """((root, chain), normalize, route_scale) following the gate weights from `gather`."""
        root, chain, normalize, scale = gather, [], False, 1.0
        users = list(gather.users)
        div = next((u for u in users if is_op(u, aten.div.Tensor) and u.args[0] is gather), None)
        if div is not None and len(users) == 2:
            denom = div.args[1]
            eps = is_op(denom, aten.add.Tensor) and denom.args[1] == _NORM_EPS
            total = denom.args[0] if eps else denom  # without the epsilon: 1e-20 is below an ulp
            if (is_op(total, aten.sum.dim_IntList) and total.args[0] is gather and total in users
                    and schema_arg(total, "keepdim") and last_dim(total.args[1][0], 2)):
                root, chain, normalize = div, [div, total] + ([denom] if eps else []), True
        if len(root.users) == 1:
            user = next(iter(root.users))
            scale_arg = user.args[1] if is_op(user, aten.mul.Tensor) else None
            if user.args[0] is root and isinstance(scale_arg, (int, float)):
                root, scale = user, float(user.args[1])
                chain.append(user)
        return (root, chain), normalize, scale

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        ids = p["ids"]
        with rw.at(ids.next):  # the ids may be read before the gate weights are
            fused = self.fused(rw, m, mx.moe_router.default, (p["logits"], p["bias"], p["k"]) + p["args"])
            probs, topk_ids, _ = rw.outputs(fused, 3, like=m.root, kind=self.kind)
        replace(ids, topk_ids)
        replace(m.root, probs)
        m.nodes.append(ids)


class MoEPermute(Pattern):
    """Matches: the dropless dispatch of ``models/moe.py`` (and the same hand-written one):
    ``order = argsort(ids.reshape(-1), stable=True)``, ``token = order // K``, expert input
    ``x[token]``, and the combine ``zeros_like(x).index_add(0, token, y_rows * w_rows[:, None])``
    with ``w_rows = weights.reshape(-1)[order]`` (a cast allowed); the expert count ``E`` is read
    from the ``scatter_add`` that counts tokens per expert.

    Rewrite to: ``mxgraph.moe_permute(x, ids, E)`` whose sorted rows replace ``x[token]``, and
    ``mxgraph.moe_unpermute(y_rows, row_map, weights)`` replacing the combine (both tagged
    ``moe_permute``). The capacity-padded dispatch (one-hot cumsum) is not matched.
    """

    kind = "moe_permute"

    def match(self, node: Node, rw: Rewriter):
        if not is_op(node, aten.index.Tensor) or len(node.args[1]) != 1:
            return None
        x, token = node.args[0], node.args[1][0]
        if not is_op(token, aten.floor_divide.default) or not is_op(token.args[0], aten.argsort.stable):
            return None
        order = token.args[0]
        flat = order.args[0]
        if not schema_arg(order, "stable") or not is_op(flat, *VIEW_OPS) or len(shape(flat)) != 1:
            return None
        ids = flat.args[0]
        if len(shape(ids)) != 2 or token.args[1] != shape(ids)[1] or len(shape(x)) != 2:
            return None
        experts = self._num_experts(flat)
        combine = next((u for u in token.users if u is not node), None)
        if experts is None or len(token.users) != 2 or combine is None:
            return None
        found = self._combine(combine, x, order, ids)
        if found is None:
            return None
        y_rows, weights, nodes = found
        return Match(node, [node, token, order] + nodes,
                     {"x": x, "ids": ids, "experts": experts, "combine": combine, "y_rows": y_rows,
                      "weights": weights})

    def _num_experts(self, flat: Node):
        for user in flat.users:
            if is_op(user, aten.scatter_add.default) and user.args[2] is flat and len(shape(user)) == 1:
                return shape(user)[0]
        return None

    def _combine(self, node, x, order, ids):
        if not is_op(node, aten.index_add.default) or node.args[1] != 0 or schema_arg(node, "alpha") != 1:
            return None
        zeros, prod = node.args[0], node.args[3]
        if not is_op(zeros, aten.zeros_like.default, aten.new_zeros.default) or shape(zeros) != shape(x):
            return None
        if not is_op(prod, aten.mul.Tensor):
            return None
        for y_rows, column in commuted(prod):
            chain = [column]
            w = column
            while is_op(w, aten.unsqueeze.default) or (is_op(w, aten.slice.Tensor)
                                                        and shape(w) == shape(w.args[0])):
                w = w.args[0]
                chain.append(w)
            cast = w if is_float_cast(w) else None
            w = skip_casts(w)
            if not (is_op(w, aten.index.Tensor) and len(w.args[1]) == 1 and w.args[1][0] is order):
                continue
            flat_w = w.args[0]
            if not is_op(flat_w, *VIEW_OPS) or len(shape(flat_w)) != 1:
                continue
            weights = flat_w.args[0]
            if shape(weights) != shape(ids) or shape(y_rows) != (shape(ids)[0] * shape(ids)[1], shape(x)[1]):
                continue
            nodes = [node, zeros, prod, w, flat_w] + chain
            return y_rows, weights, nodes + ([cast] if cast is not None else [])
        return None

    def rewrite(self, rw: Rewriter, m: Match) -> None:
        p = m.parts
        fused = self.fused(rw, m, mx.moe_permute.default, (p["x"], p["ids"], p["experts"]))
        rows, row_map, _ = rw.outputs(fused, 3, like=m.root, kind=self.kind)
        replace(m.root, rows)
        combine = p["combine"]
        with rw.at(combine):
            out = rw.call(mx.moe_unpermute.default, (p["y_rows"], row_map, p["weights"]), like=combine,
                          kind=self.kind, fused_from=[n.name for n in m.nodes if n is not m.root])
        replace(combine, out)

