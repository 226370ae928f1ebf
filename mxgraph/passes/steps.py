"""The driver's structural steps: capture, shard materialisation, stage split, grad, B/W
split and codegen, each a function `step(compilation, ctx) -> graphs` listed in
`pipeline.py` beside the graph passes.

A `Compilation` is what the steps build for one input signature on this rank: the forward
graph, its stages, this rank's stages' joint graphs, their F/B/W programs and the executor.
Training without pipelining is one stage and one micro-batch: every step runs the same way
for every plan. Each step returns the graphs it produced, `(label, GraphModule)` pairs, for
the runner to check, record and dump.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule

from mxgraph.capture import ForwardGraph, capture, model_tensors, slot_tensor, whole_parameters
from mxgraph.codegen.python import generate
from mxgraph.context import CompileContext
from mxgraph.joint import JointGraph, build_joint
from mxgraph.passes.split_bw import split_bw
from mxgraph.passes.split_stages import StageGraph, split_stages
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.runtime.data_parallel.buckets import bucket_layout
from mxgraph.runtime.param_layout import ParamLayout, materialize
from mxgraph.runtime.pipeline.executor import PipelineExecutor, StageRuntime
from mxgraph.runtime.pipeline.programs import Program, StagePrograms
from mxgraph.schedules import Schedule


@dataclass
class Compilation:
    """One input signature's compilation on this rank, as the steps build it."""

    model: torch.nn.Module
    mesh: Mesh
    args: tuple
    kwargs: dict
    """One micro-batch of the user's inputs (what is traced)."""
    schedule: Schedule
    training: bool = True
    """False: a forward-only compile for evaluation (the model in eval mode, no backward)."""
    layouts: dict[str, ParamLayout] = field(default_factory=dict)
    """Parameter name (every alias) -> its split (filled by `shard_parameters`; shared
    with the step, so a later compile knows what an earlier one cut)."""
    forward: ForwardGraph | None = None
    stage_graphs: list[StageGraph] = field(default_factory=list)
    """Every stage's forward graph (all ranks split alike)."""
    joints: dict[int, JointGraph] = field(default_factory=dict)
    """This rank's stages' joint graphs."""
    programs: dict[int, StagePrograms] = field(default_factory=dict)
    executor: PipelineExecutor | None = None
    source: str = ""
    """The generated code of this rank's programs (codegen)."""

    def my_stages(self) -> list[int]:
        return list(self.schedule.stages_of(self.mesh.coords["pp"]))

    def flat_inputs(self) -> list:
        return torch.utils._pytree.tree_leaves((self.args, self.kwargs))


def capture_step(c: Compilation, ctx: CompileContext):
    """Trace the model on one micro-batch (a sharded model is traced at its whole shapes,
    so a new input signature shards the graph as the first one did). A training step traces
    the model in the mode the user left it in (`model.eval()` turns dropout off, as in eager);
    an evaluation program always in eval mode."""
    was_training = c.model.training
    c.model.train(c.training and was_training)
    try:
        with whole_parameters(c.model, c.mesh, c.layouts):
            c.forward = capture(c.model, c.args, c.kwargs)
    finally:
        c.model.train(was_training)
    return [("forward", c.forward.gm)]


def shard_parameters_step(c: Compilation, ctx: CompileContext):
    """Record the split the sharding passes chose for each parameter (`ParamLayout`, by
    every name of it) and cut the model's parameters to this rank's part, in place."""
    aliases: dict[int, list[str]] = {}
    for name, param in c.model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    params = dict(c.model.named_parameters(remove_duplicate=False))
    local: dict[str, list[int]] = {}
    for node in c.forward.gm.graph.find_nodes(op="placeholder"):
        if node.meta.get("mx_slot_kind") != "param":
            continue
        blocks = node.meta.get("tp_blocks")
        layout = ParamLayout(node.meta.get("tp_shard_dim"), tuple(blocks) if blocks else None,
                             node.meta.get("ep_shard_dim") is not None)
        if layout.sharded:
            for name in aliases[id(params[node.meta["mx_slot_key"]])]:
                c.layouts[name] = layout
                local[name] = list(node.meta["val"].shape)
    materialize(c.model, c.layouts, local, c.mesh)
    return [("forward", c.forward.gm)]


