"""Per-layer costs read from the graphs mxgraph compiles: FLOPs, bytes, collectives, parameters.

    costs = TraceCache(library).layer_costs(config, key)    # one compile per key, cached
    costs.parts[("moe", "F")].gemm_flops                     # per micro-batch, this rank

A `TraceKey` names what changes the graphs of one layer: tp, sequence parallelism, cp,
whether experts are split (ep > 1), the recompute and offload policy, the dtype, whether
attention is fused. One compile per strategy (the key without recompute and offload); a
policy re-runs only the memory passes and the B/W split on a copy of the strategy's joint
graph (`trace_policy`: the steps before them do not read the policy; tested equal to a
compile of its own). For each strategy the model
is rebuilt with one dense and one MoE layer (one layer of the only kind otherwise) at full
width on the meta device, turned into fake tensors (`driver.fake_model`) and compiled by
the driver for rank 0 of a paper mesh through the B/W split (`stop_after="split_bw"`), at
one sequence of the search's length per micro-batch (`costs.tokens`; callers scale by the
micro-batch size: every cost here is linear in the batch). Every node of the joint graph
is attributed to a layer by `meta["custom"]["layer"]` (backward nodes inherit it; outside
layers: "embed" for the embedding, "head" for the final norm, LM head and loss) and to the
program that runs it: F, B or W. With one stage, the B program is empty (no activation
gradient leaves the stage), so the backward nodes that the embedding's weight gradient
depends on (the chain that carries the gradient down the layers) count as B, the rest as
W, as a stage boundary would cut them.

Node costs come from `cost.node_cost`, one rule added for the grouped expert GEMMs
(`mxgraph::grouped_mm`, `grouped_mm_wgrad`: 2 x rows x in x out). Each GEMM keeps its shape
too (`gemm_shape`: batch, m, n, k and which of them more sequences lengthen), which the
device's shape model times (`DeviceProfile.gemm_shape_time`). MoE models are traced
with `expert_impl="grouped_mm"` (the same math as a loop over experts, static shapes);
under ep > 1 the rows a rank receives are data-dependent: nodes whose shapes are, count at
the balanced share, their upper bound / ep (the traced ep is 2, and the balanced per-rank
rows do not depend on ep). On a flash-attention device, math attention (the CPU trace's
MLA) is priced as the fused kernel the GPU runs (`fused_attention`): the decomposed SDPA
call's casts and scaling, and what its stand-in recomputes for the backward, are the
kernel's own work, and a policy that keeps the kernel's output (any but full or attn)
recomputes none of it. Collectives come from
`comm_graph.graph_entries` per program, data-dependent sizes at the balanced share too.
Parameters are the joint graph's parameter placeholders at their local (sharded) shapes;
saved activations are read from the same joint graph (`memory_plan.saved_by_layer`). The
pre-score extrapolates tp > 2 from the traces at tp 1 and 2 (`TraceCache.estimate`).
The traced plan's codegen is the searched device's (`_plan`): under Inductor codegen the
auto remat pass recomputes what torch.compile's partitioner would, which lowers the saved
bytes; its recomputed values fuse into the backward's kernels and are not priced, and an
op it decomposed (a softmax, a norm) is priced as one kernel: its largest node.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass

import torch

from mxgraph.comm_graph import graph_entries
from mxgraph.context import CompileContext
from mxgraph.cost import node_cost
from mxgraph.driver import compile_step, fake_model, paper_mesh, run
from mxgraph.ir import copy_module, packet
from mxgraph.memory_plan import (
    FLASH_RECOMPUTE,
    SavedByKind,
    recompute_math_attention,
    saved_by_layer,
    target_device_type,
)
from mxgraph.memory_saved import node_bytes, size_hints
from mxgraph.passes.pipeline import PIPELINE
from mxgraph.plan import Plan, parse_list
from mxgraph.search.part_cost import PartCost, add_node, fused_attention, numel

PROGRAMS = ("F", "B", "W")
KINDS = ("dense", "moe", "embed", "head")
TRACED_EP = 2


@dataclass(frozen=True)
class TraceKey:
    """What changes one layer's graphs (see module docstring)."""

    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    expert_parallel: bool = False
    recompute: str = ""
    offload: str = ""
    dtype: str = "bfloat16"
    flash_attention: bool = True
    """Math attention is recomputed in the backward as a fused kernel does
    (`memory_plan.recompute_math_attention`); False: what the CPU runs."""


