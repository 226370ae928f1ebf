"""The dropless expert all-to-alls as a start, a wait and layout ops, for
`passes/overlap/async_collectives.py` (with `Plan.moe.a2a_overlap`).

`ep_dispatch` and `ep_combine` (`runtime/collectives/ep.py`) are an all-to-all with
variable splits plus a permutation of row blocks and zero padding. Lowered, they become

    ep_dispatch(x, send, recv, R)  ->  ep_rows_by_expert(wait_tensor(ep_rows_start(
                                           x, send_splits, recv_splits, R)), recv)
    ep_combine(y, send, recv, N)   ->  wait_tensor(ep_rows_start(
                                           ep_rows_by_source(y, recv), recv_splits, send_splits, N))

with `send_splits = send.view(ep, E/ep).sum(1)` and `recv_splits = recv.sum(1)` (rows to and
from each rank, computed in the graph).

| op                  | what                                                             |
|---------------------|------------------------------------------------------------------|
| `ep_rows_start`     | sends block s of the first sum(send_splits) rows to rank s and   |
|                     | returns at once a fresh [out_rows, ...] tensor: the received     |
|                     | rows (rank 0's first) once `_c10d_functional.wait_tensor` has    |
|                     | waited for it, then zeros                                        |
| `ep_rows_by_expert` | the first sum(counts) rows from (source rank, local expert)      |
|                     | blocks to (local expert, source rank) blocks; the rest as given  |
| `ep_rows_by_source` | the inverse: (local expert, source rank) to (source rank, local  |
|                     | expert) blocks; the rest as given                                |

Why a custom start op and not torch's `_c10d_functional.all_to_all_single` with the split
sizes as SymInts: the splits are data, so each would be an `item()` node with a fresh
unbacked symbol in the joint graph's shape env, and the output's row count their sum, a
size the graph's `out_rows` symbol is not known to equal: the padding to it, the block
permutation (ep * E/ep more symbols per layout op) and every later pass reading the fake values
would need those relations asserted by hand. The start op reads the split sizes with
`.tolist()` inside, as the synchronous ops do, keeps the output's shape `out_rows` (a size
the graph already has), posts `dist.all_to_all_single(..., async_op=True)` and registers
its `Work` for the output with `torch._C._distributed_c10d._register_work`, so that
torch's own `wait_tensor` (which finds works by the tensor's storage) waits for it: the
wait stays the one op every overlap pass and the codegen know.

Numerics: the same backend call (`all_to_all_single` on the same rows with the same
splits) and the same block copies as the synchronous ops: bitwise equal. The joint graphs
these ops enter are already differentiated, so none has a backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mxgraph.runtime.collectives.groups import KIND, process_group

register_work = torch._C._distributed_c10d._register_work


@torch.library.custom_op("mxgraph::ep_rows_start", mutates_args=())
def ep_rows_start(rows: torch.Tensor, send_splits: torch.Tensor, recv_splits: torch.Tensor,
                  out_rows: int, group_name: str) -> torch.Tensor:
    """`rows` [N, ...]: block s of its first sum(send_splits) rows goes to rank s;
    `send_splits`, `recv_splits` [ep] (int). Returns [out_rows, ...] at once: its first
    sum(recv_splits) rows are written by the transfer (wait for it with wait_tensor), the
    rest are zero."""
    send, recv = send_splits.tolist(), recv_splits.tolist()
    received = sum(recv)
    if received > out_rows:
        raise RuntimeError(f"expert all-to-all: {received} rows do not fit the {out_rows} "
                           "rows of the output")
    out = rows.new_empty(out_rows, *rows.shape[1:])
    out[received:].zero_()
    work = dist.all_to_all_single(out[:received], rows[:sum(send)].contiguous(), recv, send,
                                  group=process_group(group_name), async_op=True)
    register_work(out, work)
    return out


@ep_rows_start.register_fake
def _(rows, send_splits, recv_splits, out_rows, group_name):
    return rows.new_empty(out_rows, *rows.shape[1:])


def _reordered(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """The first sum(sizes) rows cut in blocks of `sizes` and joined in `order`, then the
    remaining rows unchanged (one copy)."""
    blocks = rows.split([*sizes, rows.shape[0] - sum(sizes)])
    return torch.cat([blocks[i] for i in order] + [blocks[-1]])


@torch.library.custom_op("mxgraph::ep_rows_by_expert", mutates_args=())
def ep_rows_by_expert(rows: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """`recv_counts` [ep, E/ep]: row s, rank s's rows per local expert (`ep_counts`)."""
    ep, local = recv_counts.shape
    order = [s * local + e for e in range(local) for s in range(ep)]
    return _reordered(rows, recv_counts.flatten().tolist(), order)


@torch.library.custom_op("mxgraph::ep_rows_by_source", mutates_args=())
def ep_rows_by_source(rows: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    ep, local = recv_counts.shape
    order = [e * ep + s for s in range(ep) for e in range(local)]
    return _reordered(rows, recv_counts.t().flatten().tolist(), order)


for _op in (ep_rows_by_expert, ep_rows_by_source):
    _op.register_fake(lambda rows, recv_counts: torch.empty_like(
        rows, memory_format=torch.contiguous_format))

KIND.update({"ep_rows_start": "all_to_all"})
