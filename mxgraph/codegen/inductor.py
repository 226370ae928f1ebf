"""Inductor codegen (`Plan(codegen="inductor")`): a program's graph lowered to fused kernels.

A program's graph (a stage's F, B or W piece of its joint graph, already functional) is
traced once more with Inductor's decomposition table (`make_fx` on the fake values its
placeholders carry), so that every op is one Inductor lowers, and compiled by
`compile_fx_inner`: C++/OpenMP loops on the CPU, Triton kernels on `cuda`. mxgraph's fused
kernels stay calls to their Triton on `cuda` (Inductor's fallback kernels); on the CPU they
are traced as their plain-torch references (`kernels.cpu_decompositions`), which Inductor
fuses with their neighbours, except bias-dropout-add, whose index-hashed mask Inductor's C++
codegen takes too long over (`kernels.OPAQUE_ON_CPU`). Its other custom ops (the
vocabulary-parallel loss, offload, expert counts) stay calls to their own implementations.
Program inputs and outputs that are tuples (a multi-output op's value handed from F to B) are flattened
for Inductor and rebuilt around it.

Collectives (tp, sp, cp) are functional ops Inductor lowers itself: each start stays where
the graph issues it and each wait where the graph waits.

A program whose graph calls back into the executor (data-parallel buckets announced during
the backward, ZeRO-1 parameters awaited at first use, level-1 timing points) is cut at those
calls, each piece lowered by itself and the calls made between them (`segments.py`).

So is a program the schedule pauses before its collective waits (DualPipeV's F&B
interleave): it is cut before each wait and runs as a generator that yields there.

A B or W program may write its results over the saved values that die with it (their
buffers donated, as torch.compile's backward does with AOTAutograd's donated buffers; which
ones: `donation.py`): no fresh allocation, and the write lands where the read just was.

The retrace runs inside the program's own fake mode, whose shape environment holds the
data-dependent sizes of expert parallelism (tokens received from each rank), so factory ops
of those sizes stay symbolic and a size handed from F to W is an input like a tensor.

Not lowered, run as Python codegen instead (`python.py`), with a warning naming the program
(an error under `MXGRAPH_STRICT=1`): one with an input that is neither a tensor nor a size,
or a value without a recorded example, and one Inductor refuses.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_unflatten

from mxgraph.codegen import segments
from mxgraph.errors import TraceError
from mxgraph.runtime.pipeline.programs import Program


class NotLowered(Exception):
    """Why a program stays Python codegen."""


def lower(program: Program, pauses: bool = False,
          donated: frozenset = frozenset()) -> tuple[object, object, str]:
    """(the compiled function, its generator form that yields before each collective wait
    or None, Inductor's output code) for `program`; NotLowered when it cannot be lowered
    (the reason in its message). `pauses`: the schedule runs programs step by step, pausing
    before each collective wait (DualPipeV's F&B interleave). `donated`: inputs (of
    `program.inputs`) whose buffers it may write over, dead once it ran (`donation.py`).
    A program that calls back into the executor or pauses is lowered in segments
    (`segments.py`)."""
    gm = program.gm
    plan = segments.cut(gm, pauses)
    placeholders = gm.graph.find_nodes(op="placeholder")
    dying = {p for p, node in zip(placeholders, program.inputs, strict=True) if node in donated}
    if not plan:
        examples = [n.meta.get("val") for n in placeholders]
        fn, code = compile_graph(gm, examples, [n in dying for n in placeholders])
        return fn, None, code
    compiled, codes = [], []
    for i, part in enumerate(plan):
        if isinstance(part, segments.Segment):
            later = segments.reads(plan[i + 1:], gm)
            fn, code = compile_graph(part.gm, [n.meta.get("val") for n in part.inputs],
                                     [n in dying and n not in later for n in part.inputs])
            compiled.append((part, fn))
            codes.append(f"# segment {len(codes)}\n{code}")
        else:
            compiled.append((part, None))
    returned = gm.graph.find_nodes(op="output")[0].args[0]

    def steps(*args):
        env = dict(zip(placeholders, args, strict=True))
        for part, fn in compiled:
            if part is segments.PAUSE:
                yield
            elif fn is None:  # the executor's callbacks, in their order
                for call in part:
                    call.target(*map_arg(call.args, env.__getitem__))
            else:
                env.update(zip(part.outputs, fn(*[env[n] for n in part.inputs]), strict=True))
        return map_arg(returned, env.__getitem__)

    def run(*args):
        work = steps(*args)
        while True:
            try:
                next(work)
            except StopIteration as done:
                return done.value
    return run, steps if segments.PAUSE in plan else None, "\n".join(codes)


def compile_graph(gm: GraphModule, examples: list, donated: list[bool] | None = None,
                  backward: bool = False) -> tuple[object, str]:
    """(the compiled function, Inductor's output code): `gm` decomposed with Inductor's
    table and compiled by `compile_fx_inner` for inputs like `examples` (real or fake
    values; tuples flattened around Inductor). NotLowered when Inductor refuses it.
    `donated[i]`: example i is a tensor the compiled code may write over (`_tracing_context`).
    `backward`: an AOTAutograd backward, whose donated inputs its tracing context names."""
    if any(v is None for v in examples):
        raise NotLowered("a value it reads has no recorded example")
    leaves, in_spec = tree_flatten(examples)
    if not all(isinstance(v, (torch.Tensor, torch.SymInt)) for v in leaves):
        raise NotLowered("an input is neither a tensor nor a size")
    out_spec, recorded = [], _recorded_outputs(gm)

    def flat(*args):
        outputs, spec = tree_flatten(tuple(gm(*tree_unflatten(list(args), in_spec))))
        out_spec.append(spec)
        if len(recorded) != len(outputs):
            return tuple(outputs)
        return tuple(_as_recorded(v, r) for v, r in zip(outputs, recorded, strict=True))

    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    table = select_decomp_table()
    if all(v.device.type == "cpu" for v in leaves if isinstance(v, torch.Tensor)):  # fused ops: their references, fused
        from mxgraph.codegen.kernels import cpu_decompositions
        table = {**table, **cpu_decompositions()}
    fake_mode = detect_fake_mode(leaves)
    leaves = _bindable(leaves, fake_mode)
    allowed = fake_mode is not None and fake_mode.allow_non_fake_inputs
    try:
        if fake_mode is not None:  # the graph's own constants are real tensors
            fake_mode.allow_non_fake_inputs = True
        with torch.no_grad():
            with fake_mode or contextlib.nullcontext():  # factories (no tensor argument) too
                traced = make_fx(flat, decomposition_table=table)(*leaves)
            # what torch.compile runs on its joint graph before partitioning it (no-op
            # removal, pattern rewrites, random ops as Inductor's seeded ones), needed by
            # compile_fx_inner after it (a dropout is refused without it)
            with V.set_fake_mode(fake_mode or FakeTensorMode()):
                traced = joint_graph_passes(traced)
            with _tracing_context(traced, examples, donated, fake_mode) as donating:
                compiled = compile_fx_inner(traced, leaves, is_backward=backward or donating)
    except Exception as error:  # noqa: BLE001 - reported by the caller, which falls back
        raise NotLowered(f"Inductor refused it: {type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from error
    finally:
        if fake_mode is not None:
            fake_mode.allow_non_fake_inputs = allowed
    spec = out_spec[-1]

    def run(*args):
        flat_inputs, _ = tree_flatten(list(args))
        return tree_unflatten(list(compiled(flat_inputs)), spec)
    return run, getattr(compiled, "source_code", "") or ""


def _recorded_outputs(gm: GraphModule) -> list:
    """The recorded example of each flattened output of `gm` (None where it has none)."""
    returned = tree_flatten(gm.graph.find_nodes(op="output")[0].args[0])[0]
    return [v for n in returned
            for v in (tree_flatten(n.meta.get("val"))[0] if isinstance(n, torch.fx.Node) else [None])]


def _as_recorded(value, recorded):
    """`value` (an output being traced) laid out with the strides of its recorded example.
    Later programs are compiled for the recorded layout (Inductor checks its inputs' strides
    when it runs), but the decomposed retrace may lay a value out otherwise (phi3's rotary
    `cat` of transposed halves came out transposed, as it is read, where ATen's `cat` and so
    the recorded value is contiguous), and Inductor keeps the retrace's strides. A static
    dense layout only; a size-1 dimension's stride does not count."""
    if not (isinstance(value, torch.Tensor) and isinstance(recorded, torch.Tensor)):
        return value
    sizes, want, have = value.shape, recorded.stride(), value.stride()
    static = all(isinstance(d, int) for d in (*sizes, *want, *have, *recorded.shape))
    if (not static or tuple(sizes) != tuple(recorded.shape)
            or not torch._prims_common.is_non_overlapping_and_dense_or_false(recorded)
            or all(w == h for d, w, h in zip(sizes, want, have, strict=True) if d > 1)):
        return value
    return torch.ops.prims.copy_strided(value, want)


@contextlib.contextmanager
def _tracing_context(traced: GraphModule, examples: list, donated: list[bool] | None, fake_mode):
    """A tracing context for `compile_fx_inner` (torch.compile's own where one is active:
    the mxmaca backend). It carries the program's fake mode, whose shape environment
    Inductor's FX graph cache needs (without one the cache is bypassed and every compile
    starts from scratch). It also tells Inductor which of `traced`'s inputs it may reuse for
    its own results: as torch.compile's backward (AOTAutograd's donated buffers), through
    forward metadata that names them; Inductor reads that only for a backward graph, so such
    a program is compiled as one. Sizes may be symbolic (expert parallelism's tokens
    received), but a size input must be one symbol: a backward binds it as its expression
    where a forward binds it by its symbol. A donated input is renamed `donated_<i>`, so that
    the FX graph cache never hands this code to the same graph without them. Yields whether
    anything is donated."""
    if torch._guards.TracingContext.try_get() is not None or fake_mode is None:
        yield False
        return
    sizes = [len(tree_flatten(v)[0]) for v in examples]
    flags = [bool(d) and isinstance(v, torch.Tensor)
             for v, d in zip(examples, donated or [False] * len(examples), strict=True)]
    indices, at = [], 0
    for size, flag in zip(sizes, flags, strict=True):
        if flag:
            indices.append(at)
        at += size
    # a backward binds a size input as its expression: only one that is a single symbol
    sizes_bind = all(not isinstance(v, torch.SymInt) or v.node.expr.is_Symbol or v.node.expr.is_Integer
                     for v in tree_flatten(examples)[0])
    context = torch._guards.TracingContext(fake_mode)
    donating = bool(indices) and sizes_bind
    if donating:
        for i, node in enumerate(traced.graph.find_nodes(op="placeholder")):
            if i in indices:
                node.target = f"donated_{i}"
        traced.recompile()
        context.fw_metadata = _Donated(indices)
    with torch._guards.tracing(context):
        yield donating


class _Donated:
    """The part of AOTAutograd's forward metadata Inductor reads for a backward."""

    def __init__(self, indices: list[int]):
        self.bw_donated_idxs = indices
        self.static_input_indices: list[int] = []


def _bindable(leaves: list, fake_mode) -> list:
    """`leaves` with each data-dependent size Inductor could not bind at run time made a
    fresh symbol of its own. Inductor's program reads its symbols from its inputs: from a
    size or stride that is one symbol, or from a size input. A size that is an expression
    of symbols none of those give (a W program's (u2 + u3, d) tokens received from two
    ranks, with neither count handed over) it refuses. The same expression becomes the same
    symbol on every input, so dimensions that must agree still do."""
    if fake_mode is None or fake_mode.shape_env is None:
        return leaves

    def expr(value):
        return value.node.expr if isinstance(value, torch.SymInt) else None
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    bound = {e for v in leaves for e in [expr(v)] if e is not None and e.is_Symbol}
    bound |= {e for t in tensors for d in (*t.shape, *t.stride()) for e in [expr(d)]
              if e is not None and e.is_Symbol}
    fresh: dict = {}

    def rebind(dim):
        e = expr(dim)
        if e is None or e.is_Symbol or e.free_symbols <= bound:
            return dim
        if e not in fresh:
            with shape_env.ignore_fresh_unbacked_symbols():  # an input's, no op's output
                fresh[e] = shape_env.create_unbacked_symint()
        return fresh[e]
    shape_env, out = fake_mode.shape_env, []
    for value in leaves:
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        shape, stride = [rebind(d) for d in value.shape], [rebind(d) for d in value.stride()]
        if all(a is b for a, b in zip([*shape, *stride], [*value.shape, *value.stride()],
                                      strict=True)):
            out.append(value)
            continue
        with fake_mode:
            out.append(torch.empty_strided(shape, stride, dtype=value.dtype,
                                           device=value.device))
    return out


def fall_back(title: str, reason: NotLowered) -> None:
    """Warn (or raise under MXGRAPH_STRICT=1) that `title` runs as Python codegen."""
    message = f"codegen='inductor': {title} runs as Python codegen: {reason}"
    if os.environ.get("MXGRAPH_STRICT") == "1":
        raise TraceError(message + "; unset MXGRAPH_STRICT to fall back with a warning")
    warnings.warn(message + "; set MXGRAPH_STRICT=1 to make this an error", stacklevel=3)


__all__ = ["NotLowered", "compile_graph", "fall_back", "lower"]
