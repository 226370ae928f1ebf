"""Asynchronous collectives: each collective the sharding passes inserted becomes a start
and a wait (torch's functional collectives, `_c10d_functional.*` + `wait_tensor`), so that
`overlap/reorder.py` can start it early and wait for it late.

| mxgraph op                            | becomes                                           |
|---------------------------------------|---------------------------------------------------|
| `tp_all_reduce`, `cp_all_reduce`      | `all_reduce(x, "sum")`                            |
| `tp_all_gather`, `sp_all_gather`      | `all_gather_into_tensor`, then `rows_to_dim` when |
|                                       | the gathered dim is not 0                         |
| `cp_all_gather`                       | `all_gather_into_tensor`, then `cp_rows_to_dim`   |
| `sp_reduce_scatter`                   | `dim_to_rows` when the dim is not 0, then         |
|                                       | `reduce_scatter_tensor(x, "sum")`                 |
| `cp_reduce_scatter`                   | `cp_dim_to_rows`, then `reduce_scatter_tensor`    |
| `ep_all_to_all` (`moe.a2a_overlap`)   | `all_to_all_single(x, [m] * ep, [m] * ep)`,       |
|                                       | m = rows / ep                                     |
| `ep_dispatch` (`moe.a2a_overlap`)     | `ep_rows_start`, then `ep_rows_by_expert`         |
| `ep_combine` (`moe.a2a_overlap`)      | `ep_rows_by_source`, then `ep_rows_start`         |

The layout ops are `runtime/collectives/async_layout.py`'s; the dropless expert all-to-alls'
start and layout ops `runtime/collectives/ep_async.py`'s (why a start op of our own, whose
work torch's `wait_tensor` waits for, and not `all_to_all_single` with data-dependent
split sizes: that module's docstring). Not lowered, and so still synchronous: the expert
all-to-alls without `Plan.moe.a2a_overlap`, the expert count exchange (`ep_counts`: a few
integers the dispatch needs at once), the vocabulary-parallel loss (its all-reduces are
inside one op) and ops that move no data. The lowered forms run the same backend calls on
the same buffers, so the values are bitwise those of the synchronous ops.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import mxgraph.runtime.collectives.async_layout  # noqa: F401 - registers the layout ops
import mxgraph.runtime.collectives.cp  # noqa: F401 - registers the CP ops
import mxgraph.runtime.collectives.ep  # registers the expert all-to-alls
import mxgraph.runtime.collectives.ep_async  # noqa: F401 - and their start and layout ops
from mxgraph.context import CompileContext
from mxgraph.ir import insert_call
from mxgraph.runtime.collectives.groups import group_size

mx = torch.ops.mxgraph
c10d = torch.ops._c10d_functional

ALL_REDUCE = {mx.tp_all_reduce.default, mx.cp_all_reduce.default}
ALL_GATHER = {mx.tp_all_gather.default: mx.rows_to_dim.default,
              mx.sp_all_gather.default: mx.rows_to_dim.default,
              mx.cp_all_gather.default: mx.cp_rows_to_dim.default}
REDUCE_SCATTER = {mx.sp_reduce_scatter.default: mx.dim_to_rows.default,
                  mx.cp_reduce_scatter.default: mx.cp_dim_to_rows.default}
CONTEXT_PARALLEL = {mx.cp_all_gather.default, mx.cp_reduce_scatter.default}
EXPERT = {mx.ep_all_to_all.default, mx.ep_dispatch.default, mx.ep_combine.default}
EXPERT_STARTS = frozenset({c10d.all_to_all_single.default, mx.ep_rows_start.default})
"""The starts of the lowered expert all-to-alls (`overlap/moe.py` fills their windows)."""
STARTS = frozenset({c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
                    c10d.reduce_scatter_tensor.default}) | EXPERT_STARTS
WAIT = c10d.wait_tensor.default


def overlap_async_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Lower each listed collective to layout op(s), a functional start and its wait.

    Precondition: a joint graph (differentiated: the functional collectives have no
    backward here). Runs only with `Plan.overlap.reorder`; the expert all-to-alls only
    with `Plan.moe.a2a_overlap` too. Guarantee: every lowered collective's wait directly
    follows its start (the reorder pass moves them). Numerics: bitwise equal.
    """
    if ctx.plan.overlap is None or not ctx.plan.overlap.reorder:
        return gm
    expert = getattr(ctx.plan.moe, "a2a_overlap", False)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ALL_REDUCE or node.target in ALL_GATHER or \
                node.target in REDUCE_SCATTER:
            _lower(gm, node)
        elif expert and node.target in EXPERT:
            _lower_expert(gm, node)
    gm.graph.lint()
    gm.recompile()
    return gm


