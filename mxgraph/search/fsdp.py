"""FSDP / ZeRO-3 (`Setting.fsdp`): the parameter sharding of published runs (PyTorch FSDP and
FSDP2 with full sharding, as torchtitan, llm-foundry and NeMo AutoModel train), priced for
Auto Search's check against them. mxgraph's runtime shards the optimizer (ZeRO-1), not the
parameters: this is a setting of the published-run check, not a plan field.

Each FSDP unit (one transformer block; its bf16 bytes are the plan's `bucket_mb`) is
all-gathered before its forward, freed, all-gathered again before its backward, and its
gradients are reduce-scattered after it, once per micro-batch (no gradient accumulation in
the unsharded gradients: what FULL_SHARD and FSDP2's defaults do). The gathers prefetch one
unit ahead, so each hides behind the compute of the unit before it: per micro-batch the
forward exposes what its gathers take beyond the forward's compute (at least the first
unit's gather), the backward what its gathers and reduce-scatters take beyond the backward's
compute (at least the last unit's reduce-scatter); what hides slows the compute beside it
(`DeviceProfile.overlap_cost`). Memory: parameters and gradients
sharded over the data-parallel ranks (routed experts over those that hold the same
experts), plus two units unsharded (the one computing and the one prefetched).

Under pipeline parallelism (pp > 1) the units stay whole from their first forward to the
step's end and their gradients are reduce-scattered once, after the last micro-batch
(torchtitan's and AutoModel's FSDP2 with a pipeline: no reshard after forward, the gradient
sync deferred to the last micro-batch): one gather and one reduce-scatter a step, hidden
behind the first micro-batch's forward and the last one's backward, and the parameters and
gradients whole in memory (the optimizer still sharded by the plan's `zero1`).
"""
from __future__ import annotations

import math

from mxgraph.plan import Plan
from mxgraph.runtime.precision import STATE_BYTES
from mxgraph.search.part_time import comm_time
from mxgraph.search.setting import Setting

UNSHARDED_UNITS = 2
"""Units whose parameters are whole at once: the one computing, the one prefetched."""


def reduction_groups(plan: Plan, params: float, experts: float) -> list[tuple[str, float]]:
    """(axis, bytes) of the data-parallel reductions of a rank holding `params` bytes of
    parameters, `experts` of them routed experts': the experts' over the ranks that hold the
    same experts ("edp": dp / ep), the others' over all of dp ("dp"); "_cp" appended under
    context parallelism (the gradients reduce over cp too). A group of one rank is left out."""
    dp = plan.dp or 1
    groups = []
    for axis, nbytes, size in (("dp", params - experts, dp),
                               ("edp", experts, max(1, dp // plan.ep))):
        if nbytes > 0 and size * plan.cp > 1:
            groups.append((axis + "_cp" if plan.cp > 1 else axis, nbytes))
    return groups


def shard_memory(plan: Plan, entry: dict) -> dict:
    """A `predict.rank_memory` entry with FSDP's sharded parameters and gradients; the
    whole ones kept as "whole_params" and "whole_experts" (what the collectives move)."""
    params, experts = entry["params"], entry["experts"]
    if plan.pp > 1:  # whole through the step (module docstring)
        return {**entry, "whole_params": params, "whole_experts": experts}
    dp = plan.dp or 1
    experts_dp = max(1, dp // plan.ep)
    sharded = (params - experts) / dp + experts / experts_dp
    unit = min(params, plan.bucket_mb * 2 ** 20)
    whole = min(params, sharded + UNSHARDED_UNITS * unit)
    grads = entry["grads"] * min(1.0, (sharded + unit) / params) if params else 0.0
    return {**entry, "params": whole, "experts": experts / experts_dp, "grads": grads,
            "whole_params": params, "whole_experts": experts}


def fsdp_reduction(setting: Setting, plan: Plan, params: float, experts: float,
                   forward_s: float, backward_s: float) -> tuple[float, float]:
    """(seconds, exposed seconds) of one step's FSDP collectives on the busiest pipeline
    rank: `params` and `experts` its whole (unsharded) parameter bytes and routed experts'
    share, `forward_s` and `backward_s` its compute a step (every micro-batch)."""
    m = plan.micro_batches
    state = STATE_BYTES[plan.precision or setting.precision]
    widen = state.grads / state.params  # gradients reduce in the precision's gradient dtype
    unit = plan.bucket_mb * 2 ** 20
    gather = scatter = gather_one = scatter_one = 0.0
    for axis, nbytes in reduction_groups(plan, params, experts):
        piece = min(unit, nbytes)
        units = max(1, math.ceil(nbytes / piece))
        one_gather = comm_time(setting, plan, axis, "all_gather", piece)
        one_scatter = comm_time(setting, plan, axis, "reduce_scatter", piece * widen)
        gather += one_gather * units
        scatter += one_scatter * units
        gather_one, scatter_one = max(gather_one, one_gather), max(scatter_one, one_scatter)
    if gather == 0.0:
        return 0.0, 0.0
    if plan.pp > 1:  # once a step: gathered for the first micro-batch, scattered after the last
        total = gather + scatter
        exposed = (max(gather_one, gather - forward_s / m) +
                   max(scatter_one, scatter - backward_s / m))
    else:
        total = m * (2 * gather + scatter)
        exposed = m * (max(gather_one, gather - forward_s / m) +
                       max(scatter_one, gather + scatter - backward_s / m))
    return total, exposed + setting.device.overlap_cost(total - exposed)


def fsdp_step(setting: Setting, plan: Plan, memory: list[dict], per_stage: dict,
              ranks: dict) -> tuple[float, float]:
    """`fsdp_reduction` for the pipeline rank with the most parameters (`memory`: the
    `shard_memory` entries beside `ranks`, as `predict.rank_memory` returns them under
    FSDP; `per_stage`: each stage's F, B and W seconds a micro-batch)."""
    held, entry = max(zip(ranks.values(), memory, strict=True),
                      key=lambda pair: pair[1]["whole_params"])
    m = plan.micro_batches
    forward = m * sum(per_stage[s]["F"] for s in held)
    backward = m * sum(per_stage[s]["B"] + per_stage[s]["W"] for s in held)
    return fsdp_reduction(setting, plan, entry["whole_params"], entry["whole_experts"],
                          forward, backward)
