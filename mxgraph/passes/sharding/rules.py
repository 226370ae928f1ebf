"""Sharding rules every mesh axis shares, keyed by op (`COMMON`); the TP and CP passes
layer their own on top (`Rules(COMMON)` then `register`).

A rule reads its inputs' placements (`s.of`), rewrites the node for local shapes where a
size is an argument (views, expand, split sizes), asks for inputs in the placement it
needs (`s.need`) and returns the output's placement (a tuple for multi-output ops).
Matches (placements written R, S(d), P):
  * views, expand, permute/transpose, unsqueeze/squeeze: the shard follows its dim; P stays P;
  * copies, casts, dropout: keep the placement (a cast or dropout of P reduces first);
  * pointwise: inputs' shards must agree (a replicated operand with that dim is sliced, a
    broadcast one read whole); P stays P through sums of partials and products with
    replicated factors, else it is reduced (to the co-operands' shard, or to R);
  * reductions over other dims keep the shard; a sum or mean over the sharded dim is P;
  * softmax, norms, top-k over other dims keep the shard;
  * split, slice, select, cat along other dims keep it; replicated pieces of a cat are
    sliced;
  * matmuls: batch and free dims keep the shard, a contracted shard on both sides is P;
  * attention over a head shard; embedding of sharded indices; cross-entropy over a row
    shard (sum: P; mean: P sum over a P count);
  * *_like factories keep the placement; sinks (metadata asserts) return nothing.
Anything else gathers (`Sharder.gather_all`)."""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from mxgraph.ir import CAST_OPS, COPY_OPS, IDENTITY_OPS, VIEW_OPS, schema_arg
from mxgraph.passes.sharding.placement import P, Partial, R, Shard, view_group, view_placement
from mxgraph.passes.sharding.propagate import Fallback, Rules, placed
from mxgraph.plan import divisors

aten = torch.ops.aten
COMMON = Rules()
LINEAR_POINTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default}
"""Pointwise ops linear in all their tensor operands: partial in, partial out."""
SCALING = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
"""Pointwise ops linear in one operand (the first for div): one partial operand stays P."""


def _shard_of(s, value) -> Shard | None:
    p = s.of(value)
    return placed(p, s.ndim(value)) if isinstance(p, Shard) else None


def _summed(s, node: Node, value) -> Node:
    """`value` for `node`, summed first if it is partial (to R, or the axis's sequence
    shard: `Sharder.reduce_target`)."""
    if isinstance(s.of(value), Partial):
        return s.need(node, value, s.reduce_target(value))
    return value


# ---- shape ops --------------------------------------------------------------------------
@COMMON.register(*VIEW_OPS, aten.flatten.using_ints)
def view_rule(s, node: Node):
    x = node.args[0]
    have = s.of(x)
    if isinstance(have, Partial):
        return P
    full_in, full_out = s.full(x), s.full(node)
    shard = placed(have, len(full_in))
    out = view_placement(full_in, full_out, shard, s.axis.size)
    if out is None:
        group = view_group(full_in, full_out, shard.dim)
        lead = next((d for d in (group[1] if group else []) if full_out[d] != 1), None)
        if lead is not None and full_out[lead] % s.axis.size:  # heads the axis cannot split
            raise _indivisible(s, node, full_out[lead], f"{full_in} -> {full_out}")
        return s.gather_all(node, f"a view {full_in} -> {full_out} mixes the shard of dim "
                                  f"{have.dim} with other elements")
    if node.target in VIEW_OPS:  # sizes are arguments: this rank's (flatten has none)
        local = list(full_out)
        local[out.dim] //= s.axis.size
        node.args = (x, local) + tuple(node.args[2:])
    return out


def _indivisible(s, node: Node, size: int, what: str):
    from mxgraph.errors import PlanError
    module = (node.meta.get("custom") or {}).get("module") or "<top>"
    return PlanError(f"{s.axis.name}={s.axis.size} cannot shard {what} at {module} "
                     f"({node.target}) along a dim of size {size}: choose {s.axis.name} in "
                     f"{divisors(size)} (e.g. {s.axis.name} must divide the number of heads "
                     f"and KV heads, the FFN width, the vocabulary and the sequence)")