_KEPT_META = ("partitioner_tag", "seq_nr", "stack_trace", "nn_module_stack")


def _adder(graph, node: Node):
    """add(op, *args, **kwargs): a new node before `node`, with its provenance and part."""
    def add(op, *args, **kwargs) -> Node:
        new = insert_call(graph, op, args, kwargs, before=node, like=node)
        new.meta.update({k: v for k, v in node.meta.items() if k in _KEPT_META})
        return new
    return add


def _contiguous(add, value: Node) -> Node:
    fake = value.meta.get("val")
    if isinstance(fake, torch.Tensor) and fake.is_contiguous():
        return value
    return add(torch.ops.aten.clone.default, value, memory_format=torch.contiguous_format)


def _lower(gm: GraphModule, node: Node) -> None:
    graph, target = gm.graph, node.target
    x, group = node.args[0], node.args[-1]
    n = group_size(group)
    add = _adder(graph, node)

    reorders = target in CONTEXT_PARALLEL or (target not in ALL_REDUCE and node.args[1] != 0)
    if target in ALL_REDUCE:
        out = add(WAIT, add(c10d.all_reduce.default, _contiguous(add, x), "sum", group))
    elif target in ALL_GATHER:
        out = add(WAIT, add(c10d.all_gather_into_tensor.default, _contiguous(add, x), n, group))
        if reorders:
            out = add(ALL_GATHER[target], out, node.args[1], n)
    else:
        rows = add(REDUCE_SCATTER[target], x, node.args[1], n) if reorders else x
        out = add(WAIT, add(c10d.reduce_scatter_tensor.default, _contiguous(add, rows), "sum", n,
                            group))
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _lower_expert(gm: GraphModule, node: Node) -> None:
    """An expert all-to-all (module docstring's table; runtime/collectives/ep_async.py)."""
    add = _adder(gm.graph, node)
    if node.target is mx.ep_all_to_all.default:
        x, group = node.args
        n = group_size(group)
        splits = [x.meta["val"].shape[0] // n] * n
        out = add(WAIT, add(c10d.all_to_all_single.default, _contiguous(add, x), splits, splits,
                            group))
    else:
        rows, send_counts, recv_counts, out_rows, group = node.args
        ep, local = recv_counts.meta["val"].shape
        per_rank = add(torch.ops.aten.view.default, send_counts, [ep, local])
        send_splits = add(torch.ops.aten.sum.dim_IntList, per_rank, [1])
        recv_splits = add(torch.ops.aten.sum.dim_IntList, recv_counts, [1])
        if node.target is mx.ep_dispatch.default:
            received = add(WAIT, add(mx.ep_rows_start.default, rows, send_splits, recv_splits,
                                     out_rows, group))
            out = add(mx.ep_rows_by_expert.default, received, recv_counts)
        else:  # ep_combine: the rows go back, so the splits swap
            by_source = add(mx.ep_rows_by_source.default, rows, recv_counts)
            out = add(WAIT, add(mx.ep_rows_start.default, by_source, recv_splits, send_splits,
                                out_rows, group))
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
