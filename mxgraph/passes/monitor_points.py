"""Timing points for the slow-node monitor's level 1 (`runtime/monitor/slow_node.py`): where each
program's execution changes section, so that a straggler is named by layer and collective.

A structural step between `split_bw` and `codegen`; it runs only when the step's monitor
asks for level 1 or more (`Step.set_monitor` before the first compile sets
`CompileContext.monitor_level`); at level 0 the programs keep no points and the generated
code has no timing calls. It changes no graph (the runner sees the programs' graphs as
`split_bw` left them): it sets each program's `points`
(`runtime.pipeline.programs.TimingPoint`), and codegen writes a call `point(i, section)` right
before each point's node.

Sections, in program order (every node of a program belongs to exactly one):
- compute: `fwd:layer k` in the F program, `bwd:layer k` in B and W (both pieces of a
  layer's backward, recomputed forward nodes included), from `meta["custom"]["layer"]`
  (`capture.annotate_modules`; backward nodes inherit it); outside the repeated layers the
  top module's name (`fwd:embed`, `bwd:lm_head`, `fwd:model` for the model's own forward).
  A node without module meta (one a pass or AOTAutograd made) stays in the section of the
  compute before it.
- each collective (`comm_graph.collective_call`: the `mxgraph::` collectives and torch's
  functional starts): `<kind> of <where>.wait` (kind wait: the ranks of its group meet,
  one-element all-reduce) then `<kind> of <where>` (kind comm: the call; for a start, also
  the `wait_tensor` that waits for it: the exposed transfer time). `<where>` is `layer k`,
  or the top module's name. The meeting makes a fast rank wait before the collective, not
  in it (an overlapped start then starts no earlier than its group's last rank reaches
  it; a meeting on a group whose earlier asynchronous collective is still running waits
  for that one too, on backends that run a group's collectives in order).

Numerics are unchanged (the calls read no tensor).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from mxgraph.comm_graph import collective_call
from mxgraph.runtime.pipeline.programs import TimingPoint

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def monitor_points_step(c, ctx):
    """Set every program's timing points when `ctx.monitor_level` >= 1 (else none); the
    programs' graphs, unchanged, go to the runner."""
    graphs = []
    for stage, programs in c.programs.items():
        for kind, program in programs.all():
            if ctx.monitor_level >= 1:
                program.points = program_points(program.gm.graph,
                                                 "fwd" if kind == "F" else "bwd")
            graphs.append((f"stage{stage}.{kind}", program.gm))
    return graphs


def program_points(graph: Graph, direction: str) -> tuple[TimingPoint, ...]:
    """The timing points of one program's graph; `direction` "fwd" or "bwd" names its
    compute sections."""
    points: list[TimingPoint] = []
    starts: dict[Node, str] = {}  # collective node -> its comm section
    current = compute = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        call = collective_call(node)
        if call is not None:
            kind, group, _ = call
            section = starts[node] = f"{kind} of {_where(node)}"
            points += [TimingPoint(node, f"{section}.wait", "wait", group),
                       TimingPoint(node, section, "comm")]
            current = section
            continue
        if node.target is _WAIT:
            section = starts.get(_started_by(node.args[0])) or f"collective of {_where(node)}"
            kind = "comm"
        else:
            section, kind = _compute_section(node, direction) or compute, "compute"
            compute = section
        if section is not None and section != current:
            points.append(TimingPoint(node, section, kind))
            current = section
    return tuple(points)


def _compute_section(node: Node, direction: str) -> str | None:
    custom = node.meta.get("custom") or {}
    if custom.get("module") is None:
        return None
    return f"{direction}:{_where(node)}"


def _where(node: Node) -> str:
    custom = node.meta.get("custom") or {}
    if custom.get("layer") is not None:
        return f"layer {custom['layer']}"
    return (custom.get("module") or "").split(".")[0] or "model"


def _started_by(value) -> Node | None:
    """The node a waited value comes from, through `getitem`s (a start's tuple)."""
    while isinstance(value, Node) and value.op == "call_function" and \
            value.target is operator.getitem:
        value = value.args[0]
    return value if isinstance(value, Node) else None
