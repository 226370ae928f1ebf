"""Gradient clipping by the norm of the whole model's gradient, on every parallel layout.

`clip_grad_norm_(step, max_norm)` is `torch.nn.utils.clip_grad_norm_` for the gradients a
compiled step left on this rank: each rank holds a part of the gradient, some parts on several
ranks. Every rank sums the squares of what it holds, each tensor divided by the number of ranks
holding the same values, and one all-reduce over all ranks gives the square of the single-device
norm (as Megatron-LM's `clip_grad_norm`). Copies of one gradient:

* data parallel: after the bucket reduction every rank of the bucket's group ("dp", "edp",
  "dp_cp", "edp_cp") holds the same gradient; under ZeRO-1 each holds a disjoint slice instead;
* tensor parallel: a parameter the TP pass left whole (no `tp_dim` in `step.layouts`) is on
  every TP rank;
* pipeline: a parameter used by stages on several ranks (tied embeddings) is on each of them.

Each gradient is then scaled by `min(1, max_norm / (norm + 1e-6))`, unless the norm is not
finite: then the gradients stay as they are, so that `Step.check_health` can name the ones that
are not finite (torch's clip would make every one NaN). Returns the norm (fp32).

bf16-mixed (`runtime/precision.py`): the gradients clipped are the fp32 ones AdamW reads, the
masters' (the shards' under ZeRO-1).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def clip_grad_norm_(step, max_norm: float) -> torch.Tensor:
    """`step`: a compiled step (`mxgraph.step.TrainingStep`: its mesh, plan, data-parallel
    buckets, model parameters and executors)."""
    pieces = [(grad, copies) for _, grad, copies in named_gradient_pieces(step)]
    device = pieces[0][0].device if pieces else step.mesh.device  # nccl reduces device tensors
    return clip_pieces_(pieces, max_norm, device,
                        reduce=dist.is_initialized() and dist.get_world_size() > 1)


def clip_pieces_(pieces: list[tuple[torch.Tensor, int]], max_norm: float, device,
                 reduce: bool = True) -> torch.Tensor:
    """Clip `pieces` ((gradient, ranks holding the same values)) by the norm of them all;
    `reduce`: the squares are summed over every rank (one all-reduce). Each square sum is
    accumulated in fp64 inside the norm kernel, with no fp64 copy of the gradient (a copy
    costs 15x the time on the CPU and the gradient's size twice in memory)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad, copies in pieces:
        total += torch.linalg.vector_norm(grad, dtype=torch.float64).square() / copies
    if reduce:
        dist.all_reduce(total)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    scale = torch.where(torch.isfinite(norm), scale, 1.0)  # NaN would hide where it came from
    for grad, _ in pieces:
        grad.mul_(scale.to(grad.dtype))
    return norm.float()


def named_gradient_pieces(step) -> list[tuple[str, torch.Tensor, int]]:
    """(parameter name, the gradient this rank holds of it or a slice of it under ZeRO-1,
    ranks holding the same values), in the model's parameter order."""
    sizes = step.mesh.sizes
    holders = _pipeline_holders(step)
    named = list(step.model.named_parameters(remove_duplicate=False))
    order = {}
    for index, (name, param) in enumerate(named):
        order.setdefault(id(param), (index, name))
    tp_split = {id(p) for n, p in named if n in step.layouts and step.layouts[n].tp_dim is not None}
    data_parallel = step.data_parallel
    axis_of = {} if data_parallel is None else {
        id(p): bucket.axis for bucket in data_parallel.buckets for p in bucket.params}
    pieces = []
    if step.plan.zero1:
        for bucket in data_parallel.buckets:
            for param, piece in data_parallel.shard_pieces(bucket):
                pieces.append((param, piece, _model_copies(param, holders, sizes, tp_split)))
    else:  # bf16-mixed: the fp32 masters' gradients, what AdamW reads
        master = step.master_weights
        for _, param in step.model_parameters():
            grad = param.grad if master is None else master.masters[id(param)].grad
            if grad is None:
                continue
            dp_copies = sizes[axis_of[id(param)]] if id(param) in axis_of else 1
            pieces.append((param, grad,
                           dp_copies * _model_copies(param, holders, sizes, tp_split)))
    pieces.sort(key=lambda piece: order[id(piece[0])][0])
    return [(order[id(param)][1], grad, copies) for param, grad, copies in pieces]


def _model_copies(param, holders: dict, sizes: dict, tp_split: set[int]) -> int:
    """Ranks of one data-parallel replica holding `param`'s gradient."""
    tp_copies = 1 if id(param) in tp_split else sizes["tp"]
    return tp_copies * holders.get(id(param), 1)


def _pipeline_holders(step) -> dict[int, int]:
    """id(parameter) -> pipeline ranks holding it, for parameters shared across stages."""
    params = dict(step.model.named_parameters(remove_duplicate=False))
    return {id(params[name]): len(ranks)
            for executor in step.executors() for name, ranks in executor.shared_params}
