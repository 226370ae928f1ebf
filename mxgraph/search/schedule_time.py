"""The pipeline schedule of a plan in the search: built once per shape and kept, simulated
under per-stage costs (extrapolated beyond 3 pp micro-batches), the stages of each rank.

`setting` below is a `setting.Setting` (its `schedules` and `flights` caches)."""
from __future__ import annotations

import dataclasses

from mxgraph.plan import Plan
from mxgraph.schedules import Costs, build_schedule, simulate
from mxgraph.schedules.build import SCHEDULES
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
