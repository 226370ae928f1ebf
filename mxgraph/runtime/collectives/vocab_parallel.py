"""Vocabulary-parallel cross-entropy: the loss of logits split by vocabulary over a group,
without ever gathering the full logits (Megatron-LM's `vocab_parallel_cross_entropy`).

`mxgraph::vocab_parallel_ce(logits [N, V/g], target [N], ignore_index, group_name)` returns
the per-token loss [N] in float32 (0 where target == ignore_index). Rank r of the group
holds vocabulary rows [r*V/g, (r+1)*V/g). Forward: three all-reduces of N floats (max,
sum of exponentials, the target's logit); backward: local only,
`(softmax - onehot) * grad`, from the saved log-sum-exp. Volume (collectives.groups.KIND): the
three all-reduces, 3*N*4 bytes, counted by `VOLUME` below.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mxgraph.runtime.collectives.groups import KIND, VOLUME, process_group


def _vocab_start(logits: torch.Tensor, group_name: str) -> int:
    return dist.get_rank(process_group(group_name)) * logits.shape[-1]


def _target_logit(logits32: torch.Tensor, target: torch.Tensor, start: int):
    local = target - start
    mine = (local >= 0) & (local < logits32.shape[-1])
    picked = logits32.gather(-1, torch.where(mine, local, 0)[:, None])[:, 0]
    return torch.where(mine, picked, 0.0), mine, local


@torch.library.custom_op("mxgraph::vocab_parallel_ce", mutates_args=())
def vocab_parallel_ce(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                      group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (per-token loss [N] fp32, log-sum-exp [N] fp32, saved for the backward)."""
    group = process_group(group_name)
    logits32 = logits.float()
    row_max = logits32.amax(-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits32 - row_max[:, None]).exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    picked, _, _ = _target_logit(logits32, target, _vocab_start(logits, group_name))
    dist.all_reduce(picked, group=group)
    lse = sum_exp.log() + row_max
    loss = torch.where(target == ignore_index, 0.0, lse - picked)
    return loss, lse


@vocab_parallel_ce.register_fake
def _(logits, target, ignore_index, group_name):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("mxgraph::vocab_parallel_ce_backward", mutates_args=())
def vocab_parallel_ce_backward(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                               lse: torch.Tensor, ignore_index: int,
                               group_name: str) -> torch.Tensor:
    """d loss / d logits for this rank's vocabulary rows: (softmax - onehot) * grad."""
    probs = (logits.float() - lse[:, None]).exp()
    local = target - _vocab_start(logits, group_name)
    mine = (local >= 0) & (local < logits.shape[-1])
    onehot = torch.zeros_like(probs).scatter_(-1, torch.where(mine, local, 0)[:, None],
                                              mine[:, None].to(probs.dtype))
    scale = torch.where(target == ignore_index, 0.0, grad)
    return ((probs - onehot) * scale[:, None]).to(logits.dtype)


@vocab_parallel_ce_backward.register_fake
def _(grad, logits, target, lse, ignore_index, group_name):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, target, ignore_index, group_name = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.ignore_index, ctx.group_name = ignore_index, group_name


def _backward(ctx, grad_loss, grad_lse):
    logits, target, lse = ctx.saved_tensors
    grad = vocab_parallel_ce_backward(grad_loss, logits, target, lse, ctx.ignore_index,
                                      ctx.group_name)
    return grad, None, None, None


vocab_parallel_ce.register_autograd(_backward, setup_context=_setup)

KIND["vocab_parallel_ce"] = "all_reduce"
KIND["vocab_parallel_ce_backward"] = None
VOLUME["vocab_parallel_ce"] = lambda node: 3 * node.args[0].meta["val"].shape[0] * 4