@COMMON.register(aten.expand.default)
def expand_rule(s, node: Node):
    x, sizes = node.args[0], list(node.args[1])
    have = s.of(x)
    if isinstance(have, Partial):
        return P
    shard = _shard_of(s, x)
    out = shard.at(shard.dim + len(sizes) - s.ndim(x))
    if sizes[out.dim] != -1:
        sizes[out.dim] //= s.axis.size
    node.args = (x, sizes) + tuple(node.args[2:])
    return out


@COMMON.register(aten.transpose.int, aten.permute.default, aten.t.default)
def permute_rule(s, node: Node):
    x = node.args[0]
    if isinstance(s.of(x), Partial):
        return P
    shard, ndim = _shard_of(s, x), s.ndim(x)
    if node.target is aten.t.default:
        return shard.at(1 - shard.dim) if ndim == 2 else shard
    if node.target is aten.transpose.int:
        a, b = (d % ndim for d in node.args[1:3])
        return shard.at(b if shard.dim == a else a if shard.dim == b else shard.dim)
    return shard.at([d % ndim for d in node.args[1]].index(shard.dim))


@COMMON.register(aten.unsqueeze.default)
def unsqueeze_rule(s, node: Node):
    x = node.args[0]
    if isinstance(s.of(x), Partial):
        return P
    shard = _shard_of(s, x)
    new = node.args[1] % s.ndim(node)
    return shard.at(shard.dim + 1 if new <= shard.dim else shard.dim)


