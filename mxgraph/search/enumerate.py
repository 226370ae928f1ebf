"""Enumerate parallel layouts, prune them, score the survivors, keep the top k.

    result = search(setting, top_k=5)
    result.best[0].step_s; result.pruned   # {"divisibility": n, "memory": n, ...}

Axes: tp, pp, vpp, dp, ep, cp, sequence_parallel, zero1, the micro-batch size, the
schedule, the recompute level and activation offload (`SPACE`). A candidate is pruned
first by divisibility (the model's shapes and the PlanError rules: `Plan.validate` with
the world size and `driver.check_plan`, the schedule's own rules), then by memory (the
worst rank's predicted peak over the device's usable memory), then pre-scored with the
pipeline time taken from the schedule's bubble under equal costs; the best `exact` of those
are scored with the full schedule simulation (and their memory from their own graphs). A
layout with recompute or offload is pruned as dominated when the same layout fits without
(both only add time under the cost model). Every layer of a kind shares one strategy:
its costs are traced once per trace key (`layer_cost.py`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from mxgraph.driver import check_plan
from mxgraph.errors import PlanError, UserError
from mxgraph.plan import Plan, divisors
from mxgraph.search.predict import Prediction, peak_memory_gib, predict
from mxgraph.search.schedule_time import check_schedule
from mxgraph.search.setting import Setting

DENSE_RECOMPUTE = ("", "norm,act", "full")
MOE_RECOMPUTE = ("", "moe_light", "full")
SCHEDULES = ("1f1b", "interleaved", "zbh1", "dualpipev")


@dataclass
class Space:
    """What the enumeration may choose (defaults: all the issue's axes)."""

    max_tp: int = 8
    max_cp: int = 8
    max_mbs: int = 8
    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] | None = None
    """None: DENSE_RECOMPUTE or MOE_RECOMPUTE by model."""
    offload: tuple[str, ...] = ("", "all")
    zero1: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)


@dataclass
class Pruned:
    plan: Plan
    mbs: int
    reason: str
    prediction: Prediction | None = None
    memory: float | None = None
    """GiB, for those pruned by memory (the examples kept are those closest to fitting)."""


@dataclass
class SearchResult:
    best: list[Prediction]
    pruned: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[Pruned]] = field(default_factory=dict)
    candidates: int = 0
    traces: int = 0


def model_divisible(config, tp: int, ep: int, cp: int, seq_len: int) -> str | None:
    """Why the model's shapes do not split this way (None if they do)."""
    heads = config.n_heads
    kv = getattr(config, "n_kv_heads", None) or heads
    checks = [("n_heads", heads, tp), ("vocab_size", config.vocab_size, tp)]
    if getattr(config, "attention", "gqa") != "mla":
        checks.append(("n_kv_heads", kv, tp))
    for name in ("ffn_dim", "moe_ffn_dim"):
        if hasattr(config, name):
            checks.append((name, getattr(config, name), tp))
    if hasattr(config, "n_routed_experts"):
        checks.append(("n_routed_experts", config.n_routed_experts, ep))
    elif ep > 1:
        return "ep > 1 needs a Mixture-of-Experts model"
    checks.append(("seq_len", seq_len, 2 * cp if cp > 1 else 1))
    for name, value, degree in checks:
        if value % degree:
            return f"{name}={value} is not divisible by {degree}"
    return None


