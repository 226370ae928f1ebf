"""Differentiable collectives of context parallelism, as torch.library custom ops.

The sequence is cut into 2*cp chunks and rank r of the CP group holds chunks r and
2*cp-1-r ("head-tail"), so every rank gets the same share of causal-attention work.

Gradient convention (see `passes/sharding/cp.py`): a value replicated over the CP group
carries a *partial* gradient on each rank (the ranks' gradients sum to the true one);
a sequence shard carries its own full gradient.

| op                  | forward                                  | backward                 |
|---------------------|------------------------------------------|--------------------------|
| `cp_chunk`          | this rank's head-tail chunks along `dim` | zero-padded (`cp_unchunk`)|
| `cp_all_gather`     | all-gather, chunks back in natural order | `cp_reduce_scatter`      |
| `cp_all_reduce`     | sum over the group                       | all-reduce (`cp_all_reduce`) |
| `cp_replicated`     | identity (a replicated output)           | gradient / cp            |
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mxgraph.runtime.collectives.groups import KIND, group_size, process_group
from mxgraph.runtime.collectives.tp import all_reduced, contiguous_copy, gathered_shape, same_shape, scattered_shape


def _rank(group_name: str) -> int:
    return dist.get_rank(process_group(group_name))


def _pieces(x: torch.Tensor, dim: int, cp: int) -> list[torch.Tensor]:
    return list(x.chunk(2 * cp, dim))


@torch.library.custom_op("mxgraph::cp_chunk", mutates_args=())
def cp_chunk(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    cp, r = group_size(group_name), _rank(group_name)
    pieces = _pieces(x, dim, cp)
    return torch.cat([pieces[r], pieces[2 * cp - 1 - r]], dim)


@torch.library.custom_op("mxgraph::cp_unchunk", mutates_args=())
def cp_unchunk(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """This rank's head-tail chunks placed in a zero tensor of the full length."""
    cp, r = group_size(group_name), _rank(group_name)
    full = gathered_shape(x, dim, group_name).zero_()
    pieces, mine = _pieces(full, dim, cp), x.chunk(2, dim)
    pieces[r].copy_(mine[0])
    pieces[2 * cp - 1 - r].copy_(mine[1])
    return full


@torch.library.custom_op("mxgraph::cp_all_gather", mutates_args=())
def cp_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    cp = group_size(group_name)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=process_group(group_name))
    halves = [p.chunk(2, dim) for p in parts]
    order = [halves[i][0] for i in range(cp)] + [halves[cp - 1 - i][1] for i in range(cp)]
    return torch.cat(order, dim)


@torch.library.custom_op("mxgraph::cp_reduce_scatter", mutates_args=())
def cp_reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Sum over the group, then keep this rank's head-tail chunks."""
    cp = group_size(group_name)
    pieces = _pieces(x, dim, cp)
    per_rank = [torch.cat([pieces[r], pieces[2 * cp - 1 - r]], dim).contiguous()
                for r in range(cp)]
    out = torch.empty_like(per_rank[0])
    dist.reduce_scatter(out, per_rank, group=process_group(group_name))
    return out


@torch.library.custom_op("mxgraph::cp_all_reduce", mutates_args=())
def cp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return all_reduced(x, group_name)


@torch.library.custom_op("mxgraph::cp_replicated", mutates_args=())
def cp_replicated(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return contiguous_copy(x, group_name)


for _op, _fake in ((cp_chunk, scattered_shape), (cp_reduce_scatter, scattered_shape),
                   (cp_unchunk, gathered_shape), (cp_all_gather, gathered_shape),
                   (cp_all_reduce, same_shape), (cp_replicated, same_shape)):
    _op.register_fake(_fake)


def _keep(ctx, inputs, output):
    ctx.group_name = inputs[-1]
    ctx.dim = inputs[1] if len(inputs) == 3 else None


cp_chunk.register_autograd(
    lambda ctx, g: (cp_unchunk(g, ctx.dim, ctx.group_name), None, None), setup_context=_keep)
cp_all_gather.register_autograd(
    lambda ctx, g: (cp_reduce_scatter(g, ctx.dim, ctx.group_name), None, None),
    setup_context=_keep)
cp_all_reduce.register_autograd(
    lambda ctx, g: (cp_all_reduce(g, ctx.group_name), None), setup_context=_keep)
cp_replicated.register_autograd(
    lambda ctx, g: (g / group_size(ctx.group_name), None), setup_context=_keep)

KIND.update(cp_chunk=None, cp_unchunk=None, cp_all_gather="all_gather",
            cp_reduce_scatter="reduce_scatter", cp_all_reduce="all_reduce", cp_replicated=None)
