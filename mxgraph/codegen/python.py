"""Codegen: turn each program of a step (a stage's F, B and W pieces of its joint graph)
into a readable Python function and give it to the program.

The source of a program is fx's Python code for its graph with a header naming the plan,
the stage and the piece; it calls ATen ops and fused kernels directly. With a dump dir, all
of a step's sources go to `<dump>/step_code.py`. The executor runs them under
`torch.no_grad()` (the graphs compute the gradients themselves).
"""
from __future__ import annotations

import linecache
from itertools import count

import torch

from mxgraph.codegen import donation, inductor
from mxgraph.codegen.segments import BUCKET, CALLBACK
from mxgraph.runtime.pipeline.programs import Program, StagePrograms

_module_ids = count()
_PIECES = {"F": "forward", "B": "input gradients", "W": "weight gradients"}


def generate_program(program: Program, title: str) -> None:
    """Generate `program`'s function and source (sets `program.fn` and `program.source`);
    each output in `program.announce` is passed to `program.ready` right after its line;
    each of `program.points` is a call `point(i, section)` right before its node."""
    if program.announce or program.needs or program.points:  # calls in the graph: gm runs
        _announce_calls(program)                                  # them too
        _need_calls(program)
        _point_calls(program)
        program.gm.recompile()
    code = program.gm.graph.python_code(root_module="self")
    source = f"# {title}\n" + code.src
    filename = f"<mxgraph-step-{next(_module_ids)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(code.globals)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    program.fn = namespace["forward"].__get__(program.gm)
    program.source = source
    program.steps_fn = _pausing(code.src, dict(code.globals), program)


def _lowered(program: Program, title: str, pauses: bool, donated=frozenset()) -> str | None:
    """Run `program` as Inductor's code from now on; its output code, or None where it
    stays Python (with the warning of `inductor.fall_back`). `pauses`: the schedule pauses
    programs before their collective waits (DualPipeV's F&B interleave); `donated`: the
    inputs it may write over (`donation.py`)."""
    try:
        fn, steps, code = inductor.lower(program, pauses, donated)
    except inductor.NotLowered as reason:
        inductor.fall_back(title, reason)
        return None
    program.fn, program.steps_fn = fn, steps
    return code


_WAIT = "torch.ops._c10d_functional.wait_tensor.default("


def _pausing(src: str, globals_: dict, program: Program):
    """The program as a generator function that yields right before each collective wait
    (for `Program.steps`), or None when it waits for none. fx writes one statement per
    line in the function's body, so a `yield` line goes right above each wait."""
    if _WAIT not in src:
        return None
    lines = []
    for line in src.replace("def forward(", "def forward_steps(", 1).splitlines():
        if _WAIT in line:
            lines.append(line[:len(line) - len(line.lstrip())] + "yield")
        lines.append(line)
    filename = f"<mxgraph-step-{next(_module_ids)}-steps>"
    text = "\n".join(lines) + "\n"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(compile(text, filename, "exec"), globals_)  # noqa: S102 - our own generated code
    return globals_["forward_steps"].__get__(program.gm)


def _announce_calls(program: Program) -> None:
    """A call `announce(i, value)` after the node of each announced output (computed by
    this program; an input passed through is announced by whoever computes it)."""
    graph = program.gm.graph
    by_output = dict(zip(program.outputs, graph.find_nodes(op="output")[0].args[0], strict=True))

    def announce(index, value):
        program.ready(index, value)
    for index, output in enumerate(program.announce):
        node = by_output.get(output)
        if node is None or node.op != "call_function":
            continue
        with graph.inserting_after(node):
            call = graph.call_function(announce, (index, node))
        call.meta[CALLBACK] = "announce"
        if program.announce_buckets:
            call.meta[BUCKET] = program.announce_buckets[index]


def _need_calls(program: Program) -> None:
    """A call `need(i)` right before the first user of each input in `program.needs`."""
    graph = program.gm.graph
    local = dict(zip(program.inputs, graph.find_nodes(op="placeholder"), strict=True))
    order = {node: i for i, node in enumerate(graph.nodes)}

    def need(index):
        program.need(index)
    for index, joint_node in enumerate(program.needs):
        node = local.get(joint_node)
        users = [u for u in node.users if u.op != "output"] if node is not None else []
        if not users:
            continue
        with graph.inserting_before(min(users, key=order.get)):
            graph.call_function(need, (index,)).meta[CALLBACK] = "need"


def _point_calls(program: Program) -> None:
    """A call `point(i, section)` right before the node of each timing point (the section
    is there for the reader: the monitor's timer has the labels)."""
    graph = program.gm.graph

    def point(index, section):
        program.point(index)
    for index, timing in enumerate(program.points):
        with graph.inserting_before(timing.node):
            graph.call_function(point, (index, timing.section)).meta[CALLBACK] = "point"


def _device_type(stages: dict[int, StagePrograms]) -> str:
    """The device type of the programs' values (their placeholders' examples); "cpu" when
    none has one."""
    for programs in stages.values():
        for _, program in programs.all():
            for node in program.gm.graph.find_nodes(op="placeholder"):
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    return value.device.type
    return "cpu"


def generate(stages: dict[int, StagePrograms], plan, dump_dir=None) -> str:
    """Generate every program of this rank's stages; returns the whole source (also
    written to `dump_dir/step_code.py` when given). Where `plan.codegen_for` the device of
    the programs' values says "inductor", each program that can be is then lowered by
    Inductor (`inductor.py`; its output code goes to
    `dump_dir/inductor_stage<S>_<F|B|W>.py`)."""
    parts = ["# Generated by mxgraph: one training step of this rank's stages.\n"
             f"# plan: {plan}\n"]
    codegen = plan.codegen_for(_device_type(stages))
    for stage, programs in sorted(stages.items()):
        donated = donation.donated(programs) if codegen == "inductor" else {}
        for kind, program in programs.all():
            title = f"stage {stage}, {kind} ({_PIECES[kind]})"
            generate_program(program, title)
            parts.append(program.source)
            if codegen == "inductor" and program.inputs:
                code = _lowered(program, title, pauses=plan.schedule == "dualpipev",
                                donated=donated.get(kind, frozenset()))
                if code and dump_dir is not None:
                    (dump_dir / f"inductor_stage{stage}_{kind}.py").write_text(code)
    source = "\n".join(parts)
    if dump_dir is not None:
        (dump_dir / "step_code.py").write_text(source)
    return source
