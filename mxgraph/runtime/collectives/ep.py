"""Expert-parallel all-to-all, as differentiable torch.library custom ops.

Rows (token, choice) sorted by global expert are sent to the rank that owns their
expert (rank r of the "ep" group owns experts [r*E/ep, (r+1)*E/ep)), run through the
local experts, and sent back. Dropless: the per-expert row counts are exchanged first,
and the rows move with `all_to_all_single` with variable splits.

| op            | forward                                          | backward              |
|---------------|--------------------------------------------------|-----------------------|
| `ep_counts`   | all-to-all of the per-expert counts [E] -> [ep, E/ep] (row s: rank s's) | none (integers) |
| `ep_dispatch` | rows sorted by global expert -> rows sorted by local expert (then source rank) | `ep_combine` |
| `ep_combine`  | the inverse: local-expert order -> back to the sender, in its original order | `ep_dispatch` |
| `ep_all_to_all` | equal splits (capacity-padded experts, below)      | `ep_all_to_all`       |
| `ep_all_gather` | every rank's rows stacked along dim 0 (all-experts form, below) | `ep_reduce_scatter` |
| `ep_reduce_scatter` | the sum over the group, this rank's block of rows | `ep_all_gather` |

`ep_all_to_all`: block s of the input [ep * m, ...] goes to rank s, block s of the output
came from rank s; static shapes, no counts (passes/moe/capacity.py).

`ep_all_gather` / `ep_reduce_scatter`: experts that run on every token (the all-experts
form, passes/sharding/ep_dense.py) read the group's tokens and scores, and their partial
sums (this rank's experts) come back summed over the group, each rank its own rows. Volume:
the all-gather's output, the reduce-scatter's input.

`ep_dispatch` and `ep_combine` are linear maps and each other's transpose (all-to-all
plus a permutation of row blocks; rows past the counted ones are zero on output and
ignored on input), so each one's backward is the other applied to the gradient. Both
take `out_rows`, the number of rows of their output: the received total for dispatch
(a data-dependent size: an unbacked SymInt when traced), the sender's row count for
combine. Volume (collectives.groups.KIND "all_to_all"): the size of the input.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mxgraph.runtime.collectives.groups import KIND, group_size, process_group


def _exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              group) -> torch.Tensor:
    out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def _blocks(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split `rows` into blocks of `sizes` and concatenate them in `order`."""
    blocks = rows.split(sizes)
    return torch.cat([blocks[i] for i in order]) if blocks else rows


def _padded(rows: torch.Tensor, out_rows: int) -> torch.Tensor:
    if rows.shape[0] > out_rows:
        raise RuntimeError(f"expert all-to-all: {rows.shape[0]} rows do not fit the "
                           f"{out_rows} rows of the output")
    out = rows.new_zeros(out_rows, *rows.shape[1:])
    out[:rows.shape[0]] = rows
    return out


