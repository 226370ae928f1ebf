"""Memory estimator: bytes per pipeline rank for a model config and a plan, nothing allocated.

    stages = estimate_memory("llama2-70b", Plan(pp=4, tp=8, recompute="full"), seq_len=4096)
    print(format_table(stages)); plot(stages, "memory.png")

Per rank (one per pipeline stage; TP/CP/DP/EP peers hold the same amounts):
* **parameters** - the stage's layers (contiguous, earlier stages take the remainder), the
  embedding on stage 0, final norm + LM head on the last; matrices (>= 2-D) / tp, routed
  experts / ep (norms and router stay whole).
* **gradients** - one per parameter as kept for the optimizer: in the parameter dtype, or
  fp32 under bf16-mixed (the main gradients; the bf16 ones are program outputs, in the
  transient working set).
* **optimizer** - AdamW's two moments in the dtype of what it updates (fp32; pure bf16:
  bf16), plus the fp32 master copy under bf16-mixed; / dp under zero1. The precision is
  `Plan.precision`, else the parameters' dtype alone (`runtime/precision.STATE_BYTES`).
* **activations** - saved activations per micro-batch, measured on a traced graph (below)
  times the micro-batches in flight: the schedule simulator's peak activation units for
  that rank / vpp (1F1B: stage s holds pp - s; GPipe: all); 1 without pipelining.
  / cp (sequence split); / tp with sequence parallelism, else only the tensor-parallel part
  (everything but norm outputs and the residual stream) / tp.
* **offloaded** - host bytes the offload pass moves, same scaling (not on the device).
* with `flash_attention` (default), math attention found in the trace (softmax between
  two bmms, what the CPU picks for MLA's unequal head dims) is recomputed like a fused
  attention kernel's backward, so no S x S matrix counts as saved; and the programs'
  codegen is the plan's on a GPU (else on the CPU): under Inductor codegen (the default
  where Inductor generates code) the auto remat pass recomputes what torch.compile's
  min-cut partitioner would, and saves less.
* **transient** - the traced graph's liveness peak minus parameters and saved values: the
  working set of one micro-batch's forward and backward (logits included); plus, under
  bf16-mixed or with several micro-batches, one gradient per parameter in the parameter
  dtype: a backward program returns its gradients together, and they are added into the
  kept ones (fp32 main gradients, or the earlier micro-batches' sum) after it ends.

Saved bytes per layer come from the compiler itself: the model is rebuilt with 1 dense
(+1 MoE) layer at full width on the meta device, its parameters turned into CPU fake
tensors (`driver.fake_model`), and compiled by the driver on one paper device under the
plan's recompute, offload and fusion policy for the stage, through the joint passes (the
same steps a run takes, stopped before the B/W split); per-layer bytes are differences
of traces with one more layer of each kind.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mxgraph.context import CompileContext
from mxgraph.driver import compile_step, fake_model
from mxgraph.errors import PlanError
from mxgraph.ir import ATTENTION_OPS, from_sdpa, fused_kind, is_backward, packet
from mxgraph.memory import estimate_peak
from mxgraph.memory_saved import node_bytes, saved_roots, size_hints
from mxgraph.passes.memory.regions import Graph, all_units, norm_units
from mxgraph.passes.memory.remat import apply_remat
from mxgraph.plan import Plan
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.runtime.precision import PARAM_DTYPE, STATE_BYTES, holds_returned_grads, precision_of_dtype
from mxgraph.schedules import build_schedule, simulate

_GiB = 2 ** 30


@dataclass
class StageMemory:
    stage: int
    layers: int
    params: int
    grads: int
    optimizer: int
    activations: int
    offloaded: int
    transient: int
    in_flight: float

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient


@dataclass
class LayerActivations:
    """Saved bytes of one micro-batch: per dense layer, per MoE layer, outside layers."""

    dense: int
    moe: int
    other: int
    dense_host: int
    moe_host: int
    replicated_fraction: float  # share of layer bytes not split by TP without SP
    transient: int


def _config(name_or_config):
    import models
    if isinstance(name_or_config, str):
        return models.preset_config(name_or_config)
    return name_or_config


def _trace_saved(config, plan: Plan, batch_size: int, seq_len: int, dtype: torch.dtype,
                 stage: int, flash_attention: bool = True, **overrides
                 ) -> tuple[int, int, int, int]:
    """(device saved bytes, host bytes, bytes of norm outputs/residuals, transient) of one
    micro-batch for `config` with `overrides` (e.g. fewer layers), under the plan's policy:
    the driver compiles it on one paper device through the joint passes (with
    `flash_attention`, math attention is recomputed right after remat, before offload)."""
    import models
    small = dataclasses.replace(config, **overrides)
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    model, tokens = fake_model(models.build_from_config(small, device="meta", dtype=dtype),
                               tokens)
    policy = dataclasses.replace(
        Plan(), recompute=plan.recompute_stages.get(stage, plan.recompute),
        offload=plan.offload, offload_prefetch=plan.offload_prefetch, fusion=plan.fusion,
        disable_passes=plan.disable_passes,
        codegen=plan.codegen_for(target_device_type(flash_attention)))
    mesh = Mesh.on_paper()
    after = {"remat": lambda c: _as_flash_attention(c.joints[0].gm)} if flash_attention else {}
    compilation = compile_step(model, policy, mesh, CompileContext(plan=policy, mesh=mesh),
                               (tokens, tokens), {}, stop_after="dead_code", after=after)
    gm = compilation.joints[0].gm
    hints = size_hints(gm)
    device, host = saved_roots(gm)
    replicated = set().union(*norm_units(Graph(gm)), set())
    saved = sum(node_bytes(n, hints) for n in device)
    whole = sum(node_bytes(n, hints) for n in device if n in replicated or _is_residual(n))
    peak, resident = estimate_peak(gm)
    return (saved, sum(node_bytes(n, hints) for n in host), whole,
            max(0, peak - resident - saved))


def target_device_type(flash_attention: bool) -> str:
    """The device type a trace stands for: a GPU ("cuda") where attention is fused, else
    the CPU (its programs' codegen is that device type's)."""
    return "cuda" if flash_attention else "cpu"


FLASH_RECOMPUTE = "as_flash_attention"
"""`meta["created_by"]` of the nodes `_as_flash_attention` adds: the fused kernel's own
recompute inside its backward, or work a GPU run does not do at all (it saves q, k, v and
the output); Auto Search does not price them (`layer_cost.read_costs`)."""


def _as_flash_attention(gm) -> None:
    """Math attention (softmax between two bmms: what the CPU trace picks when q/k and v
    head dims differ, as in MLA) saves S x S matrices that a fused attention kernel never
    stores: recompute them, as flash attention's backward does. An SDPA call the trace
    decomposed recomputes its inner values (q, k and v cast and scaled, scores,
    probabilities: `sdpa_inner`) from q, k and v, which stay saved as the kernel saves
    them; attention written as math without SDPA recomputes its whole unit. The nodes it
    adds are tagged `FLASH_RECOMPUTE`."""
    nodes = sdpa_inner(gm)
    if not nodes:
        for unit in all_units(gm, {"attn"}):
            if not any(packet(n) in ATTENTION_OPS or fused_kind(n) or fused_kind(n, backward=True)
                       for n in unit.nodes):  # neither SDPA nor a fused kernel: math attention
                nodes |= unit.nodes
    if nodes:
        before = set(gm.graph.nodes)
        apply_remat(gm, nodes)
        for node in gm.graph.nodes:
            if node not in before:
                node.meta["created_by"] = FLASH_RECOMPUTE


def sdpa_inner(gm) -> set:
    """Forward values of decomposed SDPA calls (`ir.from_sdpa`) that only the call's own
    ops read in the forward: everything but each call's output."""
    calls = {n for n in gm.graph.nodes if n.op == "call_function" and from_sdpa(n)
             and not is_backward(n)}
    inner = set()
    for node in calls:
        readers = [user for user in node.users if not is_backward(user)]
        if readers and all(user in calls for user in readers):
            inner.add(node)
    return inner


