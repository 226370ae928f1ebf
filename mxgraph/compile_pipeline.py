"""Compile a pipeline-parallel step: split stages, derive each stage's joint graph,
split it into F/B/W programs, and build the executor for this rank's stages."""
from __future__ import annotations

import time

import torch

from mxgraph.capture import capture, model_tensors, slot_tensor, whole_parameters
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.joint import build_joint
from mxgraph.passes.pipeline import FORWARD_PASSES, JOINT_PASSES
from mxgraph.passes.runner import record, run_pass
from mxgraph.passes.shard_ep import shard_expert_parameters
from mxgraph.passes.shard_tp import shard_parameters
from mxgraph.passes.split_bw import split_bw
from mxgraph.passes.split_stages import split_stages
from mxgraph.runtime.mesh import Mesh
from mxgraph.runtime.pipeline import PipelineExecutor, StageRuntime
from mxgraph.schedules import build_schedule, validate


def split_microbatches(inputs: list, num_microbatches: int) -> list[list]:
    """Chunk every tensor input along dim 0; other inputs are shared by all chunks."""
    chunks = []
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % num_microbatches:
                raise PlanError(f"micro_batches={num_microbatches} does not divide the batch "
                                f"size {value.shape[0]}; choose a divisor of it")
            chunks.append(value.chunk(num_microbatches))
        else:
            chunks.append([value] * num_microbatches)
    return [list(mb) for mb in zip(*chunks)]


def build_schedule_for(plan) -> object:
    vpp = None if plan.schedule == "dualpipev" else plan.vpp
    schedule = build_schedule(plan.schedule, plan.pp, plan.micro_batches, vpp)
    validate(schedule)
    return schedule


def compile_pipeline(model, plan, mesh: Mesh, ctx: CompileContext, args, kwargs,
                     expert_param_ids: set[int] | None = None) -> PipelineExecutor:
    """This rank's pipeline executor (see the module docstring). The ids of the
    parameters sharded over "ep" are added to `expert_param_ids` when given."""
    schedule = build_schedule_for(plan)
    microbatch = split_microbatches(list(args), plan.micro_batches)[0]
    start = time.perf_counter()
    with whole_parameters(model, mesh, expert_param_ids or set()):
        forward = capture(model, tuple(microbatch), kwargs)
    record(ctx, "capture", "forward", forward.gm, time.perf_counter() - start)
    gm = forward.gm
    for spec in FORWARD_PASSES:
        gm = run_pass(spec, gm, ctx)
    forward.gm = gm
    shard_parameters(model, gm, ctx)
    expert_ids = shard_expert_parameters(model, gm, ctx)
    if expert_param_ids is not None:
        expert_param_ids |= expert_ids
    padding = (plan.pp, schedule.num_stages // plan.pp) if plan.empty_layers else None
    stage_graphs = split_stages(forward, schedule.num_stages, plan.layout, padding)
    model_state = model_tensors(model)
    holders: dict[str, set[int]] = {}
    for stage, graph in enumerate(stage_graphs):
        for slot in graph.forward.slots:
            if slot.kind == "param":
                holders.setdefault(slot.key, set()).add(schedule.stage_to_rank[stage])
    shared = [(name, ranks) for name, ranks in sorted(holders.items()) if len(ranks) > 1]
    my_rank = mesh.coords["pp"]
    runtimes = {}
    for stage in schedule.stages_of(my_rank):
        graph = stage_graphs[stage]
        placeholders = list(graph.forward.gm.graph.find_nodes(op="placeholder"))
        tensors, example = [], []
        for node, slot in zip(placeholders, graph.forward.slots):
            if slot.kind != "input":
                tensors.append(slot_tensor(slot, model_state, graph.forward.constants))
            elif slot.key < graph.num_activations:
                meta = node.meta["val"]
                example.append(torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
                               .requires_grad_(meta.is_floating_point()))  # meta: paper mesh
            else:
                example.append(microbatch[graph.user_inputs[slot.key - graph.num_activations]])
        outputs = list(graph.forward.gm.graph.find_nodes(op="output")[0].args[0])
        start = time.perf_counter()
        joint = build_joint(graph.forward, tensors, example, num_outputs=len(outputs))
        record(ctx, f"grad_stage{stage}", "joint", joint.gm, time.perf_counter() - start)
        jgm = joint.gm
        for spec in JOINT_PASSES:
            jgm = run_pass(spec, jgm, ctx)
        joint.gm = jgm
        activation_meta = [n.meta["val"] for n, s in zip(placeholders, graph.forward.slots)
                           if s.kind == "input" and s.key < graph.num_activations]
        runtimes[stage] = StageRuntime(
            programs=split_bw(joint, graph.num_activations), slots=joint.inputs,
            num_activations=graph.num_activations, user_inputs=graph.user_inputs,
            activation_meta=activation_meta, output_meta=[o.meta["val"] for o in outputs],
            constants=graph.forward.constants)
    return PipelineExecutor(model, schedule, runtimes, mesh, shared)
