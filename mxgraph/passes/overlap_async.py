"""Asynchronous collectives: each collective the sharding passes inserted becomes a start
and a wait (torch's functional collectives, `_c10d_functional.*` + `wait_tensor`), so that
`overlap_reorder.py` can start it early and wait for it late.

| mxgraph op                            | becomes                                           |
|---------------------------------------|---------------------------------------------------|
| `tp_all_reduce`, `cp_all_reduce`      | `all_reduce(x, "sum")`                            |
| `tp_all_gather`, `sp_all_gather`      | `all_gather_into_tensor`, then `rows_to_dim` when |
|                                       | the gathered dim is not 0                         |
| `cp_all_gather`                       | `all_gather_into_tensor`, then `cp_rows_to_dim`   |
| `sp_reduce_scatter`                   | `dim_to_rows` when the dim is not 0, then         |
|                                       | `reduce_scatter_tensor(x, "sum")`                 |
| `cp_reduce_scatter`                   | `cp_dim_to_rows`, then `reduce_scatter_tensor`    |

The layout ops are `runtime/collectives_async.py`'s. Not lowered, and so still synchronous:
the expert all-to-alls (their split sizes are data: `runtime/collectives_ep.py`), the
vocabulary-parallel loss (its all-reduces are inside one op) and ops that move no data.
The functional collectives run the same backend calls on the same buffers, so the values
are bitwise those of the synchronous ops.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext
from mxgraph.ir import insert_call
from mxgraph.runtime import collectives_async, collectives_cp  # noqa: F401 - registers ops
from mxgraph.runtime.collectives import group_size

mx = torch.ops.mxgraph
c10d = torch.ops._c10d_functional

ALL_REDUCE = {mx.tp_all_reduce.default, mx.cp_all_reduce.default}
ALL_GATHER = {mx.tp_all_gather.default: mx.rows_to_dim.default,
              mx.sp_all_gather.default: mx.rows_to_dim.default,
              mx.cp_all_gather.default: mx.cp_rows_to_dim.default}
REDUCE_SCATTER = {mx.sp_reduce_scatter.default: mx.dim_to_rows.default,
                  mx.cp_reduce_scatter.default: mx.cp_dim_to_rows.default}
CONTEXT_PARALLEL = {mx.cp_all_gather.default, mx.cp_reduce_scatter.default}
STARTS = frozenset({c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
                    c10d.reduce_scatter_tensor.default})
WAIT = c10d.wait_tensor.default


def overlap_async_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Lower each listed collective to layout op(s), a functional start and its wait.

    Precondition: a joint graph (differentiated: the functional collectives have no
    backward here). Runs only with `Plan.overlap.reorder`. Guarantee: every lowered
    collective's wait directly follows its start (the reorder pass moves them).
    Numerics: bitwise equal.
    """
    if ctx.plan.overlap is None or not ctx.plan.overlap.reorder:
        return gm
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (node.target in ALL_REDUCE or
                                           node.target in ALL_GATHER or
                                           node.target in REDUCE_SCATTER):
            _lower(gm, node)
    gm.graph.lint()
    gm.recompile()
    return gm


_KEPT_META = ("partitioner_tag", "seq_nr", "stack_trace", "nn_module_stack")


def _lower(gm: GraphModule, node: Node) -> None:
    graph, target = gm.graph, node.target
    x, group = node.args[0], node.args[-1]
    n = group_size(group)

    def add(op, *args, **kwargs) -> Node:
        new = insert_call(graph, op, args, kwargs, before=node, like=node)
        new.meta.update({k: v for k, v in node.meta.items() if k in _KEPT_META})
        return new

    def contiguous(value: Node) -> Node:
        fake = value.meta.get("val")
        if isinstance(fake, torch.Tensor) and fake.is_contiguous():
            return value
        return add(torch.ops.aten.clone.default, value, memory_format=torch.contiguous_format)

    reorders = target in CONTEXT_PARALLEL or (target not in ALL_REDUCE and node.args[1] != 0)
    if target in ALL_REDUCE:
        out = add(WAIT, add(c10d.all_reduce.default, contiguous(x), "sum", group))
    elif target in ALL_GATHER:
        out = add(WAIT, add(c10d.all_gather_into_tensor.default, contiguous(x), n, group))
        if reorders:
            out = add(ALL_GATHER[target], out, node.args[1], n)
    else:
        rows = add(REDUCE_SCATTER[target], x, node.args[1], n) if reorders else x
        out = add(WAIT, add(c10d.reduce_scatter_tensor.default, contiguous(rows), "sum", n,
                            group))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
