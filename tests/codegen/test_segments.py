"""codegen/segments.py: where a program's graph is cut for Inductor, on hand-built graphs
(no compile): callbacks between segments in their order, a pause before each collective wait
under a pausing schedule, no more than MAX_CUTS cuts for announcements and needs (each
announcement after the segment computing its value; with buckets known, a bucket's last
announcement on time and the cuts only there), and the segments computing, bitwise,
what the whole graph computes."""
import torch
from torch.fx import Graph, GraphModule

from mxgraph.codegen.segments import BUCKET, CALLBACK, MAX_CUTS, PAUSE, Segment, cut

aten = torch.ops.aten


def _callback(*args) -> None:
    """Stands for the executor's callbacks (python.py's announce, need, point)."""


def _chain(length: int, marks: dict[int, str], wait_at: int | None = None):
    """x -> length ops (sin, cos, ...); a callback node of kind marks[i] after op i."""
    graph = Graph()
    value = graph.placeholder("x")
    calls = []
    for i in range(length):
        op = torch.ops._c10d_functional.wait_tensor.default if i == wait_at else \
            (aten.sin.default if i % 2 else aten.cos.default)
        value = graph.call_function(op, (value,))
        if i in marks:
            args = (i, value) if marks[i] == "announce" else (i,)
            call = graph.call_function(_callback, args)
            call.meta[CALLBACK] = marks[i]
            calls.append(call)
    graph.output((value,))
    return GraphModule({}, graph), calls


def _kinds(plan) -> list:
    return ["segment" if isinstance(p, Segment) else p if p == PAUSE else
            [c.meta[CALLBACK] for c in p] for p in plan]


def test_no_callbacks_no_cut():
    gm, _ = _chain(4, {})
    assert cut(gm) == []
    assert cut(gm, pauses=True) == []


def test_callbacks_sit_between_segments_in_order():
    gm, _ = _chain(5, {0: "announce", 2: "point", 3: "need"})
    assert _kinds(cut(gm)) == ["segment", ["announce"], "segment", ["point"], "segment",
                               ["need"], "segment"]


def test_a_pause_before_each_wait_only_when_the_schedule_pauses():
    gm, _ = _chain(4, {}, wait_at=2)
    assert cut(gm) == []
    plan = cut(gm, pauses=True)
    assert _kinds(plan) == ["segment", PAUSE, "segment"]
    first = next(n for n in plan[2].gm.graph.nodes if n.op == "call_function")
    assert first.target is torch.ops._c10d_functional.wait_tensor.default


def test_many_announcements_move_later_and_needs_earlier():
    marks = {i: ("announce" if i % 2 else "need") for i in range(2 * MAX_CUTS + 4)}
    gm, calls = _chain(len(marks) + 1, marks)
    plan = cut(gm)
    assert sum(isinstance(p, Segment) for p in plan) <= MAX_CUTS + 1
    seen = []
    for part in plan:  # every value an announcement hands over is computed before it
        if isinstance(part, Segment):
            seen.append(part)
        else:
            for call in part:
                if call.meta[CALLBACK] == "announce":
                    assert any(call.args[1] in s.outputs for s in seen), call
    assert sorted(c for p in plan if isinstance(p, list) for c in p) == sorted(calls)


def test_a_buckets_last_announcement_is_on_time():
    # 3 buckets of 4 announcements each, after ops 0..11: a cut right after each bucket's
    # last gradient (ops 3, 7, 11), every announcement of a bucket called there together
    marks = {i: "announce" for i in range(12)}
    gm, calls = _chain(13, marks)
    for call in calls:
        call.meta[BUCKET] = call.args[0] // 4
    plan = cut(gm)
    assert _kinds(plan) == ["segment", ["announce"] * 4] * 3 + ["segment"]
    for i, bucket in enumerate(p for p in plan if isinstance(p, list)):
        assert [c.args[0] for c in bucket] == [4 * i + k for k in range(4)]
    # without buckets, the same announcements are spread over MAX_CUTS cuts
    for call in calls:
        del call.meta[BUCKET]
    assert sum(isinstance(p, list) for p in cut(gm)) == MAX_CUTS


def test_segments_compute_what_the_whole_graph_computes():
    gm, _ = _chain(6, {1: "announce", 3: "point"})
    x = torch.randn(5)
    env = {gm.graph.find_nodes(op="placeholder")[0]: x}
    for part in cut(gm):
        if isinstance(part, Segment):
            env.update(zip(part.outputs, part.gm(*[env[n] for n in part.inputs]), strict=True))
    result = env[gm.graph.find_nodes(op="output")[0].args[0][0]]
    assert torch.equal(result, gm(x)[0])
