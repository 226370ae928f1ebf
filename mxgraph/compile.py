"""`mxgraph.compile(model, plan)`: the compiled training step (`step.py`)."""
from __future__ import annotations

import torch

from mxgraph.driver import check_plan
from mxgraph.errors import PlanError
from mxgraph.plan import Plan
from mxgraph.runtime.cluster.launch import init_from_environment
from mxgraph.step import Step, TrainingStep
from mxgraph.step_adaptive import AdaptiveMoEStep

__all__ = ["Step", "TrainingStep", "compile"]


def compile(model: torch.nn.Module, plan: Plan | None = None, *,  # noqa: A001
            example: tuple | None = None, example_kwargs: dict | None = None) -> TrainingStep:
    """Compile `model`'s training step under `plan` (default: one device, no rewrites).

    `model.forward(*args, **kwargs)` must return the scalar loss. Parameters may be fp32
    or bf16. `example` (and `example_kwargs`): one batch as the step will take it (this
    rank's, with the shapes of the real batches; the values are not used): the step is
    compiled for it now, so `step.parameters()` is exactly this rank's parameters from the
    start (needed for pp > 1 and zero1). Returns a `Step` (an `AdaptiveMoEStep` with
    `moe.adaptive_recompute_threshold`); both implement `TrainingStep`. Under torchrun the
    default process group is initialised from the environment if nobody did.
    """
    init_from_environment()  # under torchrun without init_process_group: join the job
    plan = plan or Plan()
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"mxgraph.compile takes an nn.Module, got {type(model).__name__}")
    check_plan(plan, _world_size())
    if plan.moe.adaptive_recompute_threshold is not None:
        step = AdaptiveMoEStep(model, plan)
    else:
        step = Step(model, plan)
    if example is not None or example_kwargs:
        step.prepare(*(example or ()), **(example_kwargs or {}))
    return step


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
