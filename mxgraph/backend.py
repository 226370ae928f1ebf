"""`torch.compile(model, backend="mxmaca")`: mxgraph's passes behind TorchDynamo.

Dynamo hands over each captured region (graph breaks make several). For each region:
its functional ATen forward graph is taken with AOTAutograd, the driver's forward passes
run on it (`driver.run_graph_passes`), then AOTAutograd derives the joint graph; the
partition function runs the driver's joint passes before the min-cut partitioner splits it
into forward and backward. Registered under the `torch_dynamo_backends` entry point, so no
import is needed. Options: `torch.compile(..., options={"plan": Plan(...)})` (one-device
plans only).

A region AOTAutograd cannot export as a plain function (it mutates a buffer or an input,
say) runs without the forward passes: a warning names the region and the exception, the
dump summary counts it (`fallback` record), and `MXGRAPH_STRICT=1` raises instead.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.aot_autograd import aot_export_module
from torch._functorch.partitioners import min_cut_rematerialization_partition

from mxgraph.context import CompileContext
from mxgraph.driver import check_plan, run_graph_passes
from mxgraph.errors import TraceError
from mxgraph.passes.runner import record_graphs
from mxgraph.plan import Plan


class BackendFallbackWarning(UserWarning):
    """A region ran without mxgraph's forward passes (see the module docstring)."""


def _partition(joint_module, joint_inputs, *, ctx, **kwargs):
    record_graphs(ctx, "grad", "step", [("joint", joint_module)], 0.0)
    joint_module = run_graph_passes("joint", joint_module, ctx)
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def _boxed(gm, example_inputs):
    return make_boxed_func(gm.forward)


def mxmaca_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                   **_):
    """A TorchDynamo backend: forward passes, AOTAutograd, joint passes, fx codegen."""
    plan = (options or {}).get("plan") or Plan()
    check_plan(plan, 1)
    ctx = CompileContext.for_plan(plan, tag=f"region_{id(gm):x}")
    forward = _functional_forward(gm, example_inputs, ctx)
    if forward is not None:
        record_graphs(ctx, "capture", "step", [("forward", forward)], 0.0)
        forward = run_graph_passes("forward", forward, ctx)
    region = forward if forward is not None else gm
    compiler = aot_autograd(fw_compiler=_boxed, bw_compiler=_boxed,
                            partition_fn=functools.partial(_partition, ctx=ctx),
                            keep_inference_input_mutations=True)
    return compiler(region, example_inputs)


def _functional_forward(gm, example_inputs, ctx: CompileContext):
    """The region as a functional ATen graph (forward only), or None (after a warning, or
    an error under MXGRAPH_STRICT=1) when it cannot be one."""
    try:
        forward, signature = aot_export_module(gm, list(example_inputs), trace_joint=False)
    except Exception as error:  # noqa: BLE001 - reported below, never swallowed silently
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    else:
        mutated = sorted(signature.buffers_to_mutate.values()) + sorted(
            signature.user_inputs_to_mutate.values())
        if not mutated:
            return forward
        reason = f"it mutates {mutated} in place"
    message = (f"mxmaca: region {ctx.dump_dir.name if ctx.dump_dir else hex(id(gm))} runs "
               f"without mxgraph's forward passes (no sharding, no fusion): {reason}")
    if os.environ.get("MXGRAPH_STRICT") == "1":
        raise TraceError(message + "; unset MXGRAPH_STRICT to fall back with a warning")
    warnings.warn(message + "; set MXGRAPH_STRICT=1 to make this an error",
                  BackendFallbackWarning, stacklevel=2)
    record_graphs(ctx, "fallback", "step", [("region", gm)], 0.0, reason=reason.replace(" ", "_"))
    return None