def trace_layer_activations(config, plan: Plan, batch_size: int, seq_len: int,
                            dtype: torch.dtype = torch.bfloat16, stage: int = 0,
                            flash_attention: bool = True) -> LayerActivations:
    """Saved bytes per layer kind under the plan's policy for `stage`, by differences of
    traces with one more layer of each kind (a saved value belongs to no single layer:
    the residual a layer saves is produced by the layer before)."""
    def trace(**overrides):
        return _trace_saved(config, plan, batch_size, seq_len, dtype, stage, flash_attention,
                            **overrides)

    n_dense = getattr(config, "n_dense_layers", None)
    if n_dense:  # dense + MoE layers
        base = trace(n_layers=2, n_dense_layers=1)
        more_moe = trace(n_layers=3, n_dense_layers=1)
        more_dense = trace(n_layers=3, n_dense_layers=2)
        moe = [a - b for a, b in zip(more_moe, base, strict=True)]
        dense = [a - b for a, b in zip(more_dense, base, strict=True)]
        other = [b - d - m for b, d, m in zip(base, dense, moe, strict=True)]
    else:  # one kind of layer (dense, or all MoE when n_dense_layers == 0)
        one, two = trace(n_layers=1), trace(n_layers=2)
        layer = [a - b for a, b in zip(two, one, strict=True)]
        other = [a - b for a, b in zip(one, layer, strict=True)]
        dense, moe = (layer, [0] * 4) if n_dense is None else ([0] * 4, layer)
    layer_bytes = max(dense[0], moe[0], 1)
    whole = dense[2] if dense[0] >= moe[0] else moe[2]
    return LayerActivations(dense[0], moe[0], other[0], dense[1], moe[1],
                            min(1.0, max(0.0, whole / layer_bytes)), base_transient(other, dense))


