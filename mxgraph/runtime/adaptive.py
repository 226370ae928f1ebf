"""MoE adaptive recompute: pick, before each step, the fast or the recompute variant.

`Plan(moe=MoEOptions(adaptive_recompute_threshold=N))`: `mxgraph.step_adaptive.AdaptiveMoEStep`
compiles both variants ahead (on the first call for an input signature):
  * fast: the plan's recompute policy without MoE kinds;
  * recompute: the same plus the plan's MoE kinds (`moe_light|medium|full`; `moe_full`
    when the plan names none).
Before each step, `count_tokens_per_rank(model, tokens, ep)` counts the assignments that
would reach each EP rank (experts split contiguously over `ep` ranks, as Megatron lays
them out; on one device the caller may still pass the `ep` it plans to use). When the
largest count of any MoE layer on any rank is above N, the recompute variant runs (more
tokens mean more activation memory); else the fast one. Each decision is logged (logger
`mxgraph.adaptive`) and appended to `AdaptiveMoEStep.decisions`. This module holds the
counting and the two plans; the step lives above the driver.

Counting runs the model's router eagerly (`model.expert_counts(tokens)`, one forward
without autograd): a cost of about one extra forward per step on the CPU reference path.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from mxgraph.plan import Plan, parse_list

log = logging.getLogger("mxgraph.adaptive")
MOE_KINDS = ("moe_light", "moe_medium", "moe_full")


def tokens_per_rank(counts: list[torch.Tensor], ep: int) -> torch.Tensor:
    """[num MoE layers, ep] assignments per EP rank, from per-layer per-expert counts."""
    rows = []
    for per_expert in counts:
        experts = per_expert.numel()
        if experts % ep:
            raise ValueError(f"ep={ep} does not divide the {experts} routed experts")
        rows.append(per_expert.reshape(ep, experts // ep).sum(-1))
    return torch.stack(rows) if rows else torch.zeros(0, ep, dtype=torch.long)


def count_tokens_per_rank(model: torch.nn.Module, tokens: torch.Tensor, ep: int = 1
                          ) -> torch.Tensor:
    """Route `tokens` with the model's current router and count per EP rank."""
    if not hasattr(model, "expert_counts"):
        raise TypeError(f"{type(model).__name__} has no expert_counts(tokens); adaptive MoE "
                        f"recompute needs a model that can report its routing")
    return tokens_per_rank(model.expert_counts(tokens), ep)


def variant_plans(plan: Plan) -> tuple[Plan, Plan]:
    """(fast plan, recompute plan), neither adaptive."""
    kinds = parse_list(plan.recompute)
    dense = [k for k in kinds if k not in MOE_KINDS]
    moe = [k for k in kinds if k in MOE_KINDS] or ["moe_full"]
    moe_opts = dataclasses.replace(plan.moe, adaptive_recompute_threshold=None)
    fast = dataclasses.replace(plan, recompute=",".join(dense), moe=moe_opts)
    slow = dataclasses.replace(plan, recompute=",".join(dense + moe), moe=moe_opts)
    return fast, slow
