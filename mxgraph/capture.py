"""Capture: trace `loss = model(*args, **kwargs)` into a functional ATen forward graph.

The graph's placeholders are, in order, the model's parameters, buffers and lifted
constants, then the flattened user inputs. Every call_function node carries
`meta["custom"] = {"module": path, "layer": index or None}`; AOTAutograd copies that
dict onto the backward nodes it derives, so later passes know where each node came from
without looking at names.
"""
from __future__ import annotations

import contextlib
import re
import traceback
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, TensorArgument

from mxgraph.errors import TraceError
from mxgraph.functions import functions_as_ops
from mxgraph.hops import inline_regions
from mxgraph.runtime.param_layout import set_parameter


@dataclass
class Slot:
    """Where one placeholder's value comes from: a parameter, buffer, constant or input."""

    kind: str  # "param" | "buffer" | "constant" | "input"
    key: str | int  # fully qualified name, or the index in the flattened user inputs


@dataclass
class ForwardGraph:
    """A functional forward graph and what feeds each of its placeholders."""

    gm: torch.fx.GraphModule
    slots: list[Slot]
    constants: dict[str, torch.Tensor]


@contextlib.contextmanager
def whole_parameters(model: torch.nn.Module, mesh, layouts: dict):
    """Within: every parameter an earlier compile split (its name in `layouts`, a name ->
    `runtime.param_layout.ParamLayout` map) is replaced, under each of its names, by an
    uninitialised parameter of the whole shape; the parts are put back after. Capturing a
    sharded step again (new input shapes) traces the model the passes were written for:
    they shard the graph as the first time and find the parameters already cut. The values
    do not matter to tracing; the stand-ins are `torch.empty` on the parameter's device."""
    named = list(model.named_parameters(remove_duplicate=False))
    stand_ins: dict[int, torch.nn.Parameter] = {}
    for name, param in named:
        layout = layouts.get(name)
        if layout is None or not layout.sharded or id(param) in stand_ins:
            continue
        stand_ins[id(param)] = torch.nn.Parameter(
            torch.empty(layout.full_shape(param.shape, mesh.sizes), dtype=param.dtype,
                        device=param.device), requires_grad=param.requires_grad)
    for name, param in named:
        if id(param) in stand_ins:
            set_parameter(model, name, stand_ins[id(param)])
    try:
        yield
    finally:
        for name, param in named:
            if id(param) in stand_ins:
                set_parameter(model, name, param)


def capture(model: torch.nn.Module, args: tuple, kwargs: dict) -> ForwardGraph:
    """Trace the model's forward for these inputs (shapes are specialised)."""
    with _module_tracker(model) as stack, functions_as_ops():
        try:
            ep = torch.export.export(model, args, kwargs, strict=False)
        except Exception as error:  # noqa: BLE001 - re-raised with the module and line
            raise TraceError(_describe_failure(model, stack, error)) from error
    signature = ep.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        mutated = sorted(signature.buffers_to_mutate.values()) or sorted(
            signature.user_inputs_to_mutate.values())
        raise TraceError(f"forward mutates {mutated} in place; mxgraph compiles functional "
                         f"training steps: keep state updates outside forward")
    outputs = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    if len(outputs) != 1 or outputs[0].meta["val"].numel() != 1:
        raise TraceError("forward must return the scalar loss as one tensor; "
                         f"it returned {len(outputs)} output(s)")
    slots = []
    for spec in signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            slots.append(Slot("param", spec.target))
        elif spec.kind == InputKind.BUFFER:
            slots.append(Slot("buffer", spec.target))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            slots.append(Slot("constant", spec.target))
        else:
            slots.append(Slot("input", len([s for s in slots if s.kind == "input"])))
    user_leaves = pytree.tree_leaves((args, kwargs))
    _check_user_inputs(signature, user_leaves)
    gm = inline_regions(ep.graph_module)  # no_grad / autocast regions as plain nodes
    for node, slot in zip(gm.graph.find_nodes(op="placeholder"), slots, strict=True):
        node.meta["mx_slot_kind"], node.meta["mx_slot_key"] = slot.kind, slot.key
    annotate_modules(gm)
    return ForwardGraph(gm=gm, slots=slots, constants=dict(ep.constants))


