"""The pipeline schedule of a plan in the search: built once per shape and kept, simulated
under per-stage costs (extrapolated beyond 3 pp micro-batches), the stages of each rank,
and the layers of each stage as the pipeline split assigns them (`stage_parts`).

`setting` below is a `setting.Setting` (its `schedules` and `flights` caches)."""
from __future__ import annotations

import dataclasses

from mxgraph.plan import Plan
from mxgraph.schedules import Costs, build_schedule, simulate
from mxgraph.schedules.build import SCHEDULES
from mxgraph.schedules.layout import stage_groups
from mxgraph.search.setting import Setting


def schedule_of(plan: Plan, cache: dict | None = None):
    """The plan's schedule (kept in `cache` by schedule, pp, micro-batches and vpp)."""
    vpp = None if plan.schedule == "dualpipev" else plan.vpp
    key = (plan.schedule, plan.pp, plan.micro_batches, vpp)
    if cache is None or key not in cache:
        schedule = build_schedule(plan.schedule, plan.pp, plan.micro_batches, vpp)
        if cache is None:
            return schedule
        cache[key] = schedule
    return cache[key]


def check_schedule(plan: Plan) -> None:
    """PlanError when the schedule's rules (`schedules.build`) refuse the plan's pp,
    micro-batches and vpp; nothing is built."""
    if plan.schedule not in SCHEDULES:
        build_schedule(plan.schedule, plan.pp, plan.micro_batches)  # raises the error
    default_vpp, check, _ = SCHEDULES[plan.schedule]
    check(plan.schedule, plan.pp, plan.micro_batches,
          default_vpp if plan.schedule == "dualpipev" else plan.vpp)


def unit_pipeline(setting: Setting, plan: Plan, w_retained: float = 0.5
                  ) -> tuple[float, float, dict]:
    key = ("unit", plan.schedule, plan.pp, plan.micro_batches, plan.vpp, round(w_retained, 3))
    if key not in setting.flights:
        setting.flights[key] = pipeline(setting, plan, Costs(), w_retained)
    return setting.flights[key]


def pipeline(setting: Setting, plan: Plan, costs: Costs, w_retained: float = 0.5
             ) -> tuple[float, float, dict]:
    """(time, overall bubble, peak activation units per rank) of the plan's schedule under
    `costs`. Beyond 3 pp micro-batches it is simulated at 2 pp and 3 pp and extrapolated:
    after the warm-up each further micro-batch adds the same actions to every rank, so the
    time and each rank's busy time grow by a constant and the peak stays (tested against
    the full simulation)."""
    m, base = plan.micro_batches, plan.pp
    if m <= 3 * base:
        timeline = simulate(schedule_of(plan, setting.schedules), costs, check=False,
                            w_retained=w_retained)
        return timeline.total_time, timeline.overall_bubble_ratio, timeline.peak_activations
    one, two = (simulate(schedule_of(dataclasses.replace(plan, micro_batches=k * base),
                                     setting.schedules), costs, check=False,
                         w_retained=w_retained) for k in (2, 3))
    extra = (m - 2 * base) / base
    total = one.total_time + extra * (two.total_time - one.total_time)
    busy = [one.busy[r] + extra * (two.busy[r] - one.busy[r]) for r in one.busy]
    return total, sum(total - b for b in busy) / (total * len(busy)), two.peak_activations


def stage_count(plan: Plan) -> int:
    return plan.pp * (2 if plan.schedule == "dualpipev" else plan.vpp)


def rank_stages(setting: Setting, plan: Plan) -> dict[int, list[int]]:
    """Pipeline rank -> the stages it holds (the schedule's placement), cached."""
    key = ("ranks", plan.schedule, plan.pp, plan.vpp)
    if key not in setting.flights:
        small = dataclasses.replace(plan, micro_batches=2 * plan.pp)  # placement only
        schedule = schedule_of(small, setting.schedules)
        setting.flights[key] = {r: list(schedule.stages_of(r)) for r in range(plan.pp)}
    return setting.flights[key]


def kind_counts(config, layers: range) -> dict[str, int]:
    n_dense = getattr(config, "n_dense_layers", None)
    if n_dense is None:
        return {"dense": len(layers), "moe": 0}
    dense = sum(1 for i in layers if i < n_dense)
    return {"dense": dense, "moe": len(layers) - dense}


def stage_parts(setting: Setting, plan: Plan, num_stages: int, costs) -> list[dict[str, int]]:
    """Per stage: how many layers of each kind (and the embedding, head) it holds, as the
    pipeline split assigns them (`schedules.layout.stage_groups`, the split's own rule), by
    each layer kind's forward FLOPs from `costs`; the last stage also pays any
    `Setting.mtp_layers`."""
    config = setting.config
    flops = {kind: costs.part(kind, "F").flops for kind in ("dense", "moe", "embed", "head")}
    mtp = setting.mtp_layers
    key = ("stage_parts", num_stages, plan.layout, plan.empty_layers, plan.pp,
           plan.schedule == "dualpipev", tuple(flops.values()))
    if key not in setting.flights:  # the balance is O(stages x layers^2): once per shape
        setting.flights[key] = _stage_parts(config, plan, num_stages, flops, mtp)
    return [dict(stage) for stage in setting.flights[key]]


def _stage_parts(config, plan: Plan, num_stages: int, flops: dict, mtp: int) -> list[dict]:
    kinds = [next(k for k, n in kind_counts(config, range(i, i + 1)).items() if n)
             for i in range(config.n_layers)]
    if num_stages > 1:
        head = (1 + mtp) * flops["head"] + mtp * flops[kinds[-1]]
        groups = stage_groups([flops[k] for k in kinds], num_stages, plan.layout,
                              (plan.pp, num_stages // plan.pp) if plan.empty_layers else None,
                              flops["embed"], head, shared_ends=plan.schedule == "dualpipev")
    else:
        groups = [list(range(config.n_layers))]
    stages = []
    for s, group in enumerate(groups):
        counts = {"dense": 0, "moe": 0}
        for i in group:
            counts[kinds[i]] += 1
        counts["embed"] = int(s == 0)
        counts["head"] = int(s == len(groups) - 1)
        stages.append(counts)
    if mtp:  # each MTP module: a block like the last layer, and the LM head
        stages[-1][kinds[-1]] += mtp
        stages[-1]["head"] += mtp
    return stages
