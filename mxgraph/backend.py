"""`torch.compile(model, backend="mxmaca")`: mxgraph's passes behind TorchDynamo.

Dynamo hands over each captured region (graph breaks make several). For each region:
its functional ATen forward graph is taken with AOTAutograd, the driver's forward passes
run on it (`driver.run_graph_passes`), then AOTAutograd derives the joint graph; the
partition function runs the driver's joint passes before the min-cut partitioner splits it
into forward and backward. Registered under the `torch_dynamo_backends` entry point, so no
import is needed. Options: `torch.compile(..., options={"plan": Plan(...)})` (one-device
plans only). The forward and backward compilers are `plan.codegen_for` the region's device:
by default Inductor on a GPU (so switching from `backend="inductor"` loses none of its
fusion) and fx Python code on the CPU; `Plan(codegen="inductor")` asks for Inductor there.

The region's functional forward is differentiated again by AOTAutograd, so the ops
functionalization leaves without an autograd formula are decomposed into differentiable ones
as it is exported (`FORWARD_DECOMPOSITIONS`: `aten.copy`, from an in-place `copy_` into a
slice, as deepseek_v3's key assembly does). The export runs without gradients, so on a GPU
SDPA takes its inference kernels; each is asked for the log-sum-exp its backward will read
(`keep_logsumexp`).

A region AOTAutograd cannot export as a plain function (it mutates a buffer or an input,
say, calls a custom `autograd.Function`, whose backward only the region as Dynamo gave it
keeps, or its export takes other inputs than the region), or whose passed forward
AOTAutograd then fails to differentiate (an attention mask that needs a gradient, exported
as the CPU flash kernel that has none), runs without the forward passes: a warning names
the region and the exception, the dump summary counts it (`fallback` record), and
`MXGRAPH_STRICT=1` raises instead.
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

from mxgraph.codegen import inductor
from mxgraph.context import CompileContext
from mxgraph.driver import check_plan, run_graph_passes
from mxgraph.errors import TraceError
from mxgraph.passes.cleanup import safe_views_pass
from mxgraph.passes.runner import record_graphs
from mxgraph.plan import Plan
from mxgraph.runtime import host_memory


class BackendFallbackWarning(UserWarning):
    """A region ran without mxgraph's forward passes (see the module docstring)."""


def _partition(joint_module, joint_inputs, *, ctx, **kwargs):
    record_graphs(ctx, "grad", "step", [("joint", joint_module)], 0.0)
    joint_module = run_graph_passes("joint", joint_module, ctx)
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def _partition_whole(joint_module, joint_inputs, **kwargs):
    """The partition of a region run without the passes: its views made layout-safe first
    (`safe_views_pass`: a backward `view` that the fake strides allowed and the kernels'
    real layout does not, as DOGE's `softplus_backward`; plain AOTAutograd fails there)."""
    return min_cut_rematerialization_partition(safe_views_pass(joint_module, None), joint_inputs,
                                               **kwargs)


def _boxed(gm, example_inputs):
    return make_boxed_func(gm.forward)


def _lowered(gm, example_inputs, *, title: str, backward: bool):
    """Inductor as the forward or backward compiler, through codegen's lowering
    (`codegen/inductor.py`); a graph Inductor refuses runs as fx code, loudly. A backward
    is compiled as one: it may write over the saved values AOTAutograd donates to it."""
    try:
        fn, _ = inductor.compile_graph(gm, list(example_inputs), backward=backward)
    except inductor.NotLowered as reason:
        inductor.fall_back(title, reason)
        return _boxed(gm, example_inputs)
    return make_boxed_func(fn)


def _compilers(plan: Plan, region: str, device_type: str) -> dict:
    """fw_compiler and bw_compiler for `plan.codegen_for(device_type)`."""
    if plan.codegen_for(device_type) != "inductor":
        return {"fw_compiler": _boxed, "bw_compiler": _boxed}
    return {f"{kind}_compiler": functools.partial(_lowered, title=f"{region}, {name}",
                                                  backward=kind == "bw")
            for kind, name in (("fw", "forward"), ("bw", "backward"))}


def mxmaca_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                   **_):
    """A TorchDynamo backend: forward passes, AOTAutograd, joint passes, then fx code or
    Inductor (`plan.codegen`)."""
    plan = (options or {}).get("plan") or Plan()
    check_plan(plan, 1)
    region = f"region_{id(gm):x}"
    ctx = CompileContext.for_plan(plan, tag=region)
    forward = _functional_forward(gm, example_inputs, ctx)
    if forward is not None:
        record_graphs(ctx, "capture", "step", [("forward", forward)], 0.0)
        # AOTAutograd traces the passed forward again from its fake strides, and a view the
        # export recorded can meet another layout there (GPT-Neo's matmul of a transposed
        # key: a [2, 4, 16, 16] expand with strides (1024, 16, 1, 64) viewed as [8, 16, 16]);
        # views that merge dims reshape, as in the evaluation pipeline
        forward = safe_views_pass(run_graph_passes("forward", forward, ctx), ctx)
        forward.recompile()
    devices = [v.device.type for v in example_inputs if isinstance(v, torch.Tensor)]
    device_type = devices[0] if devices else "cpu"
    if device_type == "cpu":  # freed blocks kept for the next step, as on a GPU
        host_memory.keep_freed_memory()
    compilers = _compilers(plan, region, device_type)
    compiler = aot_autograd(**compilers, partition_fn=functools.partial(_partition, ctx=ctx),
                            keep_inference_input_mutations=True)
    if forward is None:
        return compiler(gm, example_inputs)
    try:
        return compiler(forward, example_inputs)
    except Exception as error:  # noqa: BLE001 - reported by _fall_back, never swallowed silently
        _fall_back(ctx, gm, f"differentiating its passed forward failed: {_first_line(error)}")
    return aot_autograd(**compilers, partition_fn=_partition_whole,
                        keep_inference_input_mutations=True)(gm, example_inputs)


