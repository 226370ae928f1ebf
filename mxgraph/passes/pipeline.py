"""The compile pipeline, in order, one line each with why it sits there.

`PIPELINE` is every step the driver runs (`mxgraph/driver.py`), for every caller:
structural steps (phase "step": capture, shard materialisation, stage split, grad, B/W
split, codegen; `steps.py`) and graph passes. Forward passes rewrite the forward graph
before autograd, so fused ops and collectives get their backward derived by AOTAutograd;
joint passes rewrite each stage's forward+backward graph (memory, overlap). Names are
unique; `Plan.disable_passes` may name any graph pass (structural steps cannot be
disabled); `stop_after=` any step.
"""
from __future__ import annotations

from mxgraph.errors import PlanError
from mxgraph.passes.causal_mask import causal_mask_pass
from mxgraph.passes.cleanup import dead_code_pass, remove_noop_joint_pass, remove_noop_pass, safe_views_pass
from mxgraph.passes.fusion.fuse import fuse_pass
from mxgraph.passes.fusion.residual_grad import fuse_residual_grad_pass
from mxgraph.passes.memory.auto_remat import auto_remat_pass
from mxgraph.passes.memory.offload import offload_pass
from mxgraph.passes.memory.remat import remat_pass
from mxgraph.passes.moe.capacity import moe_capacity_pass
from mxgraph.passes.monitor_points import monitor_points_step
from mxgraph.passes.native_gqa import native_gqa_pass
from mxgraph.passes.overlap.async_collectives import overlap_async_pass
from mxgraph.passes.overlap.moe import overlap_moe_pass
from mxgraph.passes.overlap.reorder import overlap_reorder_pass
from mxgraph.passes.overlap.tp_chunks import overlap_tp_pass
from mxgraph.passes.runner import PassSpec
from mxgraph.passes.sharding.cp import shard_cp_pass
from mxgraph.passes.sharding.ep import shard_ep_pass
from mxgraph.passes.sharding.tp import shard_tp_pass
from mxgraph.passes.steps import (
    capture_step,
    codegen_step,
    forward_programs_step,
    grad_step,
    shard_parameters_step,
    split_bw_step,
    split_stages_step,
)

FORWARD_PASSES = [
    PassSpec("remove_noop", remove_noop_pass, "forward",
             "first: later matchers then see no alias/identity dropout between ops (a detach "
             "stays: it stops gradients until autograd)"),
    PassSpec("causal_mask", causal_mask_pass, "forward",
             "after remove_noop, before the sharding and fusion passes: they see a causal "
             "mask built from shapes (a Hugging Face model's under torch.export) as "
             "SDPA's is_causal, as they see a model that asks for it"),
    PassSpec("moe_capacity", moe_capacity_pass, "forward",
             "before shard_ep, instead of it when moe.capacity_factor is set: it pads the MoE "
             "blocks as traced and shards them over ep with equal-block all-to-alls"),
    PassSpec("shard_ep", shard_ep_pass, "forward",
             "before shard_tp: it matches the MoE blocks as traced; TP then sees local experts"),
    PassSpec("shard_cp", shard_cp_pass, "forward",
             "before shard_tp: TP then shards heads and hidden of the local sequence"),
    PassSpec("shard_tp", shard_tp_pass, "forward",
             "before fusion and autograd: collectives get their conjugates derived, and "
             "fused ops see local shapes"),
    PassSpec("fuse", fuse_pass, "forward",
             "before autograd: AOTAutograd derives each fused op's backward from its formula",
             adds_random=True),  # a fused bias-dropout-add replaces a dropout
    PassSpec("native_gqa", native_gqa_pass, "forward",
             "after fuse (its Repeat-GQA kernel goes first) and the sharding passes (they "
             "see the repeat as traced, on local heads), before autograd: under Inductor "
             "codegen SDPA reads shared K/V heads and its backward sums their gradients"),
    PassSpec("overlap_tp", overlap_tp_pass, "forward",
             "after sharding and fusion (it splits the linear layers that stay plain around "
             "the SP collectives), before autograd: the chunks' backward is derived chunked"),
]

