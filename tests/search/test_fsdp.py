"""FSDP / ZeRO-3 pricing for published runs (`Setting.fsdp`, mxgraph/search/fsdp.py):
parameters and gradients sharded over dp plus two whole units, and the per-unit gathers
and reduce-scatters against their theory (every collective counted, each hidden behind the
compute of its micro-batch but the first gather and the last reduce-scatter, the hidden
ones slowing that compute by the profile's `overlap_slowdown`)."""
from __future__ import annotations

import dataclasses

import pytest

import models
from mxgraph.devices.catalog import load_device
from mxgraph.plan import Plan
from mxgraph.runtime.precision import STATE_BYTES
from mxgraph.search.fsdp import UNSHARDED_UNITS, fsdp_reduction
from mxgraph.search.layer_cost import TraceCache
from mxgraph.search.part_time import comm_time
from mxgraph.search.predict import (
    optimizer_time,
    plan_costs,
    predict,
    rank_memory,
    rank_stages,
    stage_count,
    stage_parts,
)
from mxgraph.search.setting import Setting

H100 = load_device("h100-sxm")
UNIT_MB = 0.05
UNIT, UNITS = UNIT_MB * 2 ** 20, 10
"""A unit's bytes; the units of the parameters the collective tests hand fsdp_reduction."""
CACHE = TraceCache(models)
"""One trace of llama-tiny for every setting here."""


def setting(fsdp: bool, device=H100, gpus: int = 4) -> Setting:
    return Setting(models.preset_config("llama-tiny"), device, gpus, 2 * gpus, 64, models,
                   fsdp=fsdp, cache=CACHE)


def unit_times(s: Setting, plan: Plan) -> tuple[float, float]:
    """Seconds of one unit's all-gather (bf16 parameters) and reduce-scatter (gradients in
    the precision's gradient dtype) over dp."""
    widen = STATE_BYTES[s.precision].grads / STATE_BYTES[s.precision].params
    return (comm_time(s, plan, "dp", "all_gather", UNIT),
            comm_time(s, plan, "dp", "reduce_scatter", UNIT * widen))


def slowed(exposed: float, total: float) -> float:
    """The exposed seconds of collectives of `total` seconds that expose `exposed`: the rest
    hides behind compute, which runs the profile's `overlap_slowdown` slower beside it."""
    assert H100.overlap_slowdown > 0
    return exposed + H100.overlap_slowdown * (total - exposed)


def test_parameters_and_gradients_are_sharded_but_two_units():
    plan = Plan(dp=4, zero1=True, bucket_mb=UNIT_MB)
    whole = predict(setting(False), plan, 1)
    sharded = predict(setting(True), plan, 1)
    assert sharded.peak_memory_gib < whole.peak_memory_gib
    for fsdp in (False, True):
        s = setting(fsdp)
        costs = plan_costs(s, plan, True)
        stages = stage_parts(s, plan, stage_count(plan), costs)
        (entry,) = rank_memory(s, plan, costs, stages, rank_stages(s, plan), 1, True)
        if not fsdp:
            params, grads = entry["params"], entry["grads"]
            continue
        assert entry["params"] == pytest.approx(params / 4 + UNSHARDED_UNITS * UNIT, rel=1e-9)
        assert entry["grads"] == pytest.approx(grads * (params / 4 + UNIT) / params, rel=1e-9)
        assert entry["whole_params"] == params


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_collectives_against_theory(micro_batches):
    plan = Plan(dp=4, zero1=True, bucket_mb=UNIT_MB, micro_batches=micro_batches)
    s = setting(True)
    gather, scatter = unit_times(s, plan)
    total, exposed = fsdp_reduction(s, plan, UNITS * UNIT, 0.0, 0.0, 0.0)
    m = micro_batches
    assert total == pytest.approx(m * UNITS * (2 * gather + scatter), rel=1e-9)
    assert exposed == pytest.approx(total, rel=1e-9)  # no compute hides anything
    _, hidden = fsdp_reduction(s, plan, UNITS * UNIT, 0.0, 1e3, 1e3)
    assert hidden == pytest.approx(slowed(m * (gather + scatter), total), rel=1e-9)  # first
    # gather, last scatter; the rest slows the compute it hides behind
    forward, backward = m * UNITS * gather / 2, m * UNITS * (gather + scatter) / 2
    _, half = fsdp_reduction(s, plan, UNITS * UNIT, 0.0, forward, backward)
    assert half == pytest.approx(slowed(total / 2, total), rel=1e-9)


def test_a_slow_link_between_nodes_exposes_the_gathers():
    slow = dataclasses.replace(H100, inter_bw=1e6, gpus_per_node=2)
    plan = Plan(dp=4, zero1=True, bucket_mb=UNIT_MB)
    fast = predict(setting(True), plan, 1)
    crawl = predict(setting(True, slow), plan, 1)
    assert crawl.breakdown_s["grad_sync"] > 100 * fast.breakdown_s["grad_sync"]
    assert sum(crawl.breakdown_s.values()) == pytest.approx(crawl.step_s, rel=1e-9)


def test_under_a_pipeline_units_stay_whole_and_sync_once_a_step():
    plan = Plan(dp=2, pp=2, zero1=True, bucket_mb=UNIT_MB, micro_batches=4)
    s = setting(True)
    gather, scatter = unit_times(s, plan)
    total, exposed = fsdp_reduction(s, plan, UNITS * UNIT, 0.0, 0.0, 0.0)
    assert total == pytest.approx(UNITS * (gather + scatter), rel=1e-9)
    assert exposed == pytest.approx(total, rel=1e-9)
    _, hidden = fsdp_reduction(s, plan, UNITS * UNIT, 0.0, 4e3, 4e3)
    assert hidden == pytest.approx(slowed(gather + scatter, total), rel=1e-9)
    whole, sharded = (predict(setting(fsdp), plan, 1) for fsdp in (False, True))
    assert sharded.peak_memory_gib == pytest.approx(whole.peak_memory_gib, rel=1e-9)


def test_every_rank_steps_a_piece_of_every_tensor():
    """The optimizer's per-tensor launches: over every parameter tensor under FSDP (each
    rank holds a piece of each), over about 1/dp of them in ZeRO-1's flat shard. With
    launches that cost 1 s and memory that costs nothing, the two steps differ as the
    tensor counts do."""
    slow_launch = dataclasses.replace(H100, op_overhead_s=1.0, hbm_bw=1e30,
                                      intra_latency_s=0.0, inter_latency_s=0.0)
    plan = Plan(dp=4, zero1=True, bucket_mb=UNIT_MB)
    steps = {}
    for fsdp in (False, True):
        s = setting(fsdp, slow_launch)
        costs = plan_costs(s, plan, True)
        stages = stage_parts(s, plan, stage_count(plan), costs)
        ranks = rank_stages(s, plan)
        memory = rank_memory(s, plan, costs, stages, ranks, 1, True)
        steps[fsdp] = optimizer_time(s, plan, memory, costs, stages, ranks)
        tensors = sum(n * costs.param_tensors.get(kind, 0) for kind, n in stages[0].items())
    assert tensors > 8
    per_tensor, passes = 12 + 2, 2  # AdamW's and the clip's launches; their memory passes
    assert steps[True] == pytest.approx(per_tensor * tensors + passes, rel=1e-6)
    assert steps[False] == pytest.approx(per_tensor * (tensors // 4) + passes, rel=1e-6)
