"""`mxgraph.compile(model, plan)`: the compiled training step.

    step = mxgraph.compile(model, plan)
    loss = step(tokens, targets)        # forward + backward; fills p.grad like backward()
    optimizer.step(); optimizer.zero_grad()

The first call for a given input signature (shapes, dtypes, non-tensor values) captures
the forward graph, runs the forward passes, derives the joint graph, runs the joint
passes and generates the code; later calls with that signature only run the code.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mxgraph.capture import capture, flat_inputs, model_tensors, slot_tensor, whole_parameters
from mxgraph.codegen.python import generate
from mxgraph.comm import write_comm_dump
from mxgraph.compile_pipeline import compile_pipeline, split_microbatches
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.joint import build_joint
from mxgraph.passes.pipeline import FORWARD_PASSES, JOINT_PASSES, check_pass_names
from mxgraph.passes.runner import record, run_pass
from mxgraph.passes.shard_ep import shard_expert_parameters
from mxgraph.passes.shard_tp import shard_parameters
from mxgraph.plan import Plan, require_built
from mxgraph.runtime.data_parallel import DataParallel
from mxgraph.runtime.grad_norm import clip_grad_norm_
from mxgraph.runtime.mesh import Mesh
from mxgraph.runtime.pipeline import PipelineExecutor


class Step:
    """A compiled training step for one model and plan (see module docstring)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, mesh: Mesh | None = None):
        self.model = model
        self.plan = plan
        self.mesh = mesh or Mesh.from_plan(plan)
        """This rank's mesh; `Mesh.on_paper(...)` compiles for many ranks without running
        (see `mxgraph.comm.comm_report`)."""
        self._compiled: dict[tuple, object] = {}
        self.contexts: list[CompileContext] = []
        """One per compiled input signature: the pass records (and dump dir)."""
        self.expert_param_ids: set[int] = set()
        """ids of the parameters sharded over "ep" (filled by the expert-parallel pass):
        their gradients are reduced over "edp" instead of "dp"."""
        self.data_parallel: DataParallel | None = None
        """This rank's gradient buckets (and ZeRO-1 shards), built after the first compile
        (runtime/data_parallel.py)."""

    def parameters(self):
        """The parameters this rank updates (on one device: the model's own). Compiles
        nothing: with pp > 1 it is the parameters of this rank's stages, known after the
        first call; before it, all of the model's.

        With `Plan(zero1=True)`: this rank's flat shards, one `nn.Parameter` per gradient
        bucket (named "zero1.bucket<i>"), whose `.grad` the step fills, while the model's
        parameters keep `.grad = None`; they exist after the first call or `prepare()`
        (PlanError before). Build the optimizer on them as usual: its state is sharded.
        """
        return (p for _, p in self.named_parameters())

    def named_parameters(self):
        if self.plan.zero1:
            return self._data_parallel().named_shards()
        return self._model_parameters()

    def sync_parameters(self) -> None:
        """With `Plan(zero1=True)`: copy the shards the optimizer updated back into the
        model's parameters (an all-gather over the data-parallel ranks). Each step does it
        at its start; call it after the last `opt.step()` before evaluating or saving the
        model. Without zero1 there is nothing to do."""
        if self.data_parallel is not None:
            self.data_parallel.gather_parameters()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After a step: scale this rank's gradients (the shards' under zero1) so that the
        norm of the whole model's gradient, over every rank, is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` on one device; returns that norm (fp32). Every rank
        must call it (runtime/grad_norm.py)."""
        return clip_grad_norm_(self, max_norm)

    def _model_parameters(self):
        """The model's parameters this rank holds (with pp > 1: its stages' ones)."""
        owned = getattr(self, "_owned", None)
        if owned is not None:  # by identity: a tied weight may be owned under its alias
            owned = {id(p) for n, p in self.model.named_parameters(remove_duplicate=False)
                     if n in owned}
        return ((n, p) for n, p in self.model.named_parameters()
                if owned is None or id(p) in owned)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self.prepare(*args, **kwargs)
        compiled = self._compiled[_signature(args, kwargs)]
        self.sync_parameters()
        if isinstance(compiled, PipelineExecutor):
            loss = compiled.step(split_microbatches(flat_inputs(args, kwargs),
                                                    self.plan.micro_batches))
        else:
            loss = compiled.run(self.model, flat_inputs(args, kwargs))
        return self._reduce_data_parallel(loss)

    def prepare(self, *args, **kwargs) -> None:
        """Compile for these inputs' signature without running a step (after this,
        `parameters()` lists exactly this rank's parameters)."""
        key = _signature(args, kwargs)
        if key not in self._compiled:
            self._compiled[key] = self._compile(args, kwargs)
            if self.contexts[-1].dump_dir is not None:  # comm.txt: mxgraph.comm's table
                write_comm_dump(self, self._compiled[key], self.contexts[-1].dump_dir)

    def _reduce_data_parallel(self, loss: torch.Tensor) -> torch.Tensor:
        """Average loss and gradients over the data-parallel group, gradients summed over
        the context-parallel one too (each rank's cover its part of the sequence:
        passes/shard_cp.py); bucket by bucket, reduce-scattered into the shards under zero1
        (runtime/data_parallel.py)."""
        dp = self.mesh.sizes["dp"]
        if self.mesh.sizes["dp_cp"] == 1 and not self.plan.zero1:
            return loss
        self._data_parallel().reduce()
        if dp == 1:
            return loss
        group = self.mesh.group("dp")
        loss = loss.clone()
        dist.all_reduce(loss, group=group)
        return loss / dp

    def _data_parallel(self) -> DataParallel:
        if self.data_parallel is None:
            if not self._compiled:
                raise PlanError("zero1: the parameter shards are laid out over the compiled "
                                "model's parameters; call step.prepare(*batch) or run one "
                                "step before step.parameters()")
            self.data_parallel = DataParallel.build(
                self._model_parameters(), self.expert_param_ids, self.plan, self.mesh)
        return self.data_parallel

    def _compile(self, args, kwargs):
        tag = f"sig{len(self._compiled)}" if self._compiled else ""
        ctx = CompileContext.for_plan(self.plan, tag, self.mesh)
        self.contexts.append(ctx)
        if self.plan.pp > 1 or self.plan.micro_batches > 1:
            executor = compile_pipeline(self.model, self.plan, self.mesh, ctx, args, kwargs,
                                        self.expert_param_ids)
            self._owned = {name for rt in executor.stages.values()
                           for name, _ in rt.programs.param_grads}
            return executor
        start = time.perf_counter()
        with whole_parameters(self.model, self.mesh, self.expert_param_ids):
            forward = capture(self.model, args, kwargs)
        record(ctx, "capture", "forward", forward.gm, time.perf_counter() - start)
        gm = forward.gm
        for spec in FORWARD_PASSES:
            gm = run_pass(spec, gm, ctx)
        forward.gm = gm
        shard_parameters(self.model, gm, ctx)
        self.expert_param_ids |= shard_expert_parameters(self.model, gm, ctx)
        start = time.perf_counter()
        tensors = _slot_tensors(self.model, forward)
        joint = build_joint(forward, tensors, flat_inputs(args, kwargs))
        record(ctx, "grad", "joint", joint.gm, time.perf_counter() - start)
        gm = joint.gm
        for spec in JOINT_PASSES:
            gm = run_pass(spec, gm, ctx)
        joint.gm = gm
        return generate(joint, forward.constants, ctx)


def compile(model: torch.nn.Module, plan: Plan | None = None) -> Step:  # noqa: A001
    """Compile `model`'s training step under `plan` (default: one device, no rewrites).

    `model.forward(*args, **kwargs)` must return the scalar loss. Parameters may be fp32
    or bf16. Returns a `Step`; see its docstring.
    """
    plan = plan or Plan()
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"mxgraph.compile takes an nn.Module, got {type(model).__name__}")
    plan.validate(_world_size())
    check_pass_names(plan.disable_passes)
    require_built(plan)
    if plan.moe.adaptive_recompute_threshold is not None:
        from mxgraph.runtime.adaptive import AdaptiveMoEStep
        return AdaptiveMoEStep(model, plan)
    return Step(model, plan)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _slot_tensors(model, forward):
    tensors = model_tensors(model)
    return [slot_tensor(s, tensors, forward.constants) for s in forward.slots
            if s.kind != "input"]


def _signature(args, kwargs) -> tuple:
    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), value.dtype, value.device.type)
        return ("V", type(value).__name__, value)
    return tuple(describe(v) for v in flat_inputs(args, kwargs)) + (
        torch.is_grad_enabled(),)
