"""Seconds of one part of a layer (a layer kind's F, B or W for some micro-batch sequences)
on one rank: its kernels under the device's roofline (`kernel_times`) and its collectives
over the plan's mesh axes (`comm_time`), less what overlap hides (`hidden_share`), plus what
the hidden part slows the compute beside it (`DeviceProfile.overlap_cost`).

    times = part_times(setting, plan, costs, "dense", "F", mbs=2)
    times["gemm"], times["attention"], times["memory"], times["comm"]       # seconds
"""
from __future__ import annotations

from mxgraph.devices.profile import DeviceProfile
from mxgraph.plan import Plan
from mxgraph.search.part_cost import PartCost
from mxgraph.search.setting import Setting


# ---- mesh geometry -------------------------------------------------------------------------
def axis_groups(plan: Plan, gpus: int) -> dict[str, tuple[int, int]]:
    """axis -> (group size, stride in ranks); tp fastest, then cp, ep, edp, pp outermost."""
    dp = plan.dp or gpus // (plan.tp * plan.pp * plan.cp)
    tp, cp, ep = plan.tp, plan.cp, plan.ep
    return {"tp": (tp, 1), "cp": (cp, tp), "ep": (ep, tp * cp), "dp": (dp, tp * cp),
            "edp": (dp // ep, tp * cp * ep), "dp_cp": (dp * cp, tp),
            "edp_cp": (dp // ep * cp, tp * ep), "pp": (plan.pp, tp * cp * dp)}


def comm_time(setting: Setting, plan: Plan, axis: str, kind: str, nbytes: float) -> float:
    """Seconds of one collective of `nbytes` over the plan's `axis` group: its span (intra-
    or inter-node) and, across nodes, its ranks per node (ranks `stride` apart: a node of
    g GPUs holds min(size, g / stride) of them, each with its own NIC)."""
    size, stride = axis_groups(plan, setting.gpus)[axis]
    per_node = setting.device.gpus_per_node
    spans = size * stride > per_node if kind != "send" else stride >= per_node
    sending = min(setting.gpus, per_node)
    local = max(1, min(size, per_node // stride)) if kind != "send" else 1
    leaves = None
    if setting.node_dispatch and axis == "ep" and kind == "all_to_all" and spans:
        leaves = node_dispatch_share(setting.config, size, local)
    return setting.device.collective_time(kind, nbytes, size if kind != "send" else 2, spans,
                                          sending, local, leaves)


def node_dispatch_share(config, ep: int, local: int) -> float:
    """The share of an expert-parallel dispatch's bytes (one copy per chosen expert: what
    the traced all-to-all moves) that leaves a rank's node when the dispatcher sends each
    token once to every other node that holds one of its experts (`Setting.node_dispatch`).
    With routing uniform over the experts, a token's `topk` experts fall on
    M (1 - (1 - 1/M)^topk) distinct nodes of the M it may reach: the ep group's
    N = ep / local nodes, or at most `topk_groups` of them where group-limited routing
    keeps whole groups in a node (N divides `n_groups`). (N - 1) / N of those nodes are
    remote, each sent one copy of the `topk` the traced bytes hold."""
    topk = config.topk
    nodes = max(1, ep // local)
    groups, chosen = getattr(config, "n_groups", 1), getattr(config, "topk_groups", 1)
    reach = min(nodes, chosen) if chosen < groups and groups % nodes == 0 else nodes
    distinct = reach * (1 - (1 - 1 / reach) ** topk)
    return distinct * (nodes - 1) / nodes / topk


def hidden_share(plan: Plan, axis: str, kind: str) -> float:
    """Share of a graph collective's time overlapped with compute (module docstring)."""
    options = plan.overlap
    if options is None or not options.reorder:
        return 0.0
    if axis == "tp" and kind in ("all_gather", "reduce_scatter"):
        return 1 - 1 / options.tp_chunks if options.tp_chunks > 1 else 0.5
    if axis == "ep" and kind == "all_to_all" and plan.moe.a2a_overlap:
        return 0.5
    return 0.0


def part_time(setting: Setting, plan: Plan, costs, kind: str, program: str,
              mbs: int) -> tuple[float, float]:
    """(seconds, of which exposed communication) of one part for `mbs` sequences."""
    times = part_times(setting, plan, costs, kind, program, mbs)
    return sum(times.values()), times["comm"]


def part_times(setting: Setting, plan: Plan, costs, kind: str, program: str,
               mbs: int) -> dict[str, float]:
    """Seconds of one part for `mbs` sequences by class: "gemm", "attention", "memory"
    (`kernel_times`) and "comm", its exposed collectives and the slowdown its hidden ones
    cause (`DeviceProfile.overlap_cost`)."""
    part = costs.part(kind, program)
    cache_key = (id(costs), kind, program, mbs, plan.tp, plan.cp, plan.ep, plan.pp,
                 plan.dp, repr(plan.overlap), plan.moe.a2a_overlap)  # a Setting fixes fp8 and node_dispatch
    if cache_key in setting.part_times:
        return setting.part_times[cache_key]
    times = kernel_times(setting.device, part, mbs, fp8=setting.fp8 and kind in LAYER_KINDS)
    compute = sum(times.values())
    comm = 0.0
    idle = compute / max(1, len(part.comm))  # the compute before each of the part's collectives
    for axis, ckind, nbytes in part.comm:
        seconds = comm_time(setting, plan, axis, ckind, nbytes * mbs)
        seconds -= setting.device.burst_saving(
            seconds - comm_time(setting, plan, axis, ckind, 0.0), idle)
        hidden = seconds * hidden_share(plan, axis, ckind)
        comm += seconds - hidden + setting.device.overlap_cost(hidden)
    times["comm"] = comm
    setting.part_times[cache_key] = times
    return times


LAYER_KINDS = ("dense", "moe")
"""The layer kinds whose GEMMs run in FP8 under `Setting.fp8` (the embedding and the LM
head stay in bf16, as in Transformer Engine's and DeepSeek-V3's FP8 recipes)."""


def kernel_times(device: DeviceProfile, part: PartCost, mbs: int,
                 fp8: bool = False) -> dict[str, float]:
    """Seconds of a part's kernels for `mbs` sequences by class (collectives apart): GEMMs
    by their shapes where the device has a shape model and the trace gave them
    (`DeviceProfile.gemm_shape_time`), else by their FLOPs; `fp8`: the GEMMs in FP8."""
    element = 1 if fp8 else 4 if device.dtype == "float32" else 2
    if device.sm_count and len(part.gemm_shapes) == len(part.gemms):
        gemm = sum(device.gemm_shape_time(s, mbs, element, fp8) for s in part.gemm_shapes)
    else:
        gemm = sum(device.gemm_time(f * mbs, fp8) for f in part.gemms)
    return {"gemm": gemm,
            "attention": sum(device.attention_time(f * mbs) for f in part.attention),
            "memory": sum(device.memory_time(b * mbs) for b in part.memory)}


def compute_time(device: DeviceProfile, part: PartCost, mbs: int, fp8: bool = False) -> float:
    """Seconds of a part's kernels for `mbs` sequences (collectives apart)."""
    return sum(kernel_times(device, part, mbs, fp8).values())