def _differentiable_copy(self, src, non_blocking=False):
    """`aten.copy` (what functionalization makes of an in-place `copy_`, as in
    `buf[..., :n].copy_(x)`) as ops autograd can differentiate: `src` converted to `self`'s
    dtype and device, broadcast to its shape, in a fresh tensor laid out like `self` when
    `self` is dense. The values are the copy's, bitwise; the gradient reaches `src` (summed
    over the broadcast dims, cast back), and none reaches `self`, as for eager `copy_`."""
    value = src.to(dtype=self.dtype, device=self.device).expand(self.shape)
    order = _dense_order(self)
    if order is None or order == sorted(order):
        return value.clone(memory_format=torch.contiguous_format)
    inverse = sorted(range(self.dim()), key=order.__getitem__)
    return value.permute(order).clone(memory_format=torch.contiguous_format).permute(inverse)


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dims of `t` from the largest stride down when its elements fill its storage
    without gaps or overlap (a permutation of a contiguous tensor), else None."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    expected = 1
    for d in reversed(order):
        if t.size(d) != 1 and t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return order


FORWARD_DECOMPOSITIONS = {torch.ops.aten.copy.default: _differentiable_copy}
"""Ops that functionalizing the region leaves and that have no autograd formula (the region
graph is differentiated again by AOTAutograd), each as differentiable ops."""


def _functional_forward(gm, example_inputs, ctx: CompileContext):
    """The region as a functional ATen graph (forward only) that AOTAutograd can
    differentiate again (`FORWARD_DECOMPOSITIONS`), or None (after a warning, or an error
    under MXGRAPH_STRICT=1) when it cannot be one: a custom `autograd.Function` (Dynamo's
    `autograd_function_apply`) keeps its own backward only in the region as Dynamo gave it."""
    custom = sorted({_call_site(n) for n in gm.graph.find_nodes(
        op="call_function", target=torch.ops.higher_order.autograd_function_apply)})
    try:
        if custom:
            raise TraceError(f"it calls a custom autograd.Function ({'; '.join(custom)}), whose "
                             f"backward a functional forward graph would lose")
        forward, signature = aot_export_module(gm, list(example_inputs), trace_joint=False,
                                               decompositions=FORWARD_DECOMPOSITIONS)
    except Exception as error:  # noqa: BLE001 - reported below, never swallowed silently
        reason = _first_line(error)
    else:
        mutated = sorted(signature.buffers_to_mutate.values()) + sorted(
            signature.user_inputs_to_mutate.values())
        inputs = [n.name for n in forward.graph.find_nodes(op="placeholder")]
        if mutated:
            reason = f"it mutates {mutated} in place"
        elif len(inputs) != len(example_inputs):
            # torch 2.13's export adds an input to some regions (a `tangents_1` to AXK2's)
            reason = (f"its exported forward takes {len(inputs)} inputs for the region's "
                      f"{len(example_inputs)} (the last: {inputs[-1]})")
        else:
            keep_logsumexp(forward)
            return forward
    _fall_back(ctx, gm, reason)
    return None


LOGSUMEXP_ATTENTION = (torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                       torch.ops.aten._scaled_dot_product_efficient_attention.default)
"""GPU attention kernels that return their log-sum-exp only when asked (`compute_log_sumexp`)."""


def keep_logsumexp(forward: torch.fx.GraphModule) -> None:
    """Ask every GPU attention call of `forward` for its log-sum-exp. The forward is
    exported without gradients (`trace_joint=False` runs under no_grad), so SDPA chose its
    inference form; AOTAutograd then differentiates it, and the backward reads the
    log-sum-exp the inference form never returns (Inductor fails on the missing tensor)."""
    for node in forward.graph.nodes:
        if node.op == "call_function" and node.target in LOGSUMEXP_ATTENTION:
            names = [a.name for a in node.target._schema.arguments]
            where = names.index("compute_log_sumexp")
            if where < len(node.args):
                node.args = node.args[:where] + (True,) + node.args[where + 1:]
            else:
                node.kwargs = {**node.kwargs, "compute_log_sumexp": True}
    forward.recompile()


def _fall_back(ctx: CompileContext, gm, reason: str) -> None:
    """Warn (or raise under MXGRAPH_STRICT=1) that region `gm` runs without the passes, and
    record it in the dump summary."""
    message = (f"mxmaca: region {ctx.dump_dir.name if ctx.dump_dir else hex(id(gm))} runs "
               f"without mxgraph's forward passes (no sharding, no fusion): {reason}")
    if os.environ.get("MXGRAPH_STRICT") == "1":
        raise TraceError(message + "; unset MXGRAPH_STRICT to fall back with a warning")
    warnings.warn(message + "; set MXGRAPH_STRICT=1 to make this an error",
                  BackendFallbackWarning, stacklevel=3)
    record_graphs(ctx, "fallback", "step", [("region", gm)], 0.0, reason=reason.replace(" ", "_"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _call_site(node) -> str:
    """`file:line `code`` of the model line that made `node` (Dynamo's stack trace), else its name."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
             if line.strip() and not set(line.strip()) <= set("^~ ")]
    if len(lines) >= 2 and lines[-2].startswith("File "):
        where = lines[-2].split('"')
        line = lines[-2].rsplit("line ", 1)[-1].split(",")[0]
        return f"{where[1].rsplit('/', 1)[-1] if len(where) > 1 else '?'}:{line} `{lines[-1]}`"
    return node.name