def split_stages_step(c: Compilation, ctx: CompileContext):
    """Cut the forward graph into the schedule's stages (one stage without pipelining)."""
    plan, stages = ctx.plan, c.schedule.num_stages
    padding = (plan.pp, stages // plan.pp) if plan.empty_layers else None
    c.stage_graphs = split_stages(c.forward, stages, plan.layout, padding,
                                  shared_ends=plan.schedule == "dualpipev")
    return [(f"stage{s}", c.stage_graphs[s].forward.gm) for s in c.my_stages()]


def grad_step(c: Compilation, ctx: CompileContext):
    """Derive each of this rank's stages' joint forward+backward graph (AOTAutograd)."""
    tensors_by_name = model_tensors(c.model)
    inputs = c.flat_inputs()
    for stage in c.my_stages():
        graph = c.stage_graphs[stage]
        placeholders = list(graph.forward.gm.graph.find_nodes(op="placeholder"))
        tensors, example = [], []
        for node, slot in zip(placeholders, graph.forward.slots, strict=True):
            if slot.kind != "input":
                tensors.append(slot_tensor(slot, tensors_by_name, graph.forward.constants))
            elif slot.key < graph.num_activations:  # zeros of the received value's meta
                meta = node.meta["val"]
                example.append(torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
                               .requires_grad_(meta.is_floating_point()))
            else:
                example.append(inputs[graph.user_inputs[slot.key - graph.num_activations]])
        outputs = graph.forward.gm.graph.find_nodes(op="output")[0].args[0]
        c.joints[stage] = build_joint(graph.forward, tensors, example,
                                      num_outputs=len(outputs))
    return [(f"stage{s}", j.gm) for s, j in c.joints.items()]


def split_bw_step(c: Compilation, ctx: CompileContext):
    """Cut each joint graph into F, B and W programs (bitwise equal to the joint)."""
    for stage, joint in c.joints.items():
        c.programs[stage] = split_bw(joint, c.stage_graphs[stage].num_activations)
    return _program_graphs(c)


def forward_programs_step(c: Compilation, ctx: CompileContext):
    """Evaluation: each of this rank's stages' forward graph is its F program (no B, W)."""
    for stage in c.my_stages():
        gm = c.stage_graphs[stage].forward.gm
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        outputs = list(gm.graph.find_nodes(op="output")[0].args[0])
        c.programs[stage] = StagePrograms(Program(gm, placeholders, outputs), _empty(gm),
                                          _empty(gm), placeholders, outputs, {}, [])
    return _program_graphs(c)


def _empty(root: GraphModule) -> Program:
    graph = Graph()
    graph.output(())
    return Program(GraphModule(root, graph), [], [])


def codegen_step(c: Compilation, ctx: CompileContext):
    """Generate each program's Python code and build this rank's executor."""
    overlap = ctx.plan.overlap
    if overlap is not None and overlap.dp_buckets:  # runtime/data_parallel/overlap.py hears of them
        bucket_of_name = _grad_buckets(c, ctx)
        for stage, programs in c.programs.items():
            grads = {node for _, node in programs.param_grads}
            params = {n for n, slot in zip(programs.placeholders, joint_slots(c, stage), strict=True)
                      if slot.kind == "param"} if ctx.plan.zero1 else set()
            bucket_of = {node: bucket_of_name.get(name, -1) for name, node in programs.param_grads}
            for _, program in programs.all():
                program.announce = tuple(n for n in program.outputs if n in grads)
                program.announce_buckets = tuple(bucket_of[n] for n in program.announce)
                program.needs = tuple(n for n in program.inputs if n in params)
    c.source = generate(c.programs, ctx.plan, ctx.dump_dir)
    runtimes = {}
    for stage, programs in c.programs.items():
        graph, joint = c.stage_graphs[stage], c.joints.get(stage)
        placeholders = graph.forward.gm.graph.find_nodes(op="placeholder")
        outputs = graph.forward.gm.graph.find_nodes(op="output")[0].args[0]
        runtimes[stage] = StageRuntime(
            programs=programs, slots=joint.inputs if joint else graph.forward.slots,
            num_activations=graph.num_activations,
            user_inputs=graph.user_inputs,
            activation_meta=[n.meta["val"] for n, s in zip(placeholders, graph.forward.slots, strict=True)
                             if s.kind == "input" and s.key < graph.num_activations],
            output_meta=[o.meta["val"] for o in outputs], constants=graph.forward.constants,
            joint=joint)
    last = c.stage_graphs[-1].forward.gm.graph.find_nodes(op="output")[0].args[0][0]
    c.executor = PipelineExecutor(c.model, c.schedule, runtimes, c.mesh,
                                  _shared_parameters(c), loss_meta=last.meta["val"],
                                  p2p_ahead=bool(ctx.plan.overlap and ctx.plan.overlap.p2p))
    return _program_graphs(c)


def _grad_buckets(c: Compilation, ctx: CompileContext) -> dict[str, int]:
    """Parameter name (every name of a shared one) -> the index of its data-parallel
    bucket, as the step will lay the buckets out (`bucket_layout` over the parameters this
    rank's stages read), for the codegen's choice of where to call back
    (`Program.announce_buckets`); computed once for all of this rank's stages."""
    names = {slot.key for stage in c.programs for slot in joint_slots(c, stage)
             if slot.kind == "param"}
    by_name = dict(c.model.named_parameters(remove_duplicate=False))
    held = {id(by_name[n]) for n in names if n in by_name}
    buckets = bucket_layout([(n, p) for n, p in c.model.named_parameters() if id(p) in held],
                            c.layouts, ctx.plan, c.mesh)
    index = {id(p): i for i, bucket in enumerate(buckets) for p in bucket.params}
    return {name: index[id(p)] for name, p in by_name.items() if id(p) in index}


def joint_slots(c: Compilation, stage: int) -> list:
    """The slots of a stage's program placeholders (`StagePrograms.placeholders`)."""
    joint = c.joints.get(stage)
    return joint.inputs if joint else c.stage_graphs[stage].forward.slots


def _program_graphs(c: Compilation):
    return [(f"stage{s}.{kind}", program.gm) for s, programs in c.programs.items()
            for kind, program in programs.all()]


def _shared_parameters(c: Compilation) -> list[tuple[str, set[int]]]:
    """(name, pipeline ranks) of parameters that stages on several ranks read."""
    holders: dict[str, set[int]] = {}
    for stage, graph in enumerate(c.stage_graphs):
        for slot in graph.forward.slots:
            if slot.kind == "param":
                holders.setdefault(slot.key, set()).add(c.schedule.stage_to_rank[stage])
    return [(name, ranks) for name, ranks in sorted(holders.items()) if len(ranks) > 1]
