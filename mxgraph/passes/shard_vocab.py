"""Vocabulary-parallel rules of the TP sharding pass (`shard_tp.py`): the embedding and
the cross-entropy, as in Megatron-LM.

- An embedding lookup of token ids (indices read from an input of the step) whose table
  is otherwise read only as linear weights (a tied LM head) gets its table sharded by
  vocabulary rows: each rank looks up the ids in its range, zeroes the others, and the
  partial rows are summed by an all-reduce — or, with sequence parallelism, by a
  reduce-scatter along the sequence, which starts the sequence-parallel region.
  Lookups of other indices (learned positions from `arange`) stay replicated.
- A cross-entropy over logits sharded along the class dim (the column-parallel LM head)
  becomes `mxgraph::vocab_parallel_ce`, which never gathers the logits.

Numerics: equal to the unsharded graph up to summation order.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

import mxgraph.runtime.collectives_cp  # noqa: F401 - registers cp_chunk
import mxgraph.runtime.vocab_parallel  # noqa: F401 - registers the op
from mxgraph.ir import COPY_LIKE_OPS, VIEW_OPS, insert_call

aten = torch.ops.aten
mx = torch.ops.mxgraph
R = None  # replicated (the placement convention of shard_tp.py)
PASS_THROUGH = VIEW_OPS | COPY_LIKE_OPS | {mx.cp_chunk.default}
"""Ops through which a value still is the step's input (token ids) for `reads_input`."""


def reads_input(value: Node) -> bool:
    """Whether `value` is an input of the step, seen through views and copies."""
    while value.op == "call_function" and value.target in PASS_THROUGH:
        value = value.args[0]
    return value.op == "placeholder" and value.meta.get("mx_slot_kind") == "input"


def embedding(sharder, node: Node):
    weight, indices = node.args[:2]
    extra = tuple(node.args[2:]) + tuple(node.kwargs.values())
    if sharder.place.get(indices, R) is not R:
        sharder.gather_all(node)
        return R
    if (any(a not in (-1, False) for a in extra) or not reads_input(indices)
            or not sharder.shard_param(weight, 0, node)):
        return R
    rows = weight.meta["val"].shape[0] // sharder.tp
    start = sharder.rank * rows
    local = sharder.insert(node, aten.sub.Tensor, (indices, start))
    valid = sharder.insert(node, aten.logical_and.default, (
        sharder.insert(node, aten.ge.Scalar, (local, 0)),
        sharder.insert(node, aten.lt.Scalar, (local, rows))))
    node.args = (weight, sharder.insert(node, aten.mul.Tensor, (local, valid)))
    mask = insert_call(sharder.graph, aten.unsqueeze.default, (valid, -1), after=node, like=node,
                       val=None)
    masked = insert_call(sharder.graph, aten.mul.Tensor, (node, mask), after=mask, like=node,
                         val=node.meta["val"])
    node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
    seq = sharder.seq_dim(node)
    if seq is not None:
        sharder.reduce_after(masked, mx.sp_reduce_scatter.default, (seq,), seq)
    else:
        sharder.reduce_after(masked, mx.tp_all_reduce.default, (), R)
    return R  # the lookup itself is partial; only the reduced value is read


def cross_entropy(sharder, node: Node):
    """aten.cross_entropy_loss(logits [N, C], target [N], weight, reduction, ignore_index,
    label_smoothing) with logits sharded on C -> vocab_parallel_ce + the reduction."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    options = dict(zip(names, (None, 1, -100, 0.0)))
    options.update(zip(names, node.args[2:]))
    options.update(node.kwargs)
    logits, target = node.args[:2]
    if (sharder.place.get(logits, R) != 1 or logits.meta["val"].dim() != 2
            or sharder.place.get(target, R) is not R or options["weight"] is not None
            or options["label_smoothing"] != 0.0):
        sharder.gather_all(node)
        return R
    ignore = options["ignore_index"]
    both = sharder.insert(node, mx.vocab_parallel_ce.default,
                          (logits, target, ignore, sharder.group))
    loss = sharder.insert(node, operator.getitem, (both, 0))
    if options["reduction"] == 0:
        result = loss
    else:
        result = sharder.insert(node, aten.sum.default, (loss,))
        if options["reduction"] == 1:
            counted = sharder.insert(node, aten.ne.Scalar, (target, ignore))
            result = sharder.insert(node, aten.div.Tensor, (
                result, sharder.insert(node, aten.sum.default, (counted,))))
    node.replace_all_uses_with(result)
    sharder.graph.erase_node(node)
    for value in (both, loss, result):
        sharder.place[value] = R
    return R