def layouts(setting: Setting, space: Space):
    """(Plan fields, mbs) for every combination of the axes (divisibility not yet checked
    beyond the world size)."""
    config, gpus = setting.config, setting.gpus
    moe = hasattr(config, "n_routed_experts")
    recompute = space.recompute or (MOE_RECOMPUTE if moe else DENSE_RECOMPUTE)
    for tp in [d for d in divisors(gpus) if d <= space.max_tp]:
        for cp in [d for d in divisors(gpus // tp) if d <= space.max_cp]:
            for pp in [d for d in divisors(gpus // (tp * cp)) if d <= config.n_layers]:
                dp = gpus // (tp * cp * pp)
                eps = [d for d in divisors(dp)] if moe else [1]
                for ep in eps:
                    yield from _rest(setting, space, recompute, tp, cp, pp, dp, ep)


def _rest(setting, space, recompute, tp, cp, pp, dp, ep):
    if setting.global_batch % dp:
        return
    local = setting.global_batch // dp
    schedules = space.schedules if pp > 1 else ("1f1b",)
    for schedule, mbs in itertools.product(schedules, divisors(local)):
        if mbs > space.max_mbs:
            continue
        m = local // mbs
        vpps = (2,) if schedule in ("interleaved", "dualpipev") else (1,)
        sps = space.sequence_parallel if tp > 1 else (False,)
        zero1s = space.zero1 if dp > 1 else (False,)
        for vpp, sp, zero1, rc, off in itertools.product(vpps, sps, zero1s, recompute,
                                                        space.offload):
            if off and rc:
                continue  # offload instead of recompute, not both
            yield {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep, "vpp": vpp, "schedule": schedule,
                       "micro_batches": m, "sequence_parallel": sp, "zero1": zero1, "recompute": rc,
                       "offload": off}, mbs


def check_candidate(setting: Setting, fields: dict) -> Plan:
    """The Plan, or PlanError for a layout that cannot compile (shapes, PlanError rules)."""
    why = model_divisible(setting.config, fields["tp"], fields["ep"], fields["cp"],
                          setting.seq_len)
    if why:
        raise PlanError(why)
    stages = fields["pp"] * fields["vpp"]
    if stages > setting.config.n_layers:
        raise PlanError(f"{stages} stages for {setting.config.n_layers} layers")
    plan = Plan(**fields, precision=setting.precision)
    check_plan(plan, setting.gpus)
    check_schedule(plan)  # the schedule's own rules (micro-batch counts)
    return plan


def search(setting: Setting, top_k: int = 5, space: Space | None = None,
           exact: int | None = None, examples: int = 3) -> SearchResult:
    """The `top_k` best plans by predicted step time (module docstring); UserError when no
    layout fits."""
    space = space or Space()
    exact = exact or max(4 * top_k, 16)
    result = SearchResult(best=[])
    usable = setting.device.hbm_bytes * setting.device.usable_memory_fraction / 2 ** 30
    scored: list[Prediction] = []
    fits_plain: set = set()  # layouts that fit without recompute or offload
    for fields, mbs in layouts(setting, space):
        result.candidates += 1
        layout = (tuple(v for k, v in fields.items() if k not in ("recompute", "offload")), mbs)
        if (fields["recompute"] or fields["offload"]) and layout in fits_plain:
            result.pruned["dominated"] = result.pruned.get("dominated", 0) + 1
            continue  # the same layout fits without: recompute and offload only add time
        try:
            plan = check_candidate(setting, fields)
        except PlanError as error:
            _prune(result, "divisibility", Pruned(Plan.__new__(Plan), mbs, str(error)),
                   examples, fields)
            continue
        memory = peak_memory_gib(setting, plan, mbs)
        if memory > usable:
            _prune(result, "memory", Pruned(plan, mbs, f"needs {memory:.1f} GiB > "
                                            f"{usable:.1f} GiB usable", memory=memory), examples)
            continue
        quick = predict(setting, plan, mbs, simulate_schedule=False)
        if not (fields["recompute"] or fields["offload"]):
            fits_plain.add(layout)
        scored.append(quick)
    if not scored:
        raise UserError(_nothing_fits(setting, result))
    scored.sort(key=lambda p: p.step_s)
    result.pruned["pre-score"] = max(0, len(scored) - exact)
    exact_scored = []
    for quick in scored[:exact]:
        p = predict(setting, quick.plan, quick.mbs)
        if p.peak_memory_gib > usable:  # the plan's own graph needs more than the estimate
            _prune(result, "memory", Pruned(p.plan, p.mbs, f"needs {p.peak_memory_gib:.1f} GiB > "
                                            f"{usable:.1f} GiB usable (its own graph)",
                                            memory=p.peak_memory_gib), examples)
        else:
            exact_scored.append(p)
    if not exact_scored:
        raise UserError(_nothing_fits(setting, result))
    exact_scored.sort(key=lambda p: p.step_s)
    result.best = exact_scored[:top_k]
    result.examples["pre-score"] = [Pruned(p.plan, p.mbs, f"pre-score {p.step_s:.3f} s", p)
                                    for p in scored[exact:exact + examples]]
    result.traces = setting.cache.compiles
    return result


def _prune(result: SearchResult, rule: str, pruned: Pruned, examples: int, fields=None):
    result.pruned[rule] = result.pruned.get(rule, 0) + 1
    kept = result.examples.setdefault(rule, [])
    if len(kept) < examples:
        if fields is not None:
            pruned.plan = _loose_plan(fields)
        kept.append(pruned)
    elif pruned.memory is not None:  # keep those pruned by memory closest to fitting
        worst = max(range(len(kept)), key=lambda i: kept[i].memory)
        if pruned.memory < kept[worst].memory:
            kept[worst] = pruned


def _loose_plan(fields: dict):
    """A Plan-like record of fields that failed validation (for --explain)."""
    return type("Fields", (), {"to_dict": lambda self: dict(fields), **fields})()


def _nothing_fits(setting: Setting, result: SearchResult) -> str:
    if not result.candidates:
        return (f"--gpus {setting.gpus} and --global-batch {setting.global_batch} leave no "
                f"layout: the global batch must be a multiple of the data-parallel degree "
                f"(gpus / (tp*pp*cp)); raise --global-batch to a multiple of {setting.gpus} "
                f"or use fewer GPUs")
    if result.pruned.get("memory", 0):
        return (f"no layout of {result.candidates} fits in {setting.device.name}'s memory "
                f"({setting.device.hbm_bytes / 2 ** 30:.0f} GiB); use more --gpus, a smaller "
                f"--seq-len, or a device with more memory")
    first = result.examples.get("divisibility", [None])[0]
    return (f"no layout of --gpus {setting.gpus} divides the model "
            f"({first.reason if first else 'no candidates'}); choose a GPU count whose "
            f"factors divide its heads, layers and experts")