def base_transient(other, dense) -> int:
    return max(0, other[3] + dense[3])


def _is_residual(node) -> bool:
    """A residual-stream add: an add whose operands include a layer's input."""
    return node.target is torch.ops.aten.add.Tensor and (
        node.meta.get("custom") or {}).get("module", "").count(".") == 1


def in_flight(plan: Plan) -> dict[int, float]:
    """Micro-batches whose activations a pipeline rank holds at its peak."""
    if plan.pp == 1:
        return {0: 1.0}
    schedule = build_schedule(plan.schedule, pp=plan.pp, num_microbatches=plan.micro_batches,
                              vpp=plan.vpp if plan.vpp > 1 else None)
    peak = simulate(schedule).peak_activations
    return {rank: peak[rank] / plan.vpp for rank in range(plan.pp)}


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """The layers of each of `pp` contiguous stages; earlier stages take the remainder."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        count = base + (1 if s < extra else 0)
        out.append(range(start, start + count))
        start += count
    return out


def _param_bytes(model, plan: Plan, layers: range, first: bool, last: bool) -> tuple[int, int]:
    """(bytes, elements) of this stage's parameters on one rank."""
    total = elements = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            if int(parts[1]) not in layers:
                continue
        elif parts[0] == "embed" or parts[0] == "pos_embed":
            if not first:
                continue
        elif not last:
            continue
        n = p.numel()
        if "experts" in parts:
            n //= plan.ep
        if p.dim() >= 2 and "router" not in parts:
            n //= plan.tp
        total += n * p.element_size()
        elements += n
    return total, elements


def estimate_memory(model, plan: Plan, *, batch_size: int = 1, seq_len: int | None = None,
                    dtype: torch.dtype | None = None, dp: int | None = None,
                    flash_attention: bool = True) -> list[StageMemory]:
    """Per pipeline rank memory (see module docstring). `model`: a preset name or config;
    `batch_size`: the micro-batch size; `seq_len`: default the config's max_seq_len;
    `dtype`: the parameters' (default: `plan.precision`'s, else bfloat16; PlanError when it
    is not the plan's precision's); `flash_attention`: count math attention as a fused
    kernel would (no S x S saved); False reproduces what the CPU runs."""
    import models
    precision, dtype = plan_precision(plan, dtype)
    state = STATE_BYTES[precision]
    config = _config(model)
    seq_len = seq_len or config.max_seq_len
    dp = dp or plan.dp or 1
    full = models.build_from_config(config, device="meta", dtype=dtype)
    flights = in_flight(plan)
    layer_sets = stage_layers(config.n_layers, plan.pp)
    n_dense = getattr(config, "n_dense_layers", config.n_layers)
    traced: dict[str, LayerActivations] = {}
    seq_shard = seq_len // plan.cp
    stages = []
    for stage, layers in enumerate(layer_sets):
        policy = plan.recompute_stages.get(stage, plan.recompute)
        if policy not in traced:
            traced[policy] = trace_layer_activations(config, plan, batch_size, seq_shard, dtype,
                                                     stage, flash_attention)
        acts = traced[policy]
        first, last = stage == 0, stage == plan.pp - 1
        params, elements = _param_bytes(full, plan, layers, first, last)
        optimizer = elements * (state.optimizer + state.master) // (dp if plan.zero1 else 1)
        dense = sum(1 for i in layers if i < n_dense)
        moe = len(layers) - dense
        per_mb = dense * acts.dense + moe * acts.moe
        host = dense * acts.dense_host + moe * acts.moe_host
        if plan.tp > 1:
            keep = 1.0 / plan.tp if plan.sequence_parallel else (
                acts.replicated_fraction + (1 - acts.replicated_fraction) / plan.tp)
            per_mb, host = int(per_mb * keep), int(host * keep)
        if first or last:
            per_mb += acts.other // (2 if plan.pp > 1 else 1) // plan.tp
        flight = flights.get(stage, 1.0)
        returned = elements * dtype.itemsize if holds_returned_grads(
            precision, plan.micro_batches) else 0
        stages.append(StageMemory(stage=stage, layers=len(layers), params=params,
                                  grads=elements * state.grads,
                                  optimizer=optimizer, activations=int(per_mb * flight),
                                  offloaded=int(host * flight),
                                  transient=acts.transient // plan.tp + returned,
                                  in_flight=flight))
    return stages


