"""Predict one plan: step time, throughput, MFU, memory per rank, bubble, exposed communication.

    setting = Setting(config, device, gpus=64, global_batch=512, seq_len=4096, library=models)
    prediction = predict(setting, plan, mbs=1)

Time. Per stage and micro-batch, F, B and W last the sum of their kernels' times under the
device's roofline (`device.py`: GEMMs by shape where the profile has a shape model, else
GEMM, attention and memory-bound efficiency curves; the layers' GEMMs at the FP8 rate under
`Setting.fp8`) plus their collectives (tp, cp, ep) timed by the alpha-beta model for the
group's span; the layers' costs come from the compiled graphs (`layer_cost.py`). Those
per-stage costs, with the stage-boundary send time, go to `schedules.simulate` for the
plan's schedule: the pipeline time and bubble are the simulated ones. Under DualPipeV with
overlap on, an F&B pair hides each part's exposed collectives behind the other part's
compute (`pair_hidden`; the pre-score takes the same off each rank's busy time).
`Prediction.breakdown_s` splits the step by component. Then the data-parallel gradient reduction
(per bucket; reduce-scatter + all-gather under ZeRO-1; when `overlap.dp_buckets` is on
the reductions hide behind the last micro-batch's backward except the last bucket, and
ZeRO-1's all-gathers behind the next step's first forward except the first bucket:
`dp_reduction`), the gradient-norm
all-reduce, and the optimizer (AdamW, memory-bound over this rank's parameters; its shard
under ZeRO-1). With overlap on, the sequence-parallel gathers/scatters and the expert
all-to-alls (with `moe.a2a_overlap`) are half hidden behind independent compute (1 - 1/chunks
with `overlap.tp_chunks`); other in-graph collectives stay exposed. Whatever hides is not
free: the compute beside it runs `DeviceProfile.overlap_slowdown` slower for as long as it
runs (`DeviceProfile.overlap_cost`, counted with the collectives' exposed time).

Memory per pipeline rank: parameters and gradients (local shapes from the graph; a second
gradient copy in the parameter dtype with several micro-batches or under bf16-mixed,
`returned_grads`), AdamW state and master weights as
the plan's precision holds them (`Plan.precision`, else `Setting.precision`;
`runtime/precision.STATE_BYTES`: fp32 m and v plus fp32 masters and fp32 gradients under
bf16-mixed; / dp under ZeRO-1, experts / dp/ep; ZeRO-1's flat parameter shards too (under
bf16-mixed they are the masters), not their gradients: those exist only once the
reduce-scatter freed the model's gradients, after the backward's peak), saved activations
per layer kind read from the same traced joint graph (`memory_plan.saved_by_layer`: the
plan's own sharding, recompute and offload) times the micro-batch size and the micro-batches
in flight (the schedule simulator's peak units / vpp, as `memory_plan.in_flight`;
`LayerCosts.w_retained` of a unit kept from B to W), and the transient working set of one
micro-batch. The pre-score reads the unsharded graph under the plan's policy instead, split by tp and cp as
`memory_plan.estimate_memory` does (`activations`).

Schedules with more than 3 pp micro-batches are simulated at 2 pp and 3 pp and extrapolated
linearly (`pipeline`): the steady state adds the same actions per micro-batch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mxgraph.errors import UserError
from mxgraph.plan import Plan
from mxgraph.runtime.precision import STATE_BYTES, holds_returned_grads
from mxgraph.schedules import Costs
from mxgraph.search.fsdp import fsdp_step, reduction_groups, shard_memory
from mxgraph.search.layer_cost import TRACED_EP, TraceKey
from mxgraph.search.part_time import (
    LAYER_KINDS,
    comm_time,
    compute_time,
    part_time,
    part_times,
)
from mxgraph.search.schedule_time import (
    pipeline,
    rank_stages,
    stage_count,
    stage_parts,
    unit_pipeline,
)
from mxgraph.search.setting import Setting

_GiB = 2 ** 30


@dataclass
class Prediction:
    plan: Plan
    mbs: int
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_memory_gib: float
    bubble: float
    exposed_comm_s: float
    memory_per_rank_gib: list[float]
    parts_s: dict = field(default_factory=dict)
    """The step's seconds by part: "pipeline" (forward and backward of every micro-batch,
    the schedule's bubble included), "grad_sync" (the exposed data-parallel reduction),
    "optimizer" (gradient clipping and AdamW)."""
    breakdown_s: dict = field(default_factory=dict)
    """The step's seconds on the busiest pipeline rank by component (`BREAKDOWN`; they add
    up to `step_s`); empty for the pre-score."""

    def to_json(self) -> dict:
        return {"plan": self.plan.to_dict(), "micro_batch_size": self.mbs,
                "step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "mfu": self.mfu, "peak_memory_gib": self.peak_memory_gib,
                "bubble": self.bubble, "exposed_comm_s": self.exposed_comm_s,
                "breakdown_s": self.breakdown_s}


BREAKDOWN = {
    "gemm": "GEMM kernels (layers, embedding, LM head)",
    "attention": "attention kernels",
    "memory": "memory-bound kernels (norms, activations, residuals, casts, loss)",
    "layer_comm": "exposed tp, cp and ep collectives inside the layers, and the compute the "
                  "hidden ones slow",
    "pipeline_wait": "pipeline bubble, stage-to-stage sends, offload transfers",
    "grad_sync": "exposed data-parallel gradient reduction (and ZeRO-1 gathers), and the "
                 "compute the hidden part slows",
    "optimizer": "gradient clipping and AdamW",
    "step_overhead": "fixed per-step cost outside the kernels",
}
"""`Prediction.breakdown_s`'s components and what each holds (`mxgraph search --explain`)."""


