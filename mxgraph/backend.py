"""`torch.compile(model, backend="mxmaca")`: mxgraph's passes behind TorchDynamo.

Dynamo hands over each captured region (graph breaks make several). For each region:
its functional ATen forward graph is taken with AOTAutograd, mxgraph's forward passes
run on it, then AOTAutograd derives the joint graph; the partition function runs the
joint passes before the min-cut partitioner splits it into forward and backward.
Registered under the `torch_dynamo_backends` entry point, so no import is needed.
Options: `torch.compile(..., options={"plan": Plan(...)})` (one-device plans only).
"""
from __future__ import annotations

import functools

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import aot_export_module
from torch._functorch.partitioners import min_cut_rematerialization_partition

from mxgraph.context import CompileContext
from mxgraph.passes.pipeline import FORWARD_PASSES, JOINT_PASSES, check_pass_names
from mxgraph.passes.runner import record, run_pass
from mxgraph.plan import Plan, require_built


def _run_passes(gm, passes, ctx):
    for spec in passes:
        gm = run_pass(spec, gm, ctx)
    return gm


def _partition(joint_module, joint_inputs, *, ctx, **kwargs):
    record(ctx, "grad", "joint", joint_module, 0.0)
    joint_module = _run_passes(joint_module, JOINT_PASSES, ctx)
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def _boxed(gm, example_inputs):
    from torch._functorch._aot_autograd.utils import make_boxed_func
    return make_boxed_func(gm.forward)


def mxmaca_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                   **_):
    """A TorchDynamo backend: forward passes, AOTAutograd, joint passes, fx codegen."""
    plan = (options or {}).get("plan") or Plan()
    plan.validate(1)
    check_pass_names(plan.disable_passes)
    require_built(plan)
    ctx = CompileContext.for_plan(plan, tag=f"region_{id(gm):x}")
    forward = _functional_forward(gm, example_inputs)
    if forward is not None:
        record(ctx, "capture", "forward", forward, 0.0)
        forward = _run_passes(forward, FORWARD_PASSES, ctx)
    region = forward if forward is not None else gm
    compiler = aot_autograd(fw_compiler=_boxed, bw_compiler=_boxed,
                            partition_fn=functools.partial(_partition, ctx=ctx),
                            keep_inference_input_mutations=True)
    return compiler(region, example_inputs)


def _functional_forward(gm, example_inputs):
    """The region as a functional ATen graph (forward only), or None when it has
    mutations or non-tensor outputs that a plain function cannot express."""
    try:
        forward, signature = aot_export_module(gm, list(example_inputs), trace_joint=False)
    except Exception:  # noqa: BLE001 - fall back to the region as Dynamo gave it
        return None
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        return None
    return forward