def model_tensors(model: torch.nn.Module) -> tuple[dict, dict]:
    """(parameters, buffers) by every name, aliases of tied weights included."""
    return (dict(model.named_parameters(remove_duplicate=False)),
            dict(model.named_buffers(remove_duplicate=False)))


def slot_tensor(slot: Slot, tensors: tuple[dict, dict], constants: dict) -> torch.Tensor:
    """The parameter, buffer or constant that feeds a slot of that kind."""
    params, buffers = tensors
    if slot.kind == "param":
        return params[slot.key]
    if slot.kind == "buffer":
        return buffers[slot.key]
    return constants[slot.key]


def flat_inputs(args: tuple, kwargs: dict) -> list:
    """The user inputs in the order of the graph's input placeholders."""
    return pytree.tree_leaves((args, kwargs))


def _check_user_inputs(signature, leaves) -> None:
    user_specs = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user_specs) != len(leaves):
        raise TraceError(f"forward takes {len(leaves)} input leaves but the traced graph "
                         f"has {len(user_specs)}; pass tensors, ints and floats only")
    for spec, leaf in zip(user_specs, leaves, strict=True):
        if isinstance(spec.arg, TensorArgument) != isinstance(leaf, torch.Tensor):
            raise TraceError(f"input {spec.arg} does not match the value {type(leaf)}")


_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_LIFTED = re.compile(r"fake tensor in the exported program constant.*?model attribute: "
                     r"([\w.]*?)\.?lifted_tensor_\d+", re.S)


def annotate_modules(gm: torch.fx.GraphModule) -> None:
    """Set meta["custom"]["module"] and ["layer"] from the node's module stack.

    The layer is the first integer in the innermost module path (a block inside a
    ModuleList or Sequential); nodes outside any repeated block get None.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        path = path.removeprefix("L['self'].")
        match = _INDEX.search(path)
        custom = dict(node.meta.get("custom") or {})
        custom.update(module=path, layer=int(match.group(1)) if match else None)
        node.meta["custom"] = custom


@contextlib.contextmanager
def _module_tracker(model: torch.nn.Module):
    """Keep the stack of modules whose forward is running, to name where tracing failed."""
    stack: list[str] = []
    handles = []
    for name, module in model.named_modules():
        def pre(mod, inputs, name=name):
            stack.append(f"{name or '<root>'} ({type(mod).__name__})")

        def post(mod, inputs, output):
            if stack:
                stack.pop()
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _has_submodule(model: torch.nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _describe_failure(model, stack: list[str], error: Exception) -> str:
    where = stack[-1] if stack else f"<root> ({type(model).__name__})"
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and "/mxgraph/" not in f.filename]
    line = f" at {frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    if isinstance(error, TraceError):  # mxgraph's own refusal: it says what to change
        return f"module {where}{line}: {error}"
    lifted = _LIFTED.search(str(error))
    if lifted:  # torch.export's check after tracing: no module stack is left to name
        path = lifted.group(1)
        owner = model.get_submodule(path) if _has_submodule(model, path) else model
        return (f"cannot trace module {path or '<root>'} ({type(owner).__name__}): a tensor "
                f"its forward creates (torch.export's `{lifted.group(0).rsplit(' ', 1)[-1]}`) "
                "became a constant holding a traced value; torch.export cannot follow how it "
                "was made. Create that tensor once in __init__ (a buffer), or from the inputs "
                "with torch ops")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"cannot trace module {where}{line}: {type(error).__name__}: {first}. "
            "mxgraph traces with torch.export (non-strict): avoid Python branches on tensor "
            "values and .item(); use torch._check for data-dependent sizes")