JOINT_PASSES = [
    PassSpec("remove_noop_joint", remove_noop_joint_pass, "joint",
             "AOTAutograd leaves detach nodes for saved values; drop them before analyses"),
    PassSpec("fuse_residual_grad", fuse_residual_grad_pass, "joint",
             "after autograd: only the joint graph shows a residual gradient added to a fused "
             "norm's backward; before remat, which then sees the final backward"),
    PassSpec("remat", remat_pass, "joint",
             "first memory pass: decides saved vs recomputed before offload moves what is saved"),
    PassSpec("auto_remat", auto_remat_pass, "joint",
             "after remat, in its place for a plan with no memory policy of its own: under "
             "Inductor codegen, recompute what torch.compile's min-cut partitioner would"),
    PassSpec("offload", offload_pass, "joint",
             "after remat: only values that stay saved are worth moving to the host"),
    PassSpec("overlap_async", overlap_async_pass, "joint",
             "after the memory passes, which see the collectives as single ops: each becomes a "
             "start and a wait (Plan.overlap.reorder)"),
    PassSpec("overlap_reorder", overlap_reorder_pass, "joint",
             "after overlap_async and the memory passes (their saved and recomputed values "
             "are final): starts early, waits late"),
    PassSpec("overlap_moe", overlap_moe_pass, "joint",
             "after overlap_reorder placed the expert all-to-alls' starts and waits: moves "
             "independent compute (shared expert, weight gradients) into their windows "
             "(Plan.moe.a2a_overlap)"),
    PassSpec("safe_views_joint", safe_views_pass, "joint",
             "after every pass that adds or clones views (remat, overlap): AOTAutograd chose view "
             "over reshape by fake strides, which a decomposition's meta may state wrongly"),
    PassSpec("dead_code", dead_code_pass, "joint",
             "last: removes what earlier rewrites left unused (keeps random ops)"),
]

PIPELINE = [
    PassSpec("capture", capture_step, "step",
             "first: torch.export traces one micro-batch into a functional forward graph"),
    *FORWARD_PASSES,
    PassSpec("shard_parameters", shard_parameters_step, "step",
             "after the sharding passes chose each parameter's placement: the model's "
             "parameters become this rank's shards before autograd reads their shapes"),
    PassSpec("split_stages", split_stages_step, "step",
             "after the forward passes, so every stage holds rewritten, local-shape ops; one "
             "stage without pipelining"),
    PassSpec("grad", grad_step, "step",
             "per stage of this rank: AOTAutograd derives the joint forward+backward graph"),
    *JOINT_PASSES,
    PassSpec("split_bw", split_bw_step, "step",
             "after the joint passes: F, B and W programs of the final joint graph"),
    PassSpec("monitor_points", monitor_points_step, "step",
             "after split_bw, on the final programs: where each changes section (layer, "
             "collective), for a level-1 monitor's timing calls; nothing at level 0"),
    PassSpec("codegen", codegen_step, "step",
             "last: Python code for each program, and this rank's executor"),
]

_EVAL_STEPS = [spec for spec in PIPELINE if spec.phase != "joint" and spec.name not in (
    "grad", "split_bw", "monitor_points", "codegen")]
_AFTER_FORWARD = _EVAL_STEPS.index(FORWARD_PASSES[-1]) + 1

EVAL_PIPELINE = _EVAL_STEPS[:_AFTER_FORWARD] + [
    PassSpec("safe_views", safe_views_pass, "forward",
             "evaluation, after the forward passes: the forward graph is the program, and an "
             "op they put in (fused kernel, collective) may lay out its output otherwise than "
             "the ops a user's view read in eager"),
] + _EVAL_STEPS[_AFTER_FORWARD:] + [
    PassSpec("forward_programs", forward_programs_step, "step",
             "evaluation: each stage's forward graph is its program (no backward)"),
    PIPELINE[-1],  # codegen
]
"""A forward-only compile (`Step.eval_loss`): the model in eval mode, no backward."""

ALL_PASSES = {spec.name: spec for spec in PIPELINE + EVAL_PIPELINE}


def check_pass_names(names) -> None:
    """PlanError for a name in `disable_passes` that is no graph pass."""
    unknown = [n for n in names if n not in ALL_PASSES]
    if unknown:
        raise PlanError(f"disable_passes: unknown pass name(s) {unknown}; "
                        f"known: {sorted(n for n, s in ALL_PASSES.items() if not s.required)}")
    required = [n for n in names if ALL_PASSES[n].required]
    if required:
        raise PlanError(f"disable_passes: {required} build what later steps need and cannot "
                        f"be disabled; disable a graph pass instead (known: "
                        f"{sorted(n for n, s in ALL_PASSES.items() if not s.required)})")
