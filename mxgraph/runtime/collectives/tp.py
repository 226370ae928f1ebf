"""Differentiable collectives for sharded graphs, as torch.library custom ops.

Each op names its process group by `group_name` (`ProcessGroup.group_name`) and has a
registered backward, so AOTAutograd derives the conjugate collective (Megatron's f/g):

| op                  | forward                         | backward                   |
|---------------------|---------------------------------|----------------------------|
| `tp_copy`           | identity (a replicated input)   | all-reduce (sum)           |
| `tp_all_reduce`     | all-reduce (sum) of partials    | identity                   |
| `tp_all_gather`     | all-gather along `dim`          | this rank's slice          |
| `tp_slice`          | this rank's slice along `dim`   | all-gather                 |
| `sp_all_gather`     | all-gather along `dim`          | reduce-scatter along `dim` |
| `sp_reduce_scatter` | reduce-scatter along `dim`      | all-gather along `dim`     |

The kinds, volumes and groups every collective op declares itself in: `groups.py`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mxgraph.runtime.collectives.groups import group_size, process_group


def all_reduced(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """A contiguous copy of `x` summed over the group (the body of every all-reduce op)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=process_group(group_name))
    return out


def contiguous_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The forward of ops that only mark a value for their backward (`tp_copy`, ...)."""
    return x.contiguous().clone()


def same_shape(x, *_):
    """Fake of an op whose output is a contiguous tensor like `x`."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def gathered_shape(x, dim, group_name):
    """Fake of an op whose output is `x` grown group-size times along `dim`."""
    shape = list(x.shape)
    shape[dim] *= group_size(group_name)
    return x.new_empty(shape)


def scattered_shape(x, dim, group_name):
    """Fake of an op whose output is this rank's 1/group-size of `x` along `dim`."""
    shape = list(x.shape)
    shape[dim] //= group_size(group_name)
    return x.new_empty(shape)


@torch.library.custom_op("mxgraph::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return all_reduced(x, group_name)


@torch.library.custom_op("mxgraph::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return contiguous_copy(x, group_name)


@torch.library.custom_op("mxgraph::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    group = process_group(group_name)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
             for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


@torch.library.custom_op("mxgraph::tp_slice", mutates_args=())
def tp_slice(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    group = process_group(group_name)
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].clone(
        memory_format=torch.contiguous_format)


@torch.library.custom_op("mxgraph::sp_all_gather", mutates_args=())
def sp_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return tp_all_gather(x, dim, group_name)


@torch.library.custom_op("mxgraph::sp_reduce_scatter", mutates_args=())
def sp_reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    group = process_group(group_name)
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


for _op, _fake in ((tp_all_reduce, same_shape), (tp_copy, same_shape),
                   (tp_all_gather, gathered_shape), (sp_all_gather, gathered_shape),
                   (tp_slice, scattered_shape), (sp_reduce_scatter, scattered_shape)):
    _op.register_fake(_fake)


def _backward_all_reduce(ctx, grad):
    return tp_all_reduce(grad, ctx.group_name), None


def _backward_identity(ctx, grad):
    return grad, None


def _backward_slice(ctx, grad):
    return tp_slice(grad, ctx.dim, ctx.group_name), None, None


def _backward_gather(ctx, grad):
    return tp_all_gather(grad, ctx.dim, ctx.group_name), None, None


def _backward_reduce_scatter(ctx, grad):
    return sp_reduce_scatter(grad, ctx.dim, ctx.group_name), None, None


def _keep_group(ctx, inputs, output):
    ctx.group_name = inputs[-1]
    if len(inputs) == 3:
        ctx.dim = inputs[1]


tp_copy.register_autograd(_backward_all_reduce, setup_context=_keep_group)
tp_all_reduce.register_autograd(_backward_identity, setup_context=_keep_group)
tp_all_gather.register_autograd(_backward_slice, setup_context=_keep_group)
tp_slice.register_autograd(_backward_gather, setup_context=_keep_group)
sp_all_gather.register_autograd(_backward_reduce_scatter, setup_context=_keep_group)
sp_reduce_scatter.register_autograd(_backward_gather, setup_context=_keep_group)
