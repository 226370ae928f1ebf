"""Grad: derive the joint forward+backward graph of a forward graph with AOTAutograd.

`aot_export_joint_with_descriptors` traces the forward graph (through an fx Interpreter,
so node meta, including meta["custom"], reaches the joint) and its backward into one
functional graph. Its placeholders and outputs carry descriptors; `JointGraph` turns
them into plain lists: what feeds each input, and which parameter each output's
gradient belongs to.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from mxgraph.capture import ForwardGraph, Slot
from mxgraph.errors import TraceError


@dataclass
class JointGraph:
    """A joint graph with flat inputs; outputs are [loss, grad, grad, ...]."""

    gm: torch.fx.GraphModule
    inputs: list[Slot]  # kind "tangent" (key = output index) for incoming gradients
    grad_of: list[Slot | None]
    """Per output after the forward outputs: the parameter (kind "param") or input
    (kind "input") it is the gradient of; None where there is no gradient."""
    num_forward_outputs: int = 1


class _GraphModule(torch.nn.Module):
    """Holds the model's tensors under plain names and runs the forward graph on them."""

    def __init__(self, forward: ForwardGraph, tensors: list[torch.Tensor]):
        super().__init__()
        self.graph_module = forward.gm
        self.tensor_slots = [s for s in forward.slots if s.kind != "input"]
        for i, (slot, tensor) in enumerate(zip(self.tensor_slots, tensors, strict=True)):
            if slot.kind == "param":
                self.register_parameter(f"t{i}", tensor)
            else:
                self.register_buffer(f"t{i}", tensor)

    def forward(self, *inputs):
        tensors = [getattr(self, f"t{i}") for i in range(len(self.tensor_slots))]
        return torch.fx.Interpreter(self.graph_module).run(*tensors, *inputs)


def build_joint(forward: ForwardGraph, tensors: list[torch.Tensor], inputs: list,
                num_outputs: int = 1) -> JointGraph:
    """Trace forward + backward. `tensors` feed the non-input slots, in slot order;
    `inputs` that require grad get a gradient output. The forward has `num_outputs`
    outputs (the loss, or a pipeline stage's activations)."""
    holder = _GraphModule(forward, tensors)
    # A fake mode with a ShapeEnv lets data-dependent sizes (MoE token counts) stay
    # symbolic (unbacked) instead of failing; every input shape stays static. Tensors that
    # are fake already (a model compiled without memory: mxgraph.comm) keep their mode.
    modes = [m for m in map(maybe_get_fake_mode, list(tensors) + list(inputs)) if m is not None]
    fake_mode = modes[0] if modes else FakeTensorMode(shape_env=ShapeEnv(),
                                                      allow_non_fake_inputs=True)
    fake_inputs = [_fake(fake_mode, x)
                   if isinstance(x, torch.Tensor) else x for x in inputs]
    with contextlib.ExitStack() as stack:
        try:
            joint = aot_export_joint_with_descriptors(stack, holder, tuple(fake_inputs))
        except Exception as error:  # noqa: BLE001 - re-raised with context
            raise TraceError(f"cannot derive the backward graph: {type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}") from error
        gm = joint.graph_module
    gm.graph.set_codegen(torch.fx.graph.CodeGen())  # flat (*args) -> list calling convention
    gm.recompile()
    slots = []
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, (ParamAOTInput, BufferAOTInput)):
            slots.append(holder.tensor_slots[int(desc.target[1:])])
        elif isinstance(desc, PlainAOTInput):
            slots.append(Slot("input", desc.idx))
        elif isinstance(desc, TangentAOTInput):
            slots.append(Slot("tangent", desc.output.idx))
        else:
            raise TraceError(f"joint graph input {node.name} has an unsupported kind {desc}")
    output = gm.graph.find_nodes(op="output")[0]
    descs = output.meta.get("desc") or []
    if len(descs) < num_outputs or not all(isinstance(d, PlainAOTOutput)
                                             for d in descs[:num_outputs]):
        raise TraceError(f"the joint graph's first {num_outputs} outputs are not the "
                         f"forward's: {descs[:num_outputs]}")
    grad_of = []
    for desc in descs[num_outputs:]:
        if desc is None:  # no gradient (an integer input, a frozen parameter)
            grad_of.append(None)
        elif isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, ParamAOTInput):
            grad_of.append(holder.tensor_slots[int(desc.grad_of.target[1:])])
        elif isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, PlainAOTInput):
            grad_of.append(Slot("input", desc.grad_of.idx))
        else:
            raise TraceError(f"unexpected joint graph output {desc} in {descs}")
    return JointGraph(gm=gm, inputs=slots, grad_of=grad_of, num_forward_outputs=num_outputs)


def _fake(fake_mode, value):
    if not isinstance(value, torch.Tensor):
        return value
    fake = fake_mode.from_tensor(value, static_shapes=True)
    return fake.requires_grad_(value.requires_grad) if fake.is_floating_point() else fake
