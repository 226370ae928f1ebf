"""The compile driver: the one place that runs the compile pipeline, for every caller.

    compilation = compile_step(model, plan, mesh, ctx, args, kwargs)
    compilation.executor.step(microbatches)        # what `Step` runs

It runs `passes.pipeline.PIPELINE` in order through the runner (lint, invariants, timing,
provenance, dumps, disable by name): capture -> forward passes -> shard materialisation ->
stage split -> grad -> joint passes -> B/W split -> codegen. Training without pipelining
is one stage and one micro-batch, so `mx.compile`, the memory estimator
(`memory_plan.py`), the communication report (`comm.py`) and Auto Search use the same
steps; those that only read graphs stop early (`stop_after=`) and compile a model of fake
tensors (`fake_model`) on a paper mesh (`paper_mesh`). The `torch.compile` backend, which
gets its graphs from Dynamo and AOTAutograd, runs the graph passes of a phase through
`run_graph_passes`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree

from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.passes.pipeline import ALL_PASSES, EVAL_PIPELINE, PIPELINE, check_pass_names
from mxgraph.passes.runner import PassSpec, run_pass, run_step
from mxgraph.passes.steps import Compilation
from mxgraph.plan import Plan, require_built
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.runtime.pipeline.executor import split_microbatches
from mxgraph.schedules import build_schedule, validate


def check_plan(plan: Plan, world_size: int | None = None) -> None:
    """PlanError for a plan the driver cannot compile: a bad field (against `world_size`
    when given), an unknown or required pass in `disable_passes`, an unbuilt capability."""
    plan.validate(world_size)
    check_pass_names(plan.disable_passes)
    require_built(plan)


def build_schedule_for(plan: Plan):
    """The plan's schedule (validated); one stage without pipelining."""
    vpp = None if plan.schedule == "dualpipev" else plan.vpp
    schedule = build_schedule(plan.schedule, plan.pp, plan.micro_batches, vpp)
    validate(schedule)
    return schedule


def compile_step(model: torch.nn.Module, plan: Plan, mesh: Mesh, ctx: CompileContext,
                 args: tuple, kwargs: dict, layouts: dict | None = None,
                 stop_after: str | None = None,
                 after: dict[str, Callable[[Compilation], None]] | None = None,
                 training: bool = True) -> Compilation:
    """Compile this rank's part of `model`'s training step for inputs like `args`,
    `kwargs` (the whole batch: the first of `plan.micro_batches` chunks is traced).
    `layouts`: name -> `ParamLayout` of parameters earlier compiles cut (updated in
    place). `stop_after`: the name of the last step to run (`PIPELINE`). `after`: step
    name -> a function called with the compilation right after that step (an analysis
    that looks between two passes, as the memory estimator does). `training=False`: a
    forward-only compile in eval mode (`EVAL_PIPELINE`), for evaluation."""
    after = after or {}
    for name in ([stop_after] if stop_after else []) + list(after):
        if name not in ALL_PASSES:
            raise PlanError(f"{name!r} is no step of the pipeline; choose one of "
                            f"{[spec.name for spec in PIPELINE]}")
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    first_args, first_kwargs = pytree.tree_unflatten(
        split_microbatches(leaves, plan.micro_batches)[0], spec)
    compilation = Compilation(model, mesh, first_args, first_kwargs, build_schedule_for(plan),
                              training, layouts if layouts is not None else {})
    for step in PIPELINE if training else EVAL_PIPELINE:
        run(step, compilation, ctx)
        if step.name in after:
            after[step.name](compilation)
        if step.name == stop_after:
            break
    return compilation


def run(spec: PassSpec, compilation: Compilation, ctx: CompileContext) -> None:
    """Run one entry of the pipeline on what `compilation` holds."""
    if spec.phase == "step":
        run_step(spec, compilation, ctx)
    elif spec.phase == "forward":
        compilation.forward.gm = run_pass(spec, compilation.forward.gm, ctx)
    else:
        several = len(compilation.joints) > 1
        for stage, joint in compilation.joints.items():
            joint.gm = run_pass(spec, joint.gm, ctx, f"stage{stage}" if several else "")


def run_graph_passes(phase: str, gm: torch.fx.GraphModule, ctx: CompileContext
                     ) -> torch.fx.GraphModule:
    """Run the pipeline's graph passes of `phase` ("forward" or "joint") on `gm`, for a
    caller that builds its graphs itself (the `torch.compile` backend)."""
    for spec in PIPELINE:
        if spec.phase == phase:
            gm = run_pass(spec, gm, ctx)
    return gm


def paper_mesh(plan: Plan) -> Mesh:
    """A paper mesh (groups by name only) with the plan's axes; dp None counts as 1."""
    return Mesh.on_paper(tp=plan.tp, pp=plan.pp, cp=plan.cp, dp=plan.dp or 1, ep=plan.ep)


def fake_model(model: torch.nn.Module, inputs):
    """The model and `inputs` (any pytree) with every meta tensor turned into a fake CPU
    tensor of one fake mode with a ShapeEnv, for compiling without memory: a model built on
    the meta device (`models.build_model(name, device="meta")`) then traces as on the CPU
    (kernels differ on the meta device: a sum-reduced nll_loss traced on meta lost its
    gradient, and so every gradient above it). The model is changed in place."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    cpu = torch.device("cpu")

    def fake(value):
        is_meta = isinstance(value, torch.Tensor) and value.is_meta
        return FakeTensor(mode, value, cpu) if is_meta else value
    model._apply(fake)
    return model, pytree.tree_map(fake, inputs)
