"""Flash Fusion: replace matched op chains of the forward graph with fused custom ops.

The patterns are data: `PATTERNS` lists them in the order they run, each a `Pattern` whose
docstring says "Matches: ... Rewrite to: ..." and whose `kind` is a name of
`mxgraph.plan.FUSION_KINDS`; `Plan(fusion=...)` selects the kinds. Every fused op is a
`torch.ops.mxgraph.*` custom op with a registered autograd formula (see
`mxgraph/codegen/kernels/`), so AOTAutograd derives the fused backward when the joint
graph is built. Fused nodes carry `meta["custom"]["tags"] = (..., "fused:<kind>")` (the
"tags" column of a dump's nodes.tsv; AOTAutograd copies it onto the fused backward ops)
and the fused op itself `meta["custom"]["fused_from"]`, the names of the nodes it replaced.
A rewrite the fused op refuses is undone with a warning (the graph stays correct).

`fusion=True` under Inductor codegen leaves to Inductor the kinds whose fused kernels (on
the CPU: their references) lose to Inductor's code for the same pattern on that device
(`LEFT_TO_INDUCTOR`, measured; `fusion_policy`); the pass's record names them. A plan that
names kinds gets those kinds.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule

import mxgraph.codegen.kernels  # noqa: F401 - registers torch.ops.mxgraph.*
from mxgraph.context import CompileContext
from mxgraph.ir import graph_device
from mxgraph.passes.fusion.attention import RepeatGQA, RoPE
from mxgraph.passes.fusion.elementwise import BiasDropoutAdd, BiasGelu, SwiGLU
from mxgraph.passes.fusion.moe import MoEPermute, MoERouter
from mxgraph.passes.fusion.norm import LinearCrossEntropy, RMSNorm
from mxgraph.passes.fusion.rewriter import Pattern, Rewriter
from mxgraph.runtime.cluster.device import detect

PATTERNS: list[Pattern] = [
    BiasDropoutAdd(),      # before RMSNorm: its residual add is BDA's root
    RMSNorm(),
    LinearCrossEntropy(),  # after RMSNorm: reads the final norm's output
    SwiGLU(),
    BiasGelu(),
    RoPE(),
    RepeatGQA(),           # after RoPE: the repeated K is a RoPE output
    MoERouter(),
    MoEPermute(),          # after the router: reads its top-k ids
]


LEFT_TO_INDUCTOR: dict[str, frozenset] = {"nvidia": frozenset({
    "swiglu", "bias_gelu", "bias_dropout_add", "rope", "gqa", "rmsnorm",
    "linear_cross_entropy"}), "cpu": frozenset({"gqa", "swiglu", "rope", "linear_cross_entropy"})}
"""Device kind -> the fusion kinds whose kernels lose to torch.compile of their reference
there, forward + backward.

NVIDIA (benchmarks/bench_kernels.py, bf16, 16384 tokens x 4096, H200, torch 2.11,
2026-12-04; fused / compile speed-ups over eager): swiglu 0.89 / 1.09, bias_swiglu 1.03 /
2.24, bias_gelu 0.79 / 1.21, bias_dropout_add 0.65 / 0.96, rmsnorm 0.45 / 0.51, add_rmsnorm
0.99 / 1.21, rope 3.52 / 4.64, gqa attention 0.30 / 0.99, linear_cross_entropy 0.88 / 1.22
(the same peak memory). Kept: moe_permute (5.63 / 1.42) and moe_router (1.12 / 1.02).
MetaX is not measured yet: every kind stays fused there.

CPU: the fused ops run their references, which Inductor fuses like any other code, but the
partitioner behind auto remat sees each as one opaque op, and some references cost more
than the unfused graph: gqa's repeats K/V for eager SDPA's kernel (where `native_gqa` hands
SDPA shared heads), linear_cross_entropy recomputes the logits' GEMM in the backward,
swiglu's backward writes both gradients to buffers of their own. Measured with
bench_compile's runners side by side (batch 4 x 256, paired median speed against fusion
off, 2026-12-05): fusion=True 0.990 (0.984-0.993) on llama-20m and 1.003 (1.000-1.008) on
hf-llama-20m; with only rmsnorm of those kinds fused 1.001 and 0.996, with rmsnorm and rope
0.995 and 1.005. Kept: rmsnorm; bias_gelu, bias_dropout_add and the MoE kinds are not
measured on the CPU."""


def fusion_policy(plan, device_kind: str, codegen: str) -> tuple[set, set]:
    """(kinds to fuse, kinds left to Inductor) for `plan` on a device of `device_kind`
    ("cpu", "nvidia", "metax") whose programs get `codegen`. Only `fusion=True` leaves
    kinds, and only to Inductor codegen: with Python codegen nothing else would fuse them."""
    kinds = set(plan.fusion_kinds())
    if plan.fusion is not True or codegen != "inductor":
        return kinds, set()
    left = kinds & LEFT_TO_INDUCTOR.get(device_kind, frozenset())
    return kinds - left, left


def fuse_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Rewrite every match of the plan's fusion kinds into its fused custom op.

    Precondition: a forward graph after `remove_noop` (torch.export training IR, every node
    with `meta["val"]`). Guarantee: the same signature and outputs; new nodes have fake
    values and the provenance of the node they replace. Numerics: not bitwise (fused ops
    compute in fp32 and round once; fp32 results agree to ~1e-7). With dropout, the masks
    differ from `aten.dropout`'s but are a pure function of torch's seed. Returns `gm` itself
    when the plan selects no fusion or nothing matched.
    """
    kinds = set(ctx.plan.fusion_kinds())
    if not kinds:
        return gm
    device = graph_device(gm)
    if device is not None:
        kind = "cpu" if device.type == "cpu" else detect(device).kind
        kinds, left = fusion_policy(ctx.plan, kind, ctx.plan.codegen_for(device.type))
        if left:
            ctx.findings.append(f"fusion=True on {kind}: {', '.join(sorted(left))} left to "
                                f"Inductor codegen, whose code for them is faster there "
                                f"(fuse.LEFT_TO_INDUCTOR); name them in fusion to fuse them")
    counts = apply_patterns(gm, kinds)
    if not any(counts.values()):
        return gm
    gm.graph.lint()
    return gm


def apply_patterns(gm: GraphModule, kinds) -> Counter:
    """Run the patterns of `kinds` over `gm` in `PATTERNS` order; returns matches per kind."""
    rw = Rewriter(gm)
    counts: Counter = Counter()
    for pattern in PATTERNS:
        if pattern.kind in kinds:
            counts[pattern.kind] += pattern.apply(rw)
    return counts


def fused_counts(gm: GraphModule) -> Counter:
    """Fused ops in a graph, by kind (read from the `fused:<kind>` tag of each fused op)."""
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "mxgraph" or target.name().endswith("_backward"):
            continue
        for tag in (node.meta.get("custom") or {}).get("tags", ()):
            if tag.startswith("fused:") and "fused_from" in node.meta["custom"]:
                counts[tag.removeprefix("fused:")] += 1
    return counts