@torch.library.custom_op("mxgraph::ep_counts", mutates_args=())
def ep_counts(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    group = process_group(group_name)
    ep = dist.get_world_size(group)
    out = counts.new_empty(ep, counts.shape[0] // ep)
    dist.all_to_all_single(out, counts.contiguous().view(ep, -1), group=group)
    return out


@ep_counts.register_fake
def _(counts, group_name):
    ep = group_size(group_name)
    return counts.new_empty(ep, counts.shape[0] // ep)


@torch.library.custom_op("mxgraph::ep_dispatch", mutates_args=())
def ep_dispatch(x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                out_rows: int, group_name: str) -> torch.Tensor:
    """`x` [N, ...]: its first sum(send_counts) rows sorted by global expert;
    `send_counts` [E]; `recv_counts` [ep, E/ep] (from `ep_counts`). Returns [out_rows, ...]:
    the received rows sorted by local expert, then by source rank; zeros after them."""
    ep, local = recv_counts.shape
    send_splits = send_counts.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = _exchange(x[:sum(send_splits)], send_splits, recv_splits, process_group(group_name))
    by_expert = [s * local + e for e in range(local) for s in range(ep)]
    return _padded(_blocks(received, recv_counts.flatten().tolist(), by_expert), out_rows)


@ep_dispatch.register_fake
def _(x, send_counts, recv_counts, out_rows, group_name):
    return x.new_empty(out_rows, *x.shape[1:])


@torch.library.custom_op("mxgraph::ep_combine", mutates_args=())
def ep_combine(y: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
               out_rows: int, group_name: str) -> torch.Tensor:
    """The transpose of `ep_dispatch` with the same counts: `y` [R, ...] in local-expert
    order goes back to its senders; returns [out_rows, ...] in the sender's order."""
    ep, local = recv_counts.shape
    send_splits = send_counts.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    by_source = [e * ep + s for s in range(ep) for e in range(local)]
    rows = _blocks(y[:sum(recv_splits)], recv_counts.t().flatten().tolist(), by_source)
    return _padded(_exchange(rows, recv_splits, send_splits, process_group(group_name)), out_rows)


@ep_combine.register_fake
def _(y, send_counts, recv_counts, out_rows, group_name):
    return y.new_empty(out_rows, *y.shape[1:])


def _keep_counts(ctx, inputs, output):
    rows, send_counts, recv_counts, _, group_name = inputs
    ctx.save_for_backward(send_counts, recv_counts)
    ctx.rows, ctx.group_name = rows.shape[0], group_name


def _backward_combine(ctx, grad):
    send_counts, recv_counts = ctx.saved_tensors
    return (ep_combine(grad, send_counts, recv_counts, ctx.rows, ctx.group_name),
            None, None, None, None)


def _backward_dispatch(ctx, grad):
    send_counts, recv_counts = ctx.saved_tensors
    return (ep_dispatch(grad, send_counts, recv_counts, ctx.rows, ctx.group_name),
            None, None, None, None)


ep_dispatch.register_autograd(_backward_combine, setup_context=_keep_counts)
ep_combine.register_autograd(_backward_dispatch, setup_context=_keep_counts)



@torch.library.custom_op("mxgraph::ep_all_to_all", mutates_args=())
def ep_all_to_all(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """`x` [ep * m, ...]: block s (rows [s*m, (s+1)*m)) goes to rank s of the group; the
    output's block s is what rank s sent here. Its own transpose, so its own backward."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=process_group(group_name))
    return out


@ep_all_to_all.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _keep_group(ctx, inputs, output):
    ctx.group_name = inputs[1]


ep_all_to_all.register_autograd(lambda ctx, grad: (ep_all_to_all(grad, ctx.group_name), None),
                                setup_context=_keep_group)

KIND.update({"ep_counts": "all_to_all", "ep_dispatch": "all_to_all",
             "ep_combine": "all_to_all", "ep_all_to_all": "all_to_all"})


@torch.library.custom_op("mxgraph::ep_all_gather", mutates_args=())
def ep_all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """`x` [m, ...] of every rank of the group stacked along dim 0 in rank order: [ep * m,
    ...] (the group's tokens, for experts that run on every token). Backward:
    `ep_reduce_scatter` (each rank's rows get the sum of every rank's gradient for them)."""
    out = x.new_empty(group_size(group_name) * x.shape[0], *x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=process_group(group_name))
    return out


@ep_all_gather.register_fake
def _(x, group_name):
    return x.new_empty(group_size(group_name) * x.shape[0], *x.shape[1:])


@torch.library.custom_op("mxgraph::ep_reduce_scatter", mutates_args=())
def ep_reduce_scatter(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """`x` [ep * m, ...], a partial sum on every rank of the group: the sum's rows
    [r*m, (r+1)*m) on rank r. Backward: `ep_all_gather`."""
    out = x.new_empty(x.shape[0] // group_size(group_name), *x.shape[1:])
    dist.reduce_scatter_single(out, x.contiguous(), group=process_group(group_name))
    return out


@ep_reduce_scatter.register_fake
def _(x, group_name):
    return x.new_empty(x.shape[0] // group_size(group_name), *x.shape[1:])


ep_all_gather.register_autograd(lambda ctx, grad: (ep_reduce_scatter(grad, ctx.group_name), None),
                                setup_context=_keep_group)
ep_reduce_scatter.register_autograd(lambda ctx, grad: (ep_all_gather(grad, ctx.group_name), None),
                                    setup_context=_keep_group)
KIND.update({"ep_all_gather": "all_gather", "ep_reduce_scatter": "reduce_scatter"})
