"""TP overlap: split each sequence-parallel all-gather -> linear and linear ->
reduce-scatter into `Plan.overlap.tp_chunks` chunked steps, so that the transfer of one
chunk overlaps the GEMM of another (TransformerEngine's split pipelined GEMM, as graph
rewriting; the reorder pass then starts every chunk's collective early and waits for each
at its own GEMM).

  all-gather:      y = linear(AG(x, d))          x: [.., m, ..] local rows along d
                   -> y_i = linear(AG(x[.., i*m/k:(i+1)*m/k, ..], d)) for i < k, and
                   y = the y_i's rows put back in rank-major order (rank r, chunk i)
  reduce-scatter:  z = RS(linear(a), d)           a: [.., tp*m, ..] rows of every rank
                   -> z_i = RS(linear(a's chunk i of every rank's block), d), z = cat(z_i)

Every consumer of the gathered value must be a `linear` over its last dim (the Q/K/V or
gate/up projections); a reduce-scatter must read a `linear` of nothing else. Other forms
stay whole and are listed in the pass's findings. The chunked collectives are the same
differentiable ops (their backward is chunked too); the reassembly is aten views and a
stack. Numerics: the GEMMs run on row blocks, so results agree within fp32 rounding
(tests/parallel/test_overlap.py states the bound), not bitwise.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import insert_call
from mxgraph.runtime.collectives.groups import group_size

aten, mx = torch.ops.aten, torch.ops.mxgraph


def overlap_tp_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Chunk the SP all-gather -> linear and linear -> reduce-scatter pairs (module
    docstring). Runs only with `Plan.overlap.tp_chunks > 1`. PlanError when the chunk count
    does not divide a rank's rows. Numerics: within fp32 rounding."""
    options = ctx.plan.overlap
    if options is None or options.tp_chunks <= 1:
        return gm
    chunks = options.tp_chunks
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is mx.sp_all_gather.default:
            _split_gather(gm, node, chunks, ctx)
        elif node.target is mx.sp_reduce_scatter.default:
            _split_scatter(gm, node, chunks, ctx)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _is_linear_of(node: Node, value: Node) -> bool:
    return node.op == "call_function" and node.target is aten.linear.default and \
        node.args[0] is value and not node.kwargs


def _rows(node: Node, dim: int, chunks: int, what: str) -> int:
    size = node.meta["val"].shape[dim]
    if not isinstance(size, int) or size % chunks:
        raise PlanError(f"overlap.tp_chunks={chunks} does not divide the {size} rows per rank "
                        f"of a sequence-parallel {what} (batch x sequence / tp along dim "
                        f"{dim}); choose a tp_chunks that divides the local sequence length")
    return size // chunks


def _split_gather(gm: GraphModule, gather: Node, chunks: int, ctx) -> None:
    x, dim, group = gather.args
    users = list(gather.users)
    if dim == x.meta["val"].dim() - 1 or not users or \
            not all(_is_linear_of(u, gather) for u in users):
        ctx.findings.append(f"overlap_tp: {gather.name} (all-gather) kept whole: its consumers "
                            f"are not all linear layers ({[str(u.target) for u in users]})")
        return
    graph, tp = gm.graph, group_size(group)
    step = _rows(x, dim, chunks, "all-gather")
    gathered = []
    for i in range(chunks):
        piece = insert_call(graph, aten.slice.Tensor, (x, dim, i * step, (i + 1) * step),
                            before=gather, like=gather)
        gathered.append(insert_call(graph, mx.sp_all_gather.default, (piece, dim, group),
                                    before=gather, like=gather))
    for user in users:
        parts = [insert_call(graph, aten.linear.default, (g, *user.args[1:]), before=user,
                             like=user) for g in gathered]
        user.replace_all_uses_with(_rank_major(graph, parts, dim, tp, user))
        graph.erase_node(user)


def _rank_major(graph, parts: list[Node], dim: int, tp: int, like: Node) -> Node:
    """The chunks' outputs (each [.., tp * rows, ..]: rank r's rows of chunk i) as one
    tensor in rank-major order (rank r: chunk 0, chunk 1, ...)."""
    k = len(parts)
    shape = list(parts[0].meta["val"].shape)
    rows = shape[dim] // tp
    stacked = insert_call(graph, aten.stack.default, (parts, dim), before=like, like=like)
    split = insert_call(graph, aten.view.default,
                        (stacked, shape[:dim] + [k, tp, rows] + shape[dim + 1:]),
                        before=like, like=like)
    ranks_first = insert_call(graph, aten.transpose.int, (split, dim, dim + 1), before=like,
                              like=like)
    return insert_call(graph, aten.reshape.default,
                       (ranks_first, shape[:dim] + [tp * k * rows] + shape[dim + 1:]),
                       before=like, like=like)


def _split_scatter(gm: GraphModule, scatter: Node, chunks: int, ctx) -> None:
    y, dim, group = scatter.args
    if not (y.op == "call_function" and y.target is aten.linear.default and not y.kwargs
            and len(y.users) == 1 and dim != y.meta["val"].dim() - 1):
        ctx.findings.append(f"overlap_tp: {scatter.name} (reduce-scatter) kept whole: it does "
                            f"not read a linear layer of its own ({y.target})")
        return
    graph, tp = gm.graph, group_size(group)
    a = y.args[0]
    step = _rows(scatter, dim, chunks, "reduce-scatter")
    shape = list(a.meta["val"].shape)
    blocks = insert_call(graph, aten.reshape.default,
                         (a, shape[:dim] + [tp, chunks, step] + shape[dim + 1:]),
                         before=scatter, like=y)
    outs = []
    for i in range(chunks):
        rows = insert_call(graph, aten.select.int, (blocks, dim + 1, i), before=scatter, like=y)
        rows = insert_call(graph, aten.reshape.default,
                           (rows, shape[:dim] + [tp * step] + shape[dim + 1:]),
                           before=scatter, like=y)
        part = insert_call(graph, aten.linear.default, (rows, *y.args[1:]), before=scatter,
                           like=y)
        outs.append(insert_call(graph, mx.sp_reduce_scatter.default, (part, dim, group),
                                before=scatter, like=scatter))
    whole = insert_call(graph, aten.cat.default, (outs, dim), before=scatter, like=scatter)
    scatter.replace_all_uses_with(whole)
    graph.erase_node(scatter)
