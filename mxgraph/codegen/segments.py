"""A program's graph cut at its calls back into the executor, for Inductor.

Python codegen writes the executor's callbacks into a program's graph as plain calls
(`python.py`): `announce(i, grad)` right after a gradient a data-parallel bucket waits for,
`need(i)` right before the first read of a ZeRO-1 parameter, `point(i, section)` where a
level-1 timing segment starts. Inductor would drop or move calls it cannot see into, so the
graph is cut at them: each run of compute between two cuts is a `Segment`, lowered by itself,
and the callbacks run in Python between segments, in their order.

Under a schedule that pauses programs before their collective waits (DualPipeV's F&B
interleave: the other program of the pair computes while this one's transfer is on the
wire), each wait starts a segment too, and the program runs as a generator that yields there.

A cut costs fusion across it and one more compile. Timing points are each a cut (they time
the compute between them). Announcements and needs are many (one per parameter) and only
need to happen in time, so at most `MAX_CUTS` of them are cuts, spread evenly; the others
move to a neighbouring cut on the safe side: an announcement to the next cut (its value
exists by then; the bucket starts a little later), a need to the previous one (the
parameter is awaited a little earlier). Where the announcements carry their bucket
(`BUCKET`), only the last of each bucket's in the program is a candidate cut: a bucket
starts once its last gradient is in, so the others may move to it without delaying it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

_WAIT = torch.ops._c10d_functional.wait_tensor.default

CALLBACK = "mxgraph_callback"
"""`node.meta[CALLBACK]`: "announce", "need" or "point" on a callback node of `python.py`."""

MAX_CUTS = 6
"""Cuts at announcements and needs per program (timing points are always cuts)."""

BUCKET = "mxgraph_bucket"
"""`node.meta[BUCKET]`: the data-parallel bucket of an "announce" callback, where known."""


@dataclass
class Segment:
    """Compute nodes of a program's graph between two cuts, as a GraphModule of its own."""

    gm: GraphModule
    inputs: list[Node]
    """Nodes of the program's graph it reads (placeholders or earlier segments' nodes)."""
    outputs: list[Node]
    """Its nodes read after it (later segments, callbacks, the program's output)."""


PAUSE = "pause"
"""A cut right before a collective wait, where a pausing schedule yields (`Program.steps`)."""


def cut(gm: GraphModule, pauses: bool = False) -> list[Segment | list[Node] | str]:
    """The program as an alternation of `Segment`s and lists of callback nodes to call
    between them, in order, with `PAUSE` before each segment that starts with a collective
    wait when `pauses`; [] when there is nothing to cut at."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    waits = {n for n in nodes if n.target is _WAIT} if pauses else set()
    if not waits and not any(CALLBACK in n.meta for n in nodes):
        return []
    compute = [n for n in nodes if CALLBACK not in n.meta]
    position, before, pause_at = {}, 0, set()  # callback -> compute nodes before it
    for node in nodes:
        if CALLBACK in node.meta:
            position[node] = before
        else:
            if node in waits:
                pause_at.add(before)
            before += 1
    gaps = sorted(set(_gaps(position, len(compute))) | pause_at)  # 0 and the end included
    calls: dict[int, list[Node]] = {}
    for node, at in position.items():
        calls.setdefault(_gap_of(node, at, gaps), []).append(node)
    plan: list[Segment | list[Node]] = []
    for start, end in zip(gaps, gaps[1:], strict=False):
        if calls.get(start):
            plan.append(calls[start])
        if start in pause_at:
            plan.append(PAUSE)
        if end > start:
            plan.append(_segment(gm, compute[start:end]))
    if calls.get(len(compute)):
        plan.append(calls[len(compute)])
    return plan


def reads(parts: list, gm: GraphModule) -> set[Node]:
    """The nodes of `gm` that `parts` (the rest of a `cut` plan) and the program's output
    read: a value none of them reads dies with the segment before them."""
    out: set[Node] = set()
    for part in parts:
        if isinstance(part, Segment):
            out.update(part.inputs)
        elif isinstance(part, list):
            for call in part:
                map_arg((call.args, call.kwargs), out.add)
    map_arg(gm.graph.find_nodes(op="output")[0].args, out.add)
    return out


def _gaps(position: dict[Node, int], num_compute: int) -> list[int]:
    """The cut positions: every timing point's, and at most MAX_CUTS of the others'."""
    points = {at for node, at in position.items() if node.meta[CALLBACK] == "point"}
    bucket_ends: dict[int, int] = {}  # bucket -> the position of its last announcement
    for node, at in position.items():
        if BUCKET in node.meta:
            bucket_ends[node.meta[BUCKET]] = max(at, bucket_ends.get(node.meta[BUCKET], at))
    others = sorted({at for node, at in position.items()
                     if node.meta[CALLBACK] == "need" or
                     (node.meta[CALLBACK] == "announce" and BUCKET not in node.meta)}
                    | set(bucket_ends.values()))
    if len(others) > MAX_CUTS:
        others = [others[round(i * (len(others) - 1) / (MAX_CUTS - 1))] for i in range(MAX_CUTS)]
    return sorted(points | set(others) | {0, num_compute})


def _gap_of(node: Node, at: int, gaps: list[int]) -> int:
    if node.meta[CALLBACK] == "announce":  # its value exists: later is safe
        return min(g for g in gaps if g >= at)
    return max(g for g in gaps if g <= at)  # a need or a point: earlier


def _segment(gm: GraphModule, nodes: list[Node]) -> Segment:
    inside = set(nodes)
    graph = Graph()
    env: dict[Node, Node] = {}
    inputs: list[Node] = []

    def read(arg: Node) -> Node:
        if arg not in env:
            inputs.append(arg)
            env[arg] = graph.placeholder(arg.name)
            env[arg].meta.update(arg.meta)
        return env[arg]
    for node in nodes:
        map_arg((node.args, node.kwargs), lambda a: a if a in inside else read(a))
        env[node] = graph.node_copy(node, lambda a: env[a])
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    return Segment(GraphModule(gm, graph), inputs, outputs)
