"""`Step`: a compiled training step, and the interface every step type implements.

    step = mxgraph.compile(model, plan)
    loss = step(tokens, targets)        # forward + backward; fills p.grad like backward()
    optimizer.step(); optimizer.zero_grad()

The first call for a given input signature (shapes, dtypes, non-tensor values) runs the
compile driver (`driver.py`: capture, passes, grad, B/W split, codegen) and builds this
rank's executor; later calls with that signature only run it.
"""
from __future__ import annotations

from typing import Iterator, Protocol

import torch
import torch.distributed as dist

from mxgraph.capture import flat_inputs
from mxgraph.comm import report_of, write_comm_dump
from mxgraph.context import CompileContext
from mxgraph.driver import compile_step
from mxgraph.errors import PlanError
from mxgraph.plan import Plan
from mxgraph.runtime import host_memory, moe_stats
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.runtime.data_parallel.buckets import DataParallel, bucket_layout
from mxgraph.runtime.data_parallel.copy_engine import TransferLane
from mxgraph.runtime.data_parallel.overlap import BucketOverlap
from mxgraph.runtime.grad_norm import clip_grad_norm_, named_gradient_pieces
from mxgraph.runtime.health import Guard, Verdict, locate
from mxgraph.runtime.monitor.slow_node import StepMonitor, timed
from mxgraph.runtime.param_layout import ParamLayout
from mxgraph.runtime.pipeline.executor import PipelineExecutor, split_microbatches
from mxgraph.runtime.precision import PARAM_DTYPE, MasterWeights, cast_parameters_