@dataclass
class LayerCosts:
    """A key's costs: parts by (layer kind, program), local parameter bytes by kind."""

    key: TraceKey
    tokens: int
    """Tokens per micro-batch the costs are for (one sequence; cp: this rank's part)."""
    parts: dict[tuple[str, str], PartCost]
    param_bytes: dict[str, float]
    """Local parameter bytes per layer of a kind ("embed", "head": the whole part)."""
    expert_param_bytes: dict[str, float]
    """Of those, the routed experts' bytes, at ep = TRACED_EP when split (scale by it / ep)."""
    param_tensors: dict[str, int]
    """Parameter tensors per layer of a kind."""
    saved: SavedByKind = None
    """Saved activation bytes per layer of a kind (device, host, norm/residual part) and the
    transient working set, read from the same joint graph (`memory_plan.saved_by_layer`)."""
    compile_s: float = 0.0
    w_retained: float = 0.5
    """Share of a micro-batch's saved activations still held between its B and its W (the
    weight gradients' inputs: saved by F or made by B), at most 1; the schedule simulator's
    `w_retained` (`w_retained_share`)."""

    def part(self, kind: str, program: str) -> PartCost:
        return self.parts.get((kind, program), PartCost())


def small_config(config, moe_impl: bool = True):
    """The config with one dense + one MoE layer (one layer when only one kind exists)."""
    n_dense = getattr(config, "n_dense_layers", None)
    if n_dense is None:
        return dataclasses.replace(config, n_layers=1)
    overrides = {"expert_impl": "grouped_mm"} if moe_impl else {}
    if n_dense == 0:
        return dataclasses.replace(config, n_layers=1, **overrides)
    if n_dense >= config.n_layers:
        return dataclasses.replace(config, n_layers=1, n_dense_layers=1, **overrides)
    return dataclasses.replace(config, n_layers=2, n_dense_layers=1, **overrides)


def layer_kind(config, layer: int | None, module: str) -> str:
    if layer is None:
        return "embed" if module.startswith(("embed", "pos_embed")) else "head"
    n_dense = getattr(config, "n_dense_layers", None)
    if n_dense is None or layer < min(n_dense, config.n_layers):
        return "dense"
    return "moe"


class TraceCache:
    """Compiles once per (config, key) and keeps the result (repeated layers share it)."""

    def __init__(self, library):
        self.library = library
        """The model library (`models`): builds a config on the meta device."""
        self.costs: dict[tuple, LayerCosts] = {}
        self.traced: dict[tuple, Traced] = {}
        self.compiles = 0
        """Compiles run (one per strategy)."""
        self.compile_s = 0.0

    def layer_costs(self, config, key: TraceKey, seq_len: int) -> LayerCosts:
        """Costs of one micro-batch of one `seq_len`-token sequence under `key`: one
        compile per strategy (the key without recompute and offload); its recompute and
        offload variants re-run only the memory passes on its joint graph (`trace_policy`)."""
        cache_key = (repr(config), key, seq_len)
        if cache_key in self.costs:
            return self.costs[cache_key]
        strategy = dataclasses.replace(key, recompute="", offload="")
        base_key = (repr(config), strategy, seq_len)
        if base_key not in self.traced:
            self.costs[base_key], self.traced[base_key] = trace(self.library, config, strategy,
                                                                seq_len)
            self.compiles += 1
            self.compile_s += self.costs[base_key].compile_s
        if key != strategy:
            self.costs[cache_key] = trace_policy(self.traced[base_key], key, seq_len)
            self.compile_s += self.costs[cache_key].compile_s
        return self.costs[cache_key]

    def estimate(self, config, key: TraceKey, seq_len: int) -> LayerCosts:
        """`layer_costs`, except that a key with tp > 2 not traced yet is extrapolated from
        the traces at tp 1 and 2 (`split_by_tp`): the search's pre-score."""
        if key.tp <= 2 or (repr(config), key, seq_len) in self.costs:
            return self.layer_costs(config, key, seq_len)
        cache_key = ("estimate", repr(config), key, seq_len)
        if cache_key not in self.costs:
            one = self.layer_costs(config, dataclasses.replace(
                key, tp=1, sequence_parallel=False), seq_len)
            two = self.layer_costs(config, dataclasses.replace(key, tp=2), seq_len)
            self.costs[cache_key] = split_by_tp(one, two, key)
        return self.costs[cache_key]