# ---- stages ---------------------------------------------------------------------------------


def trace_key(setting: Setting, plan: Plan) -> TraceKey:
    return TraceKey(tp=plan.tp, sequence_parallel=plan.sequence_parallel, cp=plan.cp,
                    expert_parallel=plan.ep > 1, recompute=plan.recompute, offload=plan.offload,
                    dtype=setting.device.dtype, flash_attention=setting.device.flash_attention)


# ---- memory ---------------------------------------------------------------------------------
@dataclass
class Activations:
    """Saved bytes of one sequence on this rank: per layer of a kind, on the device and on
    the host (offload), and the transient working set."""

    device: dict[str, float]
    host: dict[str, float]
    transient: float


def activations(setting: Setting, plan: Plan, costs, exact: bool) -> Activations:
    """`exact`: the saved bytes of the plan's own traced (sharded) graph. Otherwise (the
    pre-score, whose trace has no SP, CP or recompute): those of the unsharded graph under
    the plan's recompute/offload policy (tp 1, ep 1), split as `memory_plan.estimate_memory`
    does: / cp, and / tp with SP, else only the part that is not norm outputs or residuals."""
    key = (exact, costs.key if exact else None, plan.recompute, plan.offload, plan.tp,
           plan.sequence_parallel, plan.cp)
    if key in setting.memory:
        return setting.memory[key]
    if exact:
        saved, tp, cp = costs.saved, 1, 1
    else:
        saved, tp, cp = policy_costs(setting, plan).saved, plan.tp, plan.cp

    def keep(kind: str) -> float:
        total = saved.device.get(kind, 0)
        whole = saved.whole.get(kind, 0) / total if total else 0.0
        split = 1.0 if tp == 1 else (1 / tp if plan.sequence_parallel else
                                     whole + (1 - whole) / tp)
        return split / cp
    acts = Activations({k: v * keep(k) for k, v in saved.device.items()},
                       {k: v * keep(k) for k, v in saved.host.items()},
                       saved.transient / (tp * cp))
    setting.memory[key] = acts
    return acts


def policy_costs(setting: Setting, plan: Plan):
    """The unsharded graph's costs under the plan's recompute/offload policy."""
    key = TraceKey(recompute=plan.recompute, offload=plan.offload, dtype=setting.device.dtype,
                   flash_attention=setting.device.flash_attention)
    return setting.cache.layer_costs(setting.config, key, setting.seq_len)


def flights(setting: Setting, plan: Plan, w_retained: float = 0.5) -> dict[int, float]:
    """Micro-batches whose activations a pipeline rank holds at its peak (as
    `memory_plan.in_flight`: the simulator's peak units / vpp; `w_retained`: the share of a
    unit held from B to W, `LayerCosts.w_retained`)."""
    if plan.pp == 1:
        return {0: 1.0}
    _, _, peak = unit_pipeline(setting, plan, w_retained)
    return {rank: units / plan.vpp for rank, units in peak.items()}


