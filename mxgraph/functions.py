"""A user's custom `torch.autograd.Function` keeps its own backward through capture.

Non-strict `torch.export` runs a Function's `forward` inline: the graph holds its ATen ops,
and AOTAutograd later differentiates those, not the Function's `backward`. A straight-through
estimator (round in the forward, identity in the backward) would then get a zero gradient, and
PhiMoE's sparse-mixer router gradients would be silently wrong.

Within `functions_as_ops()`, `Function.apply` of a Function defined outside torch records one
`mxgraph::autograd_function` node instead. Its forward runs the Function's `forward` (no
autograd inside, as in eager); its backward, which AOTAutograd traces into the backward graph,
runs the `forward` again on the saved inputs to rebuild what the Function saved on `ctx`, then
its `backward`. The recomputation costs one more forward of the Function; a Function whose
forward draws random numbers would draw them again, and is refused.

The node's first argument is a key into `CALLS`: the Function class and the arguments that are
not tensors, so the generated code and the backward find them in this process.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.autograd.function import Function
from torch.utils._python_dispatch import TorchDispatchMode

from mxgraph.errors import TraceError


@dataclass
class Call:
    """One traced call site: the Function, its arguments with each tensor as a `None` hole
    (`tensor_at` lists the holes), and the structure of its outputs once the fake run saw it."""

    function: type
    args: tuple
    tensor_at: tuple[int, ...]
    where: str
    out_spec: pytree.TreeSpec | None = None
    needs_grad: tuple[bool, ...] = field(default_factory=tuple)


CALLS: dict[str, Call] = {}
_COUNTER = itertools.count()


class _Ctx:
    """What a Function's `forward` and `backward` see as `ctx` outside autograd."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value

    def mark_dirty(self, *tensors):
        raise TraceError("a custom autograd.Function that modifies its inputs in place "
                         "(ctx.mark_dirty) cannot be compiled; return a new tensor instead")


def _arguments(call: Call, tensors: list) -> list:
    args = list(call.args)
    for position, tensor in zip(call.tensor_at, tensors, strict=True):
        args[position] = tensor
    return args


def _forward(call: Call, ctx: _Ctx, args: list):
    """Run the Function's forward (either style: `forward(ctx, ...)`, or `forward(...)` with
    a `setup_context`)."""
    function = call.function
    if _overrides(function, "setup_context"):
        output = function.forward(*args)
        function.setup_context(ctx, tuple(args), output)
        return output
    return function.forward(ctx, *args)


def _overrides(function: type, name: str) -> bool:
    from torch.autograd.function import _SingleLevelFunction
    return getattr(function, name) is not getattr(_SingleLevelFunction, name)


def _outputs(call: Call, output, inputs: list) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(output)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise TraceError(f"custom autograd.Function {call.where} returns "
                         f"{[type(leaf).__name__ for leaf in leaves]}; mxgraph compiles a "
                         "Function whose outputs are all tensors")
    call.out_spec = spec
    # an op's outputs may not alias its inputs or each other: copy a view or a returned input
    seen = {id(t) for t in inputs}
    out = []
    for leaf in leaves:
        out.append(leaf.clone() if leaf._base is not None or id(leaf) in seen else leaf)
        seen.add(id(out[-1]))
    return out


@torch.library.custom_op("mxgraph::autograd_function", mutates_args=())
def autograd_function(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The forward of the Function call `CALLS[key]` on its tensor arguments."""
    call = CALLS[key]
    with torch.no_grad():
        return _outputs(call, _forward(call, _Ctx(call.needs_grad), _arguments(call, tensors)),
                        tensors)


class _NoRandom(TorchDispatchMode):
    """Refuses a random op: the backward runs the forward again and would draw anew."""

    def __init__(self, call: Call):
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise TraceError(f"custom autograd.Function {self.call.where} draws random numbers "
                             f"({func}) in its forward; mxgraph recomputes that forward for "
                             "the backward and would draw different ones: pass the random "
                             "tensor in as an argument")
        return func(*args, **(kwargs or {}))


@autograd_function.register_fake
def _(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    call = CALLS[key]
    with _NoRandom(call):
        output = _forward(call, _Ctx(call.needs_grad), _arguments(call, tensors))
    return _outputs(call, output, tensors)


def _setup(ctx, inputs, output) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.outputs = [(t.shape, t.dtype, t.device) for t in output]
    ctx.save_for_backward(*tensors)


def _backward(ctx, grads):
    call = CALLS[ctx.key]
    tensors = list(ctx.saved_tensors)
    inner = _Ctx(call.needs_grad)
    with torch.no_grad():
        _forward(call, inner, _arguments(call, tensors))
    if inner.materialize_grads:  # as autograd does for a Function: zeros for unused outputs
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.outputs, strict=True)]
    result = call.function.backward(inner, *grads)
    result = result if isinstance(result, tuple) else (result,)
    out = []
    for position, tensor in zip(call.tensor_at, tensors, strict=True):
        grad = result[position] if position < len(result) else None
        if not (tensor.is_floating_point() or tensor.is_complex()):
            grad = None  # an index or mask input: autograd ignores what backward returns
        if grad is not None and grad.shape != tensor.shape:
            raise TraceError(f"custom autograd.Function {call.where}: backward returned a "
                             f"gradient of shape {tuple(grad.shape)} for an input of shape "
                             f"{tuple(tensor.shape)}")
        out.append(grad)
    return None, out


autograd_function.register_autograd(_backward, setup_context=_setup)


def _traced_apply(function: type, *args):
    """`Function.apply` during capture: one `mxgraph::autograd_function` node."""
    tensor_at = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    holes = tuple(None if i in tensor_at else a for i, a in enumerate(args))
    if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(holes)):
        raise TraceError(f"custom autograd.Function {_where(function)} takes tensors inside a "
                         "list or dict argument; pass each tensor as its own argument")
    key = f"{function.__qualname__}#{next(_COUNTER)}"
    tensors = [args[i] for i in tensor_at]
    needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    CALLS[key] = Call(function, holes, tensor_at, _where(function), needs_grad=needs)
    outputs = torch.ops.mxgraph.autograd_function(key, tensors)
    return pytree.tree_unflatten(list(outputs), CALLS[key].out_spec)


def _where(function: type) -> str:
    return f"{function.__module__}.{function.__qualname__}"


@contextlib.contextmanager
def functions_as_ops():
    """Within: a Function defined outside torch is recorded as one op with its own backward
    (torch's own Functions, e.g. reentrant checkpointing, run inline as before)."""
    original = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if kwargs or cls.__module__.split(".")[0] == "torch" or not _overrides(cls, "backward"):
            return original.__func__(cls, *args, **kwargs)
        return _traced_apply(cls, *args)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original