def plan_precision(plan: Plan, dtype: torch.dtype | None) -> tuple[str, torch.dtype]:
    """(precision, parameter dtype) a run of `plan` with `dtype` parameters trains in."""
    if plan.precision is None:
        dtype = dtype or torch.bfloat16
        return precision_of_dtype(dtype), dtype
    wanted = PARAM_DTYPE[plan.precision]
    if dtype is not None and dtype != wanted:
        raise PlanError(f"precision={plan.precision!r} runs on {wanted} parameters, not "
                        f"{dtype}; drop the dtype (or --dtype) or change the precision")
    return plan.precision, wanted


def format_table(stages: list[StageMemory]) -> str:
    header = (f"{'stage':>5} {'layers':>6} {'params':>9} {'grads':>9} {'optim':>9} "
              f"{'acts':>9} {'in-flt':>6} {'transient':>9} {'device':>9} {'host':>9}   (GiB)")
    lines = [header]
    for s in stages:
        lines.append(f"{s.stage:>5} {s.layers:>6} {s.params / _GiB:>9.2f} {s.grads / _GiB:>9.2f} "
                     f"{s.optimizer / _GiB:>9.2f} {s.activations / _GiB:>9.2f} "
                     f"{s.in_flight:>6.1f} {s.transient / _GiB:>9.2f} "
                     f"{s.device_total / _GiB:>9.2f} {s.offloaded / _GiB:>9.2f}")
    return "\n".join(lines)


def plot(stages: list[StageMemory], path, title: str = "") -> None:
    """Stacked bars per stage (GiB), host offload as a hatched bar beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = ["params", "grads", "optimizer", "activations", "transient"]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(stages) + 2), 4))
    xs = [s.stage for s in stages]
    bottom = [0.0] * len(stages)
    for part in parts:
        values = [getattr(s, part) / _GiB for s in stages]
        ax.bar(xs, values, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    host = [s.offloaded / _GiB for s in stages]
    if any(host):
        ax.bar([x + 0.35 for x in xs], host, 0.1, label="offloaded (host)", hatch="//")
    ax.set_xlabel("pipeline stage (rank)")
    ax.set_ylabel("GiB per rank")
    ax.set_title(title or "mxgraph memory estimate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- saved bytes by layer from a joint graph already compiled (Auto Search) ------------------
@dataclass
class SavedByKind:
    """Saved bytes of one compiled joint graph, by the bucket of the producing layer."""

    device: dict[str, int]
    host: dict[str, int]
    """Bytes the offload pass moved to the host."""
    whole: dict[str, int]
    """Of `device`, norm outputs and residual-stream adds (not split by TP without SP)."""
    transient: int
    """Liveness peak minus resident inputs minus saved bytes: one micro-batch's working set."""


def recompute_math_attention(gm) -> None:
    """What `flash_attention=True` does to a traced graph (see `_as_flash_attention`)."""
    _as_flash_attention(gm)


def saved_by_layer(gm, kind_of, share=None) -> SavedByKind:
    """Attribute the saved values of `gm` (a joint graph after the joint passes, sharded
    or not) to `kind_of(layer, module)` of the node that produced each one (its
    `meta["custom"]`; a node the passes added takes its first input's). A value a layer
    saves of its input counts for the layer that produced it: over a stack of equal layers
    that is the same bytes per layer as the trace differences of
    `trace_layer_activations`, from one compile. No graph is changed. `share(node)`: the
    part of a value's bytes that counts, saved and in the liveness peak (default all;
    `memory.estimate_peak`)."""
    hints = size_hints(gm)
    device, host = saved_roots(gm)
    replicated = set().union(*norm_units(Graph(gm)), set())
    out = SavedByKind({}, {}, {}, 0)
    for nodes, bucket in ((device, out.device), (host, out.host)):
        for node in nodes:
            kind = kind_of(*_layer_of(node))
            size = node_bytes(node, hints) * (1 if share is None else share(node))
            bucket[kind] = bucket.get(kind, 0) + size
            if bucket is out.device and (node in replicated or _is_residual(node)):
                out.whole[kind] = out.whole.get(kind, 0) + size
    peak, resident = estimate_peak(gm, share)
    out.transient = max(0, peak - resident - sum(out.device.values()))
    return out


def _layer_of(node) -> tuple[int | None, str]:
    seen = 0
    while node is not None and seen < 8:
        custom = node.meta.get("custom") or {}
        if "layer" in custom or "module" in custom:
            return custom.get("layer"), custom.get("module", "")
        node = node.all_input_nodes[0] if node.all_input_nodes else None
        seen += 1
    return None, ""