def split_by_tp(one: LayerCosts, two: LayerCosts, key: TraceKey) -> LayerCosts:
    """Costs at `key.tp` from those at tp 1 and 2: each amount v(t) = r + s / t, r the
    replicated part and s the split one (from v(1) = r + s, v(2) = r + s / 2), kernel by
    kernel where both traces have the same kernels of a class, else the tp-2 kernels scaled
    by the totals' ratio; collectives as at tp 2 (their bytes are the full tensors')."""
    tp = key.tp

    def at(v1: float, v2: float) -> float:
        return max(0.0, (2 * v2 - v1) + 2 * (v1 - v2) / tp)

    def kernels(a: list[float], b: list[float]) -> list[float]:
        if len(a) == len(b):
            return [at(x, y) for x, y in zip(a, b, strict=True)]
        ratio = at(sum(a), sum(b)) / sum(b) if sum(b) else 1.0
        return [y * ratio for y in b]

    def per_kind(a: dict, b: dict) -> dict:
        return {k: at(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}

    def shapes(a: list, b: list) -> list:  # a dimension tp splits is v(2) x 2 / tp
        if len(a) != len(b):
            return []
        return [tuple(x if x == y or i == 4 else max(1, round(y * 2 / tp))
                      for i, (x, y) in enumerate(zip(s1, s2, strict=True)))
                for s1, s2 in zip(a, b, strict=True)]
    parts = {}
    for name in set(one.parts) | set(two.parts):
        p1, p2 = one.part(*name), two.part(*name)
        parts[name] = PartCost(kernels(p1.gemms, p2.gemms), shapes(p1.gemm_shapes, p2.gemm_shapes),
                               kernels(p1.attention, p2.attention),
                               kernels(p1.memory, p2.memory), list(p2.comm))
    saved = SavedByKind(per_kind(one.saved.device, two.saved.device),
                        per_kind(one.saved.host, two.saved.host),
                        per_kind(one.saved.whole, two.saved.whole),
                        at(one.saved.transient, two.saved.transient))
    return LayerCosts(key, two.tokens, parts, per_kind(one.param_bytes, two.param_bytes),
                      per_kind(one.expert_param_bytes, two.expert_param_bytes),
                      dict(two.param_tensors), saved, w_retained=two.w_retained)


@dataclass
class Traced:
    """A strategy's compile, kept to derive its recompute/offload variants from."""

    compilation: object
    before_remat: object
    """A copy of the joint graph as the memory passes get it."""
    small: object
    mesh: object


def _plan(key: TraceKey) -> Plan:
    """The traced plan; its codegen is the one the searched device's programs get (a GPU's
    where attention is fused, else the CPU's), so that Inductor codegen's auto remat is in
    the saved bytes where the device would run it."""
    ep = TRACED_EP if key.expert_parallel else 1
    return Plan(tp=key.tp, sequence_parallel=key.sequence_parallel, cp=key.cp, ep=ep, dp=ep,
                recompute=key.recompute, offload=key.offload,
                codegen=Plan().codegen_for(target_device_type(key.flash_attention)))


def _add(parts: dict, small, node, where: dict, ep: int, fused, tokens: int) -> None:
    custom = node.meta.get("custom") or {}
    kind = layer_kind(small, custom.get("layer"), custom.get("module", ""))
    add_node(parts.setdefault((kind, where[node.name]), PartCost()), node, ep, fused, tokens)


def _fused_recompute(node) -> bool:
    """A value auto remat recomputes under Inductor codegen: Inductor lowers it inside the
    backward kernel that reads it (what the min-cut partitioner recomputes is pointwise,
    views and row reductions), so it costs no launch and no memory traffic of its own. Or
    one that math attention's stand-in for a fused kernel recomputes (`FLASH_RECOMPUTE`):
    the kernel's backward recomputes its scores on chip (inside its FLOPs as the cost rules
    count them: twice the forward's) and saves q, k, v and its output instead of
    recomputing the unit around it."""
    created_by = node.meta.get("created_by")
    return "recomputed_from" in node.meta and created_by in ("auto_remat", FLASH_RECOMPUTE)


def _steps(first: str, last: str):
    names = [spec.name for spec in PIPELINE]
    return PIPELINE[names.index(first):names.index(last) + 1]


def _copy_joint(joint):
    """The joint graph with a copy of its fx graph (node meta shared: passes replace it)."""
    return dataclasses.replace(joint, gm=copy_module(joint.gm))


def trace(library, config, key: TraceKey, seq_len: int) -> tuple[LayerCosts, Traced]:
    """Compile the small model under `key` and read its costs (module docstring)."""
    started = time.perf_counter()
    small = small_config(config)
    model = library.build_from_config(small, device="meta", dtype=getattr(torch, key.dtype))
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    model, (tokens,) = fake_model(model, (tokens,))
    plan = _plan(key)
    mesh = paper_mesh(plan)
    kept = {}
    before = _steps("capture", "remat")[-2].name
    after = {before: lambda c: kept.setdefault("joint", _copy_joint(c.joints[0]))}
    if key.flash_attention:
        after["remat"] = lambda c: recompute_math_attention(c.joints[0].gm)
    compilation = compile_step(model, plan, mesh, CompileContext.for_plan(plan, mesh=mesh),
                               (tokens, tokens), {}, stop_after="split_bw", after=after)
    traced = Traced(compilation, kept["joint"], small, mesh)
    return read_costs(traced, compilation, key, seq_len, started), traced


def trace_policy(traced: Traced, key: TraceKey, seq_len: int) -> LayerCosts:
    """`key`'s costs from the compile of its strategy (the same key without recompute and
    offload): the memory passes and the B/W split run again on a copy of the joint graph
    they got, under `key`'s policy (the steps before them do not read it)."""
    started = time.perf_counter()
    compilation = copy.copy(traced.compilation)
    compilation.joints = {0: _copy_joint(traced.before_remat)}
    compilation.programs = {}
    plan = _plan(key)
    ctx = CompileContext.for_plan(plan, mesh=traced.mesh)
    for spec in _steps("remat", "split_bw"):
        run(spec, compilation, ctx)
        if spec.name == "remat" and key.flash_attention:
            recompute_math_attention(compilation.joints[0].gm)
    return read_costs(traced, compilation, key, seq_len, started)


def read_costs(traced: Traced, compilation, key: TraceKey, seq_len: int,
               started: float) -> LayerCosts:
    """Read a compile's costs by layer kind and program (module docstring)."""
    small, mesh = traced.small, traced.mesh
    ep = TRACED_EP if key.expert_parallel else 1
    programs = compilation.programs[0]
    joint = compilation.joints[0]
    where = program_of(programs)
    fused = fused_attention(joint.gm, seq_len, key.cp) if key.flash_attention else None
    parts: dict[tuple[str, str], PartCost] = {}
    decomposed: dict[str, tuple] = {}  # op decomposed by auto remat -> (bytes, its largest node)
    kept_attention = fused is not None and not {"full", "attn"} & set(parse_list(key.recompute))
    for node in joint.gm.graph.nodes:
        if node.op != "call_function" or node.name not in where or _fused_recompute(node):
            continue
        if kept_attention and "recomputed_from" in node.meta and fused.holds(node):
            continue  # a policy that keeps a fused kernel's output recomputes none of it
        group = node.meta.get("decomposed_from")
        if group is not None:  # one kernel under Inductor: priced as its largest node
            size = node_cost(node).bytes
            if group not in decomposed or size > decomposed[group][0]:
                decomposed[group] = (size, node)
            continue
        _add(parts, small, node, where, ep, fused, seq_len // key.cp // key.tp)
    for _, node in decomposed.values():
        _add(parts, small, node, where, ep, fused, seq_len // key.cp // key.tp)
    for program_kind, program in programs.all():
        phase = "forward" if program_kind == "F" else "backward"
        for entry in graph_entries(program.gm, mesh, phase, lambda upper: upper // ep):
            kind = layer_kind(small, entry.layer, entry.module)
            which = where.get(entry.what, program_kind)
            parts.setdefault((kind, which), PartCost()).comm.append(
                (entry.axis, entry.kind, float(entry.bytes)))
    params, experts, tensors = local_params(joint, small)
    saved = saved_by_layer(joint.gm, lambda layer, module: layer_kind(small, layer, module),
                           _on_chip_share(fused))
    return LayerCosts(key, seq_len // key.cp, parts, params, experts, tensors, saved,
                      time.perf_counter() - started, w_retained_share(joint.gm, where, saved))


def _on_chip_share(fused):
    """The part of each value's bytes the memory model reads from the trace: none of what a
    fused attention kernel keeps on chip (`FusedAttention.on_chip`), all of the rest.
    Parameter gradients made before the peak and data-dependent sizes at their traced
    upper bound stay: with them the prediction matches the peaks `benchmarks/bench_search.py`
    measures (without them its MoE plans came out 5-18% under)."""
    if fused is None:
        return None
    return lambda node: 0.0 if fused.on_chip(node) else 1.0


def w_retained_share(gm, where: dict[str, str], saved) -> float:
    """Bytes of the values W reads that F or B made (kept from B until W runs), over the
    bytes F saves for the backward (one activation unit), capped at 1."""
    hints = size_hints(gm)
    kept = sum(node_bytes(node, hints) for node in gm.graph.nodes
               if where.get(node.name) in ("F", "B")
               and any(where.get(user.name) == "W" for user in node.users))
    unit = sum(saved.device.values()) + sum(saved.host.values())
    return min(1.0, kept / unit) if unit else 0.5


def program_of(programs) -> dict[str, str]:
    """Joint node name -> "F", "B" or "W" (module docstring: B inside one stage)."""
    where = {}
    for kind, program in programs.all():
        for node in program.gm.graph.nodes:
            if node.op == "call_function":
                where[node.name] = kind
    if any(v == "B" for v in where.values()):
        return where
    grads = {name: node for name, node in programs.param_grads}
    embed = [node for name, node in grads.items() if name.startswith("embed")]
    if not embed:
        return where
    stack, seen = [embed[0]], set()
    while stack:  # the chain the embedding's gradient reads, inside W
        node = stack.pop()
        if node in seen or where.get(node.name) != "W":
            continue
        seen.add(node)
        stack += node.all_input_nodes
    for node in seen:
        if node is not embed[0] and packet(node) is not torch.ops.aten.embedding_dense_backward:
            where[node.name] = "B"
    return where


def local_params(joint, config) -> tuple[dict, dict, dict]:
    """(bytes, routed-expert bytes, tensor count) per layer kind of this rank's parameters."""
    params: dict[str, float] = {}
    experts: dict[str, float] = {}
    tensors: dict[str, int] = {}
    placeholders = list(joint.gm.graph.find_nodes(op="placeholder"))
    for node, slot in zip(placeholders, joint.inputs, strict=True):
        if slot.kind != "param":
            continue
        parts = slot.key.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        kind = layer_kind(config, layer, slot.key)
        value = node.meta["val"]
        nbytes = numel(value.shape) * value.element_size()
        params[kind] = params.get(kind, 0) + nbytes
        tensors[kind] = tensors.get(kind, 0) + 1
        if "experts" in parts:
            experts[kind] = experts.get(kind, 0) + nbytes
    return params, experts, tensors