def local_param_bytes(costs, plan: Plan, kind: str) -> tuple[float, float]:
    """(all, routed-expert) local parameter bytes of one layer (or part) of `kind`."""
    experts = costs.expert_param_bytes.get(kind, 0.0)
    if plan.ep > 1:
        experts = experts * TRACED_EP / plan.ep
    return costs.param_bytes.get(kind, 0.0) - costs.expert_param_bytes.get(kind, 0.0) + \
        experts, experts


def rank_memory(setting: Setting, plan: Plan, costs, stages: list[dict], ranks: dict,
                mbs: int, exact: bool) -> list[dict]:
    """Per pipeline rank: bytes of params, grads, optimizer, activations, transient."""
    acts = activations(setting, plan, costs, exact)
    flight = flights(setting, plan, costs.w_retained)
    dp = plan.dp or 1
    precision = plan.precision or setting.precision
    state = STATE_BYTES[precision]
    element = state.params
    out = []
    for rank, held in ranks.items():
        params = experts = per_mb = 0.0
        for s in held:
            for kind, n in stages[s].items():
                p, e = local_param_bytes(costs, plan, kind)
                params += n * p
                experts += n * e
                per_mb += n * acts.device.get(kind, 0.0)
        elements_dense = (params - experts) / element
        elements_expert = experts / element
        shard = (dp, max(1, dp // plan.ep)) if plan.zero1 else (1, 1)
        owned = elements_dense / shard[0] + elements_expert / shard[1]
        elements = params / element
        out.append({"params": params, "experts": experts,
                    "grads": elements * (state.grads + returned_grads(plan, precision) * element),
                    "optimizer": (state.optimizer + state.master) * owned,
                    "shards": element * owned if plan.zero1 and not state.master else 0.0,
                    "activations": per_mb * mbs * flight.get(rank, 1.0),
                    "transient": acts.transient * mbs})
    if setting.fsdp:
        return [shard_memory(plan, entry) for entry in out]
    return out


MEMORY_PARTS = ("params", "grads", "optimizer", "shards", "activations", "transient")
"""The parts of a `rank_memory` entry that add up to the rank's bytes ("experts": the
routed experts' share of "params", counted there)."""


def rank_bytes(memory: dict) -> float:
    return sum(memory[part] for part in MEMORY_PARTS)


def returned_grads(plan: Plan, precision: str) -> int:
    """Gradient-sized buffers in the parameter dtype held at the peak beside the kept
    gradients (1 or 0; `precision.holds_returned_grads`), but none with
    `overlap.dp_buckets`, which adds each gradient the moment it exists."""
    announced = plan.overlap is not None and plan.overlap.dp_buckets
    return int(not announced and holds_returned_grads(precision, plan.micro_batches))


# ---- the prediction -----------------------------------------------------------------------
def plan_costs(setting: Setting, plan: Plan, exact: bool):
    """The layer costs a prediction reads (`predict`: the pre-score's key when not exact)."""
    key = trace_key(setting, plan)
    if exact:
        return setting.cache.layer_costs(setting.config, key, setting.seq_len)
    key = dataclasses.replace(key, sequence_parallel=False, cp=1, recompute="", offload="")
    return setting.cache.estimate(setting.config, key, setting.seq_len)


def peak_memory_gib(setting: Setting, plan: Plan, mbs: int, exact: bool = False) -> float:
    """The worst pipeline rank's predicted memory (what `predict` reports), alone."""
    costs = plan_costs(setting, plan, exact)
    stages = stage_parts(setting, plan, stage_count(plan), costs)
    ranks = rank_stages(setting, plan)
    return max(rank_bytes(r) for r in rank_memory(setting, plan, costs, stages, ranks, mbs,
                                                  exact)) / _GiB


def predict(setting: Setting, plan: Plan, mbs: int, simulate_schedule: bool = True
            ) -> Prediction:
    """Predict one plan with `mbs` sequences per micro-batch (module docstring).
    `simulate_schedule=False` is the quick pre-score: the rank's busy time scaled by the
    schedule's bubble under equal costs, the layer costs of (tp, ep) without SP, CP or
    recompute (tp > 2 extrapolated from tp 1 and 2, `TraceCache.estimate`) plus the
    recompute's extra time on the unsharded graph / tp, memory as `activations` says."""
    device, config = setting.device, setting.config
    exact = simulate_schedule
    costs = plan_costs(setting, plan, exact)
    stages = stage_parts(setting, plan, stage_count(plan), costs)
    per_stage, comm_by_program = {}, {}
    for s, counts in enumerate(stages):
        times = {}
        comm_by_program[s] = {}
        for program in ("F", "B", "W"):
            total = program_comm = 0.0
            for kind, n in counts.items():
                if n:
                    t, c = part_time(setting, plan, costs, kind, program, mbs)
                    if not exact:  # this rank's share of the sequence, the recompute
                        t = (t + recompute_delta(setting, plan, kind, program, mbs)) / plan.cp
                        c = c / plan.cp
                    total += n * t
                    program_comm += n * c
            times[program] = total
            comm_by_program[s][program] = program_comm
        offload = offload_seconds(setting, plan, costs, counts, mbs, exact) \
            if plan.offload else 0.0
        times["F"] += max(0.0, offload - times["F"])  # transfers overlap the compute
        times["B"] += max(0.0, offload - times["B"])
        per_stage[s] = times
    ranks = rank_stages(setting, plan)
    boundary = mbs * costs.tokens * config.dim * (4 if device.dtype == "float32" else 2)
    if plan.sequence_parallel:
        boundary /= plan.tp
    send = comm_time(setting, plan, "pp", "send", boundary) if plan.pp > 1 else 0.0
    m = plan.micro_batches
    busy = {r: m * sum(sum(per_stage[s].values()) for s in held) for r, held in ranks.items()}
    if exact:
        pipeline_s, bubble, _ = pipeline(setting, plan, Costs(
            per_stage=per_stage, comm=send,
            hidden_in_pair=pair_hidden(plan, comm_by_program, device.overlap_slowdown)))
    else:
        _, bubble, _ = unit_pipeline(setting, plan)
        hides = pair_hidden(plan, comm_by_program, device.overlap_slowdown)
        for r, held in ranks.items():  # an F&B pair hides each part's collectives
            busy[r] -= m * sum(min(hides[s]["F"], per_stage[s]["B"] + per_stage[s]["W"]) +
                               min(hides[s]["BW"], per_stage[s]["F"]) for s in held if s in hides)
        pipeline_s = max(busy.values()) / max(1e-9, 1 - bubble)
    memory = rank_memory(setting, plan, costs, stages, ranks, mbs, exact)
    if setting.fsdp:  # parameters sharded too: gathered per unit, gradients scattered
        _dp_s, dp_exposed = fsdp_step(setting, plan, memory, per_stage, ranks)
    else:
        _dp_s, dp_exposed = dp_reduction(setting, plan, memory, per_stage, ranks)
    optimizer_s = optimizer_time(setting, plan, memory, costs, stages, ranks)
    step_s = pipeline_s + dp_exposed + optimizer_s + device.step_overhead_s
    comm_in_graph = max(m * sum(sum(comm_by_program[s].values()) for s in held)
                        for held in ranks.values())
    tokens = setting.global_batch * setting.seq_len
    model_flops = 3 * setting.global_batch * plan.tp * plan.cp * sum(
        n * costs.part(kind, "F").flops for counts in stages for kind, n in counts.items())
    totals = [rank_bytes(r) / _GiB for r in memory]
    breakdown = {}
    if exact:
        breakdown = rank_breakdown(setting, plan, costs, stages, ranks, mbs)
        rest = pipeline_s - sum(breakdown[k] for k in ("gemm", "attention", "memory"))
        breakdown["layer_comm"] = min(breakdown["layer_comm"], max(0.0, rest))  # F&B hid some
        breakdown["pipeline_wait"] = max(0.0, rest - breakdown["layer_comm"])
        breakdown.update(grad_sync=dp_exposed, optimizer=optimizer_s,
                         step_overhead=device.step_overhead_s)
    return Prediction(plan=plan, mbs=mbs, step_s=step_s,
                      tokens_per_s_per_gpu=tokens / step_s / setting.gpus,
                      mfu=model_flops / (step_s * setting.gpus * device.peak_flops),
                      peak_memory_gib=max(totals), bubble=bubble,
                      exposed_comm_s=comm_in_graph + dp_exposed + (send * 2 * m if plan.pp > 1
                                                                    else 0.0),
                      memory_per_rank_gib=totals,
                      parts_s={"pipeline": pipeline_s, "grad_sync": dp_exposed,
                               "optimizer": optimizer_s},
                      breakdown_s=breakdown)


def pair_hidden(plan: Plan, comm: dict[int, dict[str, float]], slowdown: float = 0.0) -> dict:
    """The layer communication an F&B pair hides (`Costs.hidden_in_pair`): under DualPipeV
    with overlap on, mxgraph's executor interleaves a pair's F and B programs at their
    collective waits (`codegen.segments.PAUSE`), so each part's exposed tp, cp and ep
    collectives run while the other part computes (DualPipe's F&B overlap); none
    otherwise. The other part's compute runs `slowdown` slower beside them
    (`DeviceProfile.overlap_slowdown`), so that share of their time is not hidden."""
    if plan.schedule != "dualpipev" or plan.overlap is None or not plan.overlap.reorder:
        return {}
    keep = 1.0 - slowdown
    return {s: {"F": keep * c["F"], "B": keep * c["B"], "BW": keep * (c["B"] + c["W"])}
            for s, c in comm.items()}


def rank_breakdown(setting: Setting, plan: Plan, costs, stages: list[dict], ranks: dict,
                   mbs: int) -> dict[str, float]:
    """Seconds of the busiest pipeline rank's micro-batches by kernel class and exposed
    layer communication (`BREAKDOWN`'s first four components)."""
    best: dict[str, float] = {}
    for held in ranks.values():
        totals = dict.fromkeys(("gemm", "attention", "memory", "layer_comm"), 0.0)
        for s in held:
            for kind, n in stages[s].items():
                for program in ("F", "B", "W"):
                    if not n:
                        continue
                    times = part_times(setting, plan, costs, kind, program, mbs)
                    for name, seconds in times.items():
                        totals["layer_comm" if name == "comm" else name] += \
                            n * seconds * plan.micro_batches
        if sum(totals.values()) > sum(best.values()):
            best = totals
    return best


def offload_seconds(setting: Setting, plan: Plan, costs, counts: dict, mbs: int,
                    exact: bool) -> float:
    """Seconds to move one micro-batch's offloaded activations of a stage each way."""
    acts = activations(setting, plan, costs, exact)
    host = sum(n * acts.host.get(kind, 0.0) for kind, n in counts.items()) * mbs
    return host / setting.device.host_bw


def recompute_delta(setting: Setting, plan: Plan, kind: str, program: str, mbs: int) -> float:
    """Pre-score: the compute time the plan's recompute adds to one part, on the unsharded
    graph (tp 1, ep 1), / tp."""
    if not plan.recompute:
        return 0.0
    cache_key = ("recompute", plan.recompute, kind, program, mbs, plan.tp)
    if cache_key not in setting.part_times:
        base = setting.cache.layer_costs(setting.config, TraceKey(
            dtype=setting.device.dtype, flash_attention=setting.device.flash_attention),
            setting.seq_len)
        policy = policy_costs(setting, dataclasses.replace(plan, offload=""))
        fp8 = setting.fp8 and kind in LAYER_KINDS
        delta = compute_time(setting.device, policy.part(kind, program), mbs, fp8) - \
            compute_time(setting.device, base.part(kind, program), mbs, fp8)
        setting.part_times[cache_key] = max(0.0, delta) / plan.tp
    return setting.part_times[cache_key]


def dp_reduction(setting: Setting, plan: Plan, memory: list[dict], per_stage: dict,
                 ranks: dict) -> tuple[float, float]:
    """(seconds, exposed seconds) of the gradient reduction of the busiest pipeline rank.

    Per bucket an all-reduce of the gradients (in the precision's gradient dtype), or under
    ZeRO-1 a reduce-scatter of them and an all-gather of the updated parameters (their own
    dtype). With `overlap.dp_buckets` (`runtime/data_parallel/overlap.py`) each bucket's
    reduction starts when its last gradient of the last micro-batch lands: it hides behind
    that micro-batch's backward (B and W) except the last bucket; ZeRO-1's all-gathers start
    after the optimizer and hide behind the next step's first forward, each bucket waited
    right before a program first reads it: all but the first bucket hide (Megatron-LM's
    --overlap-param-gather, FSDP's forward prefetch do the same). What hides slows the
    compute beside it (`DeviceProfile.overlap_cost`): that is exposed too."""
    dp = plan.dp or 1
    if dp * plan.cp == 1:
        return 0.0, 0.0
    worst = max(memory, key=lambda r: r["params"])
    bucket = plan.bucket_mb * 2 ** 20
    kinds = ("reduce_scatter", "all_gather") if plan.zero1 else ("all_reduce",)
    state = STATE_BYTES[plan.precision or setting.precision]
    widen = {kind: state.grads / state.params for kind in kinds}  # bf16-mixed: fp32 grads
    widen["all_gather"] = 1.0  # the parameters, in their own dtype
    total = {kind: 0.0 for kind in kinds}
    one = dict(total)
    buckets = 0
    for axis, grads in reduction_groups(plan, worst["params"], worst["experts"]):
        for kind in kinds:
            one[kind] = comm_time(setting, plan, axis, kind, min(bucket, grads) * widen[kind])
            total[kind] += one[kind] * (grads / min(bucket, grads))
        buckets += max(1, math.ceil(grads / bucket))
    overlap = plan.overlap
    if overlap is None or not overlap.dp_buckets:
        return sum(total.values()), sum(total.values())
    reduce_kind = kinds[0]
    last_backward = max(sum(per_stage[s]["B"] + per_stage[s]["W"] for s in held)
                        for held in ranks.values())
    exposed = max(one[reduce_kind] if buckets > 1 else total[reduce_kind],
                  total[reduce_kind] - last_backward)
    if plan.zero1:
        first_forward = min(sum(per_stage[s]["F"] for s in held) for held in ranks.values())
        exposed += max(one["all_gather"] if buckets > 1 else total["all_gather"],
                       total["all_gather"] - first_forward)
    busy = sum(total.values())
    return busy, exposed + setting.device.overlap_cost(busy - exposed)


def optimizer_time(setting: Setting, plan: Plan, memory: list[dict], costs, stages,
                   ranks) -> float:
    """AdamW over this rank's (shard of) parameters plus the gradient-norm clip; per-tensor
    launches over the tensors the rank holds (ZeRO-1's flat shard holds about 1/dp of them,
    FSDP's a piece of every one)."""
    device = setting.device
    worst = max(memory, key=lambda r: r["params"])
    state = STATE_BYTES[plan.precision or setting.precision]
    element = state.params
    elements = worst["optimizer"] / (state.optimizer + state.master)
    tensors = max(sum(stages[s][kind] * costs.param_tensors.get(kind, 0)
                      for s in held for kind in stages[s]) for held in ranks.values())
    if plan.zero1 and not setting.fsdp:  # a flat shard; FSDP shards every tensor instead
        tensors = max(1, tensors // max(1, plan.dp or 1))
    grads = worst["params"] / element
    if device.adamw_s_per_element:
        adam = elements * device.adamw_s_per_element + 12 * tensors * device.op_overhead_s
    else:
        adam = device.memory_time(elements * (7 * 4 + 2 * element)) + \
            12 * tensors * device.op_overhead_s
    if device.clip_s_per_element:
        clip = grads * device.clip_s_per_element + 2 * tensors * device.op_overhead_s
    else:
        clip = device.memory_time(3 * grads * element) + 2 * tensors * device.op_overhead_s
    norm = device.collective_time("all_reduce", 4, setting.gpus, setting.gpus >
                                  device.gpus_per_node, min(setting.gpus, device.gpus_per_node))
    return adam + clip + norm


def predict_plan(setting: Setting, plan: Plan, source: str) -> Prediction:
    """Predict one plan (`mxgraph search --evaluate`); UserError naming `source` when it does
    not fit the job (world size, batch)."""
    from mxgraph.driver import check_plan
    check_plan(plan, setting.gpus)
    dp = plan.resolve_dp(setting.gpus)
    if setting.global_batch < dp or setting.global_batch % dp:
        raise UserError(f"--global-batch {setting.global_batch} does not split over dp={dp} "
                        f"of {source}; use a multiple of {dp}")
    local = setting.global_batch // dp
    if local % plan.micro_batches:
        raise UserError(f"{source}: micro_batches={plan.micro_batches} does not divide the "
                        f"{local} sequences per data-parallel rank; set micro_batches to a "
                        f"divisor of {local}")
    plan = dataclasses.replace(plan, dp=dp)
    return predict(setting, plan, local // plan.micro_batches)