@COMMON.register(aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rule(s, node: Node):
    x = node.args[0]
    if isinstance(s.of(x), Partial):
        return P
    shard, ndim = _shard_of(s, x), s.ndim(x)
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    gone = {d % ndim for d in dims if s.full(x)[d % ndim] == 1}
    return shard.at(shard.dim - sum(d < shard.dim for d in gone))


@COMMON.register(*(IDENTITY_OPS | COPY_OPS), aten.lift_fresh_copy.default)
def keep_rule(s, node: Node):
    return s.of(node.args[0])


@COMMON.register(*CAST_OPS, aten.native_dropout.default, aten.dropout.default)
def elementwise_copy_rule(s, node: Node):
    """A cast or a dropout keeps a shard (dropout draws per element); a partial value is
    reduced first (rounding and masks act on the sum, as on one device)."""
    out = s.of(_summed(s, node, node.args[0]))
    return (out, out) if node.target is aten.native_dropout.default else out


@COMMON.register(aten._assert_tensor_metadata.default, aten._assert_scalar.default)
def sink_rule(s, node: Node):
    """Metadata checks read a value and produce nothing."""
    return R


@COMMON.register(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                 aten.full_like.default, aten.rand_like.default, aten.randn_like.default)
def like_rule(s, node: Node):
    have = s.of(node.args[0])
    if isinstance(have, Partial):  # zeros or ones of the whole value's shape, on every rank
        return R if node.target is not aten.zeros_like.default else P
    return have


# ---- pointwise --------------------------------------------------------------------------
def _is_pointwise(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


@COMMON.register_if(_is_pointwise)
def pointwise_rule(s, node: Node):
    tensors = [a for a in node.args if isinstance(a, Node) and
               isinstance(a.meta.get("val"), torch.Tensor)]
    partial = [a for a in tensors if isinstance(s.of(a), Partial)]
    if partial and _stays_partial(s, node, tensors, partial):
        return P
    out_ndim = s.ndim(node)
    shards = {Shard(out_ndim - s.ndim(a) + _shard_of(s, a).dim, _shard_of(s, a).outer)
              for a in tensors if _shard_of(s, a) is not None}
    if len(shards) > 1:
        return s.gather_all(node, f"operands sharded differently {sorted(map(str, shards))}")
    target = shards.pop() if shards else None
    for arg in partial:  # reduced to the co-operands' shard, or where the axis sums them
        if target is None:
            dest = s.reduce_target(arg)
            s.need(node, arg, dest)
            target = dest.at(out_ndim - s.ndim(arg) + dest.dim) if isinstance(dest, Shard) \
                else None
        else:
            s.need(node, arg, target.at(target.dim - (out_ndim - s.ndim(arg))))
    if target is None:
        return R
    for arg in [a for a in node.args if isinstance(a, Node) and
                isinstance(a.meta.get("val"), torch.Tensor)]:
        if s.of(arg) != R:
            continue
        arg_dim = target.dim - (out_ndim - s.ndim(arg))
        if arg_dim >= 0 and s.full(arg)[arg_dim] != 1:
            s.need(node, arg, target.at(arg_dim))
    return target


def _stays_partial(s, node: Node, tensors: list[Node], partial: list[Node]) -> bool:
    if node.target in LINEAR_POINTWISE:  # every operand partial (a constant added is not)
        operands = [a for a in node.args if not isinstance(a, (torch.dtype, type(None)))]
        return len(partial) == len(operands)
    if node.target in SCALING and len(partial) == 1:
        first = node.args[0] is partial[0]
        others_whole = all(s.of(a) == R for a in tensors if a is not partial[0])
        return others_whole and (first or node.target in (aten.mul.Tensor, aten.mul.Scalar))
    return False


# ---- reductions -------------------------------------------------------------------------
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default,
              aten.amax.default, aten.amin.default, aten.var.correction, aten.logsumexp.default,
              aten.prod.dim_int, aten.any.dim, aten.all.dim, aten.argmax.default}


@COMMON.register(*REDUCTIONS)
def reduction_rule(s, node: Node):
    x = node.args[0]
    ndim = s.ndim(x)
    if node.target in (aten.sum.default, aten.mean.default):
        dims, keepdim = set(range(ndim)), False
    else:
        dims = schema_arg(node, "dim")
        dims = set(range(ndim)) if dims in (None, []) else {
            d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
        keepdim = schema_arg(node, "keepdim", False)
    linear = node.target in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default,
                             aten.mean.default)
    if isinstance(s.of(x), Partial) and linear:
        return P
    shard = _shard_of(s, _summed(s, node, x))
    if shard is None:
        return R
    if shard.dim not in dims:
        return shard.at(shard.dim if keepdim else shard.dim - sum(d < shard.dim for d in dims))
    if not linear:
        return s.gather_all(node, f"a {node.target} over the sharded dim {shard.dim}")
    s.sharded_reductions.append(Fallback(node, "a sum over the sharded dim", {x: s.of(x)}))
    if node.target in (aten.mean.dim, aten.mean.default):  # the local sum / the full count
        count = math.prod(s.full(x)[d] for d in dims)
        node.target = aten.sum.dim_IntList if node.target is aten.mean.dim else aten.sum.default
        scaled = s.insert(node.next, aten.div.Tensor, (node, count), placement=P)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    return P


@COMMON.register(aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
                 aten.log_softmax.int, aten.cumsum.default)
def along_dim_rule(s, node: Node):
    x, dim = node.args[0], node.args[1] % s.ndim(node.args[0])
    shard = _shard_of(s, _summed(s, node, x))
    if shard is None:
        return R
    if shard.dim == dim:
        return s.gather_all(node, f"{node.target} along the sharded dim {dim}")
    return shard


@COMMON.register(aten.topk.default, aten.sort.default)
def topk_rule(s, node: Node):
    x = node.args[0]
    dim = schema_arg(node, "dim", -1) % s.ndim(x)
    shard = _shard_of(s, _summed(s, node, x))
    if shard is None:
        return (R, R)
    if shard.dim == dim:
        return s.gather_all(node, f"{node.target} along the sharded dim {dim}")
    return (shard, shard)


@COMMON.register(aten.rms_norm.default, aten.layer_norm.default, aten.native_layer_norm.default)
def norm_rule(s, node: Node):
    x = node.args[0]
    shard = _shard_of(s, _summed(s, node, x))
    if shard is None:
        return R
    if shard.dim >= s.ndim(x) - len(node.args[1]):
        return s.gather_all(node, "a norm over the sharded dim")
    for param in node.all_input_nodes[1:]:
        if s.of(param) != R:
            s.need(node, param, R)
    return (shard, shard, shard) if node.target is aten.native_layer_norm.default else shard


# ---- along a dim ------------------------------------------------------------------------
SPLITS = {aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2,
          aten.unbind.int: 1}


@COMMON.register(*SPLITS)
def split_rule(s, node: Node):
    x = node.args[0]
    have = s.of(x)
    count = len(node.meta["val"])
    if isinstance(have, Partial):
        return (P,) * count
    shard, ndim = _shard_of(s, x), s.ndim(x)
    along = schema_arg(node, "dim", 0) % ndim
    if along == shard.dim:
        return s.split_along_shard(node) if hasattr(s, "split_along_shard") else \
            s.gather_all(node, "a split along the sharded dim")
    out = shard.at(shard.dim - 1) if node.target is aten.unbind.int and along < shard.dim \
        else shard
    return (out,) * count


@COMMON.register(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def slice_rule(s, node: Node):
    x = node.args[0]
    have = s.of(x)
    if isinstance(have, Partial):
        return P
    shard, ndim = _shard_of(s, x), s.ndim(x)
    along = schema_arg(node, "dim", 0) % ndim
    if along == shard.dim:
        return s.gather_all(node, "a slice along the sharded dim")
    dropped = node.target is aten.select.int and along < shard.dim
    return shard.at(shard.dim - 1) if dropped else shard


@COMMON.register(aten.gather.default, aten.scatter.src, aten.scatter.value,
                 aten.scatter_add.default, aten.scatter_reduce.two)
def along_index_rule(s, node: Node):
    """gather/scatter along a dim other than the shard, with the index (and source)
    sharded alike: each rank's rows are independent."""
    dim = node.args[1] % s.ndim(node.args[0])
    tensors = [a for a in node.args if isinstance(a, Node)]
    shards = {_shard_of(s, t) for t in tensors}
    if len(shards) != 1 or None in shards or any(isinstance(s.of(t), Partial) for t in tensors):
        return s.gather_all(node, "an index op with operands placed differently")
    shard = shards.pop()
    if shard.dim == dim:
        return s.gather_all(node, f"{node.target} along the sharded dim")
    return shard


@COMMON.register(aten.cat.default, aten.stack.default)
def cat_rule(s, node: Node):
    tensors = list(node.args[0])
    ndim = s.ndim(node)
    along = schema_arg(node, "dim", 0) % ndim
    shards = {_shard_of(s, t) for t in tensors} - {None}
    partial = [t for t in tensors if isinstance(s.of(t), Partial)]
    if partial and len(partial) == len(tensors):
        return P  # a cat of partial sums is the partial sum of the cat
    for t in partial:  # partial pieces beside whole or sharded ones: summed first
        s.need(node, t, s.reduce_target(t))
    shards = {_shard_of(s, t) for t in node.args[0]} - {None}
    if not shards:
        return R
    if len(shards) != 1:
        return s.gather_all(node, "pieces placed differently")
    shard = shards.pop()
    out = shard.at(shard.dim + 1 if node.target is aten.stack.default and along <= shard.dim
                   else shard.dim)
    if out.dim == along and node.target is aten.cat.default:
        return s.gather_all(node, "a cat along the sharded dim")
    for t in list(node.args[0]):  # replicated pieces (a shared RoPE key): this rank's part
        if s.of(t) == R:
            s.need(node, t, shard)
    return out


# ---- contractions -----------------------------------------------------------------------
@COMMON.register(aten.linear.default)
def linear_rule(s, node: Node):
    """x [.., k] @ W[n, k].T (+ b): a free dim of x keeps its shard; W sharded by rows
    gives a shard of the last dim; x and W sharded on k give P (the bias, if any, is
    added after: a P of x W.T plus a whole b)."""
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    xs, ws = _shard_of(s, x), _shard_of(s, weight)
    last = s.ndim(x) - 1
    if isinstance(s.of(x), Partial) and s.of(weight) == R and bias is None:
        return P
    if xs is not None and xs.dim != last and ws is None:
        return xs if s.of(bias) == R else s.gather_all(node, "a sharded bias")
    if xs is None and ws is not None and ws.dim == 0 and s.of(x) == R:
        if bias is not None:
            s.need(node, bias, Shard(0))
        return Shard(s.ndim(node) - 1)
    if xs is not None and xs.dim == last and ws is not None and ws.dim == 1:
        if bias is not None:
            return _bias_after(s, node, bias)
        return P
    return s.gather_all(node, f"a linear with input {s.of(x)} and weight {s.of(weight)}")


def _bias_after(s, node: Node, bias: Node):
    """`linear(x, W, b)` with a partial product: linear(x, W) + b, b added once."""
    node.args = node.args[:2]
    added = s.insert(node.next, aten.add.Tensor, (node, bias), placement=None)
    node.replace_all_uses_with(added, delete_user_cb=lambda u: u is not added)
    return P


@COMMON.register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul_rule(s, node: Node):
    a, b = node.args[:2]
    if s.ndim(a) < 2 or s.ndim(b) < 2:
        return s.gather_all(node, "a matmul of vectors")
    pa, pb = s.of(a), s.of(b)
    if isinstance(pa, Partial) and pb == R or isinstance(pb, Partial) and pa == R:
        return P
    sa, sb = _shard_of(s, a), _shard_of(s, b)
    na, nb, no = s.ndim(a), s.ndim(b), s.ndim(node)
    if sa is not None and sb is not None and sa.dim == na - 1 and sb.dim == nb - 2:
        return P  # the contracted dim on both sides
    if sa is not None and sb is not None and sa.dim < na - 2 and sb.dim < nb - 2 and \
            no - na + sa.dim == no - nb + sb.dim and sa.outer == sb.outer:
        return sa.at(no - na + sa.dim)  # the same batch dim
    if sb is None and pb == R and sa is not None and sa.dim != na - 1:
        return sa.at(no - na + sa.dim)  # a batch or row dim of a
    if sa is None and pa == R and sb is not None and sb.dim == nb - 1:
        return sb.at(no - 1)  # a column dim of b
    return s.gather_all(node, f"a matmul of {pa} and {pb}")


@COMMON.register(aten.addmm.default)
def addmm_rule(s, node: Node):
    """addmm(bias, x, W) = x @ W + bias (GPT-2's Conv1D form)."""
    bias, x, weight = node.args[:3]
    pa, pw = s.of(x), s.of(weight)
    sx, sw = _shard_of(s, x), _shard_of(s, weight)
    if sx is not None and sx.dim == 0 and pw == R and s.of(bias) == R:
        return sx
    if pa == R and sw is not None and sw.dim == 1:
        s.need(node, bias, Shard(s.ndim(bias) - 1))
        return Shard(1)
    if sx is not None and sx.dim == 1 and sw is not None and sw.dim == 0:
        node.target, node.args = aten.mm.default, (x, weight)
        added = s.insert(node.next, aten.add.Tensor, (node, bias), placement=None)
        node.replace_all_uses_with(added, delete_user_cb=lambda u: u is not added)
        return P
    return s.gather_all(node, f"an addmm of {pa} and {pw}")


ATTENTION = aten.scaled_dot_product_attention.default


@COMMON.register(ATTENTION)
def head_attention_rule(s, node: Node):
    """q, k, v [b, h, s, d] sharded on the heads (and a mask broadcast over them, or one
    sharded alike): attention is per head."""
    q, k, v = node.args[:3]
    mask = schema_arg(node, "attn_mask")
    shards = [_shard_of(s, t) for t in (q, k, v)]
    if not all(sh is not None and sh.dim == s.ndim(t) - 3 and sh.outer == 1
               for sh, t in zip(shards, (q, k, v), strict=True)):
        return s.gather_all(node, f"attention with q, k, v {[str(x) for x in shards]}")
    if isinstance(mask, Node) and s.of(mask) != R:
        return s.gather_all(node, "a sharded attention mask")
    if isinstance(mask, Node) and s.ndim(mask) >= 3 and s.full(mask)[-3] != 1:
        s.need(node, mask, Shard(s.ndim(mask) - 3))
    return shards[0]


@COMMON.register(aten.embedding.default)
def embedding_rule(s, node: Node):
    weight, indices = node.args[:2]
    shard = _shard_of(s, indices)
    if s.of(weight) != R or shard is None:
        return s.gather_all(node, f"an embedding with table {s.of(weight)}")
    return shard


@COMMON.register(aten.cross_entropy_loss.default)
def row_cross_entropy_rule(s, node: Node):
    """Logits [N, C] and targets [N] sharded on the rows: per-row losses keep it; the sum
    is P; the mean is that sum over the count of targets kept (P too, reduced apart)."""
    logits, target = node.args[:2]
    shard = _shard_of(s, logits)
    if shard is None or shard.dim != 0 or s.of(target) != s.of(logits) or \
            schema_arg(node, "weight") is not None:
        return s.gather_all(node, f"a cross-entropy of logits {s.of(logits)}")
    reduction = schema_arg(node, "reduction", 1)
    if reduction == 0:
        return shard.at(0)
    args = list(node.args) + [None] * (4 - len(node.args))
    args[3] = 2  # sum
    node.args = tuple(args[:4]) + tuple(node.args[4:])
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
    if reduction == 2:
        return P
    ignore = schema_arg(node, "ignore_index", -100)
    after = node.next
    kept = s.insert(after, aten.ne.Scalar, (target, ignore), placement=shard.at(0))
    count = s.insert(after, aten.sum.default, (kept,), placement=P)
    mean = s.insert(after, aten.div.Tensor, (node, count), placement=None)
    node.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)
    return P


__all__ = ["COMMON", "REDUCTIONS", "SPLITS", "operator"]