class TrainingStep(Protocol):
    """What every compiled step offers (`Step`, `AdaptiveMoEStep`); the CLI, checkpoints,
    gradient clipping and the analyses use nothing else."""

    model: torch.nn.Module
    plan: Plan
    mesh: Mesh
    """This rank's place in the device mesh, its process groups and its device."""
    data_parallel: DataParallel | None
    """This rank's gradient buckets (and ZeRO-1 shards) once built."""
    layouts: dict[str, ParamLayout]
    """How each parameter (by name) is split over the mesh."""
    master_weights: MasterWeights | None
    """bf16-mixed: the fp32 main gradients and master weights (runtime/precision.py)."""

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """One training step: the loss (averaged over data-parallel ranks and
        micro-batches); gradients accumulate into `.grad` of `parameters()`."""

    def prepare(self, *args, **kwargs) -> None:
        """Compile for these inputs' signature without running a step."""

    def eval_loss(self, *args, **kwargs) -> torch.Tensor:
        """The loss of these inputs without gradients, the model in eval mode (every
        layout: the step's own sharded parameters, never the eager model)."""

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """What the optimizer updates on this rank."""

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """`parameters()` with names (for checkpoints)."""

    def model_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters this rank holds (its stages', its shards)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient over all ranks; returns it."""

    guard: Guard
    """The non-finite policy `check_health` applies (runtime/health.py)."""

    def check_health(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> Verdict:
        """After `clip_grad_norm_`: whether to apply optimizer step `step` (see `Step`)."""

    def sync_parameters(self) -> None:
        """zero1: copy the updated shards back into the model's parameters."""

    def executors(self) -> list[PipelineExecutor]:
        """One executor per compiled input signature (its stages' programs and joint
        graphs: what the analyses read)."""

    def set_monitor(self, monitor: StepMonitor | None) -> None:
        """Time the step's sections into the slow-node `monitor` (None: stop); before the
        first call or `prepare` for level 1 (`Step.set_monitor`)."""

    def moe_stats(self) -> dict[str, dict]:
        """What this rank's MoE blocks decided in the last step, by block (the module path
        of its experts): {"dropped": {block: fraction of its (token, choice) rows dropped
        by moe.capacity_factor}, "hot": {block: experts replicated by moe.hot_experts}};
        empty dicts without those options. The last micro-batch's values."""


class Step:
    """A compiled training step for one model and plan (see module docstring)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, mesh: Mesh | None = None):
        self.model = model
        self.plan = plan
        self.mesh = mesh or Mesh.from_plan(plan)
        """This rank's mesh; `Mesh.on_paper(...)` compiles for many ranks without running
        (see `mxgraph.comm.comm_report`)."""
        if self.mesh.device.type == "cpu":  # freed blocks kept for the next step, as on a GPU
            host_memory.keep_freed_memory()
        self._compiled: dict[tuple, PipelineExecutor] = {}
        self._evaluators: dict[tuple, PipelineExecutor] = {}
        """Forward-only executors (`eval_loss`), by input signature."""
        self.contexts: list[CompileContext] = []
        """One per compiled input signature: the pass records (and dump dir)."""
        self.layouts: dict[str, ParamLayout] = {}
        """Parameter name (every alias) -> how the sharding passes split it over the mesh
        (runtime/param_layout.py): tp dim and blocks, experts over "ep"."""
        self.data_parallel: DataParallel | None = None
        """This rank's gradient buckets (and ZeRO-1 shards), built after the first compile
        (runtime/data_parallel/buckets.py)."""
        self.bucket_overlaps: dict[int, BucketOverlap] = {}
        """id(executor) -> its bucket reductions during the backward
        (`Plan.overlap.dp_buckets`; runtime/data_parallel/overlap.py)."""
        self.monitor: StepMonitor | None = None
        """The slow-node monitor the step times its sections into (`set_monitor`)."""
        self.guard = Guard()
        """What `check_health` does at a non-finite loss or gradient: `Guard("stop")`
        (raise), `Guard("skip", max_skips=N)`, `Guard("rollback")`; runtime/health.py."""
        self.local_loss: torch.Tensor | None = None
        """This rank's loss of the last step before the data-parallel average."""
        self.master_weights: MasterWeights | None = None
        """`Plan(precision="bf16-mixed")`: the fp32 main gradients and master weights
        (runtime/precision.py), built with the first compile."""
        if plan.precision is not None:  # the compiled step runs on parameters of this dtype
            cast_parameters_(model, PARAM_DTYPE[plan.precision])

    def set_monitor(self, monitor: StepMonitor | None) -> None:
        """Time every later call's sections into `monitor` (`runtime/monitor/slow_node.py`; None:
        stop), on the clock of the step's device (`monitor.use_device(mesh.device)`).

        Level 0: "forward_backward" (compute: the F/B/W programs of every action),
        "grad_sync" (comm: the data-parallel reduction and loss average after the schedule,
        the sum of tied weights' gradients over pipeline ranks; with
        `Plan.overlap.dp_buckets` the buckets started during the backward are inside
        "forward_backward" and "grad_sync" is what stays exposed after it), "pipeline_wait"
        (wait: P2P receives, the last sends, the loss broadcast; pp > 1), "param_gather"
        (comm: ZeRO-1's all-gather at the start of the step, without overlap). The loop
        times "data" and "optimizer" itself (`monitor.section`), gradient clipping
        included in the latter, and calls `monitor.step()`.

        Level 1 adds timing points to the generated code (`passes/monitor_points.py`):
        layers ("fwd:layer 3", "bwd:layer 3") and collectives ("all_reduce of layer 3",
        after "all_reduce of layer 3.wait"), and "grad_sync.wait" before the reduction.
        So set a level-1 monitor before the first call or `prepare`: for a step already
        compiled without timing points it raises PlanError (no recompile: compile a new
        step). A level-0 monitor or None may be set at any time; on code compiled with
        points they then cost one Python call each and time nothing. Level 2 adds
        `torch.profiler`'s per-op times (no code change). Every rank sets the same level
        (level 1's meetings are collectives)."""
        if monitor is not None and monitor.cfg.level >= 1:
            bare = [e for e in self._compiled.values() if not e.timing_points]
            if bare:
                raise PlanError(
                    f"set_monitor: a level-{monitor.cfg.level} monitor times layers and "
                    "collectives through timing points in the generated code, and this step "
                    "was compiled without them; call set_monitor before the first step or "
                    "prepare(), or compile a new step")
        if monitor is not None:
            monitor.use_device(self.mesh.device)
        self.monitor = monitor
        for executor in self._compiled.values():
            executor.set_monitor(monitor)

    def parameters(self):
        """The parameters this rank updates, final as soon as `mx.compile` returns: build
        the optimizer on them right away.

        * One device, dp, cp: the model's own parameters.
        * tp, ep: the model's own parameter objects; the first compile cuts each one the
          passes split to this rank's part in place (same tensor objects, new `.data`), so
          an optimizer built before the first step updates what the step uses.
        * `precision="bf16-mixed"`: fp32 master copies of the (bf16) parameters above,
          named as those, whose `.grad` the step fills (fp32) while the model's keep
          `.grad = None`; the step copies them, rounded, into the model's parameters at
          its start (runtime/precision.py). Needs the graph, as pp > 1 and zero1.
        * pp > 1: this rank's stages' parameters; `zero1`: this rank's flat shards, one
          `nn.Parameter` per gradient bucket (named "zero1.bucket<i>"), whose `.grad` the
          step fills while the model's parameters keep `.grad = None` (the optimizer's
          state is then sharded). Both need the graph: pass `example=(batch...)` to
          `mx.compile` (or call `prepare(*batch)` first); PlanError otherwise.
        """
        return (p for _, p in self.named_parameters())

    def named_parameters(self):
        mixed = self.plan.precision == "bf16-mixed"
        if not self._compiled and (self.plan.zero1 or self.plan.pp > 1 or mixed):
            what = "zero1 lays the optimizer's shards out" if self.plan.zero1 else \
                "pp > 1 gives each rank its stages' parameters" if self.plan.pp > 1 else \
                "precision='bf16-mixed' keeps fp32 masters of the compiled parameters"
            raise PlanError(f"{what} over the compiled graph: pass example=(a batch, as "
                            "the step takes it) to mxgraph.compile, or call "
                            "step.prepare(*batch) before step.parameters()")
        if self.plan.zero1:
            return self._data_parallel().named_shards()
        if self.master_weights is not None:
            return self.master_weights.named_masters()
        return iter(self.model_parameters())

    def model_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters this rank holds: with pp > 1 its stages' ones (all of
        the model's before the first compile)."""
        if not self._compiled:
            return list(self.model.named_parameters())
        held = {id(p) for executor in self._compiled.values()
                for _, p in executor.model_parameters()}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) in held]

    def executors(self) -> list[PipelineExecutor]:
        return list(self._compiled.values())

    def compiled(self, *args, **kwargs) -> PipelineExecutor:
        """The executor for these inputs' signature (compiled on first use)."""
        self.prepare(*args, **kwargs)
        return self._compiled[_signature(args, kwargs)]

    def sync_parameters(self) -> None:
        """With `Plan(zero1=True)`: copy the shards the optimizer updated back into the
        model's parameters (an all-gather over the data-parallel ranks); bf16-mixed: the
        fp32 masters, rounded, into the bf16 parameters. Each step does it at its start;
        call it after the last `opt.step()` before evaluating or saving the model. Without
        either there is nothing to do."""
        if self.data_parallel is not None and self.plan.zero1:
            self.data_parallel.gather_parameters()
        elif self.master_weights is not None:
            self.master_weights.copy_to_params()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After a step: scale this rank's gradients (the shards' under zero1) so that the
        norm of the whole model's gradient, over every rank, is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` on one device; returns that norm (fp32). Every rank
        must call it (runtime/grad_norm.py)."""
        return clip_grad_norm_(self, max_norm)

    def check_health(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> Verdict:
        """After `clip_grad_norm_`, before the optimizer: the verdict of `self.guard` on this
        step's loss and gradient norm (both the same on every rank, so every rank decides
        alike), with one host sync and no collective while they are finite. Apply the
        update only when `verdict.action == "update"`; raises `NonFiniteError` under the
        "stop" policy. When not finite, one collective names the ranks and the first
        non-finite parameter. Every rank must call it. `step`: the optimizer step about
        to be taken (0-based, for the messages)."""
        def where() -> str:
            return locate([(name, grad) for name, grad, _ in named_gradient_pieces(self)],
                          self.local_loss)
        return self.guard.check(step, loss, grad_norm, where)

    def moe_stats(self) -> dict[str, dict]:
        return moe_stats.last()

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        executor = self.compiled(*args, **kwargs)
        moe_stats.clear()
        overlap = self._bucket_overlap(executor)
        if overlap is not None:
            overlap.begin()
            executor.grad_ready = overlap.grad_ready
            if self.plan.zero1:  # the shards' all-gather overlaps this forward
                overlap.gather_start()
                executor.param_needed = overlap.gathered
        elif self.plan.zero1:
            with timed(self.monitor, "param_gather", "comm"):
                self.sync_parameters()
        elif self.master_weights is not None:  # the last opt.step() updated the masters
            self.sync_parameters()
        try:
            loss = executor.step(split_microbatches(flat_inputs(args, kwargs),
                                                    self.plan.micro_batches))
        finally:
            executor.grad_ready = executor.param_needed = None
            if overlap is not None:
                overlap.gather_finish()
        self.local_loss = loss.detach()
        loss = self._reduce_data_parallel(loss, overlap)
        if self.master_weights is not None and not self.plan.zero1:
            self.master_weights.to_masters()
        return loss

    def _bucket_overlap(self, executor: PipelineExecutor) -> BucketOverlap | None:
        """With `Plan.overlap.dp_buckets` and gradients to reduce: the reductions that
        start during this step's backward (runtime/data_parallel/overlap.py)."""
        overlap = self.plan.overlap
        if overlap is None or not overlap.dp_buckets or not self._reduces():
            return None
        key = id(executor)
        if key not in self.bucket_overlaps:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            late = {id(params[name]) for name, _ in executor.shared_params}
            self.bucket_overlaps[key] = BucketOverlap(self._data_parallel(), late)
        return self.bucket_overlaps[key]

    def _reduces(self) -> bool:
        """Whether gradients are reduced after a step (dp or cp > 1, or zero1)."""
        return self.mesh.sizes["dp_cp"] > 1 or self.plan.zero1

    def eval_loss(self, *args, **kwargs) -> torch.Tensor:
        """The loss of these inputs, the model in eval mode, no gradients (compiled once
        per signature, forward only): validation on every layout (the mean over the
        data-parallel ranks, as the training step's loss)."""
        key = _signature(args, kwargs)
        if key not in self._evaluators:
            self._evaluators[key] = self._compile(args, kwargs, training=False)
        self.sync_parameters()
        loss = self._evaluators[key].step(split_microbatches(flat_inputs(args, kwargs),
                                                           self.plan.micro_batches),
                                        training=False)
        dp = self.mesh.sizes["dp"]
        if dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.mesh.group("dp"))
            loss = loss / dp
        return loss

    def prepare(self, *args, **kwargs) -> None:
        """Compile for these inputs' signature without running a step (after this,
        `parameters()` lists exactly this rank's parameters)."""
        key = _signature(args, kwargs)
        if key not in self._compiled:
            self._compiled[key] = self._compile(args, kwargs, training=True)
            self._compiled[key].set_monitor(self.monitor)
            if self.plan.precision == "bf16-mixed":  # masters of the parameters as compiled
                if self.master_weights is None:
                    self.master_weights = MasterWeights(self.model_parameters(),
                                                        self.plan.zero1)
                self._compiled[key].master = self.master_weights

    def _compile(self, args, kwargs, training: bool) -> PipelineExecutor:
        count = len(self.contexts)
        tag = (f"sig{count}" if count else "") + ("" if training else "_eval")
        ctx = CompileContext.for_plan(self.plan, tag, self.mesh)
        if training and self.monitor is not None:
            ctx.monitor_level = self.monitor.cfg.level
        self.contexts.append(ctx)
        compilation = compile_step(self.model, self.plan, self.mesh, ctx, args, kwargs,
                                   self.layouts, training=training)
        if training and ctx.dump_dir is not None:  # comm.txt: mxgraph.comm's table
            buckets = bucket_layout(compilation.executor.model_parameters(), self.layouts,
                                    self.plan, self.mesh)
            write_comm_dump(report_of(compilation.executor, buckets, self.plan.zero1),
                            ctx.dump_dir)
        return compilation.executor

    def _reduce_data_parallel(self, loss: torch.Tensor,
                              overlap: BucketOverlap | None = None) -> torch.Tensor:
        """Average loss and gradients over the data-parallel group, gradients summed over
        the context-parallel one too (each rank's cover its part of the sequence:
        passes/sharding/cp.py); bucket by bucket, reduce-scattered into the shards under zero1
        (runtime/data_parallel/buckets.py)."""
        dp = self.mesh.sizes["dp"]
        if not self._reduces():
            return loss
        if self.monitor is not None:  # level 1: every rank arrives before the reduction
            self.monitor.wait_for_peers("grad_sync")
        with timed(self.monitor, "grad_sync", "comm"):
            if overlap is not None:
                overlap.finish()
            else:
                self._data_parallel().reduce()
            if dp == 1:
                return loss
            loss = loss.clone()
            dist.all_reduce(loss, group=self.mesh.group("dp"))
        return loss / dp

    def _data_parallel(self) -> DataParallel:
        if self.data_parallel is None:
            if not self._compiled:
                raise PlanError("zero1: the parameter shards are laid out over the compiled "
                                "model's parameters; call step.prepare(*batch) or run one "
                                "step before step.parameters()")
            self.data_parallel = DataParallel.build(
                self.model_parameters(), self.layouts, self.plan, self.mesh,
                self.master_weights)
            if self.plan.overlap is not None and self.plan.overlap.copy_engine:
                self.data_parallel.lane = TransferLane(self.mesh.device)
        return self.data_parallel


def _signature(args, kwargs) -> tuple:
    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), value.dtype, value.device.type)
        return ("V", type(value).__name__, value)
    return tuple(describe(v) for v in flat_inputs(args, kwargs)) + (
        torch.is_grad_enabled(),)
