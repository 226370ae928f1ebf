"""`simulate(schedule, costs) -> Timeline`: durations in, start/end per action out.

Time model: each rank runs its actions in order, one at a time. A compute action starts
when the previous action on its rank ends (its inputs arrived through the RECV before
it). A SEND occupies its rank for `costs.send` (default 0) and its data arrives
`costs.comm` later; a RECV ends at max(rank ready + `costs.recv`, arrival). Idle time on
a rank = total time - time spent in its actions; bubble ratio = idle / total.

Memory model (activation units, per rank, in list order): F of a stage-microbatch adds
1 unit (everything it saves for backward); B frees 1 - `w_retained` (keeping what W still
needs); W frees the remaining `w_retained`; BW frees 1. An overlapped F&B adds the F
part's unit before the B part frees its own. `peak_activations[rank]` is the maximum.

Parameter copies per rank = stages held * num_ranks / num_stages: 1.0 when every rank
holds an equal, unduplicated share (all schedules here, DualPipeV included; DualPipe
proper would be 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from mxgraph.errors import PlanError
from mxgraph.schedules.action import (
    BW,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
)
from mxgraph.schedules.schedule import Schedule
from mxgraph.schedules.timeline import Event, Timeline
from mxgraph.schedules.validate import validate


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Durations in any one unit (the Chrome trace reads them as microseconds)."""

    f: float = 1.0
    """Forward of one stage for one microbatch."""
    b: float = 1.0
    """Backward for inputs (B)."""
    w: float = 1.0
    """Backward for weights (W)."""
    bw: float | None = None
    """Full backward (BW); None means b + w."""
    overlap_factor: float = 1.0
    """An OVERLAP_F_B pair lasts overlap_factor * (its F part + its B/BW part)."""
    send: float = 0.0
    """Time a rank spends issuing a send."""
    recv: float = 0.0
    """Time a rank spends completing a receive once the data is there."""
    comm: float = 0.0
    """Transfer latency between ranks: data sent at t arrives at t + comm."""
    per_stage: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    """Overrides by stage: {stage: {"F": .., "B": .., "W": .., "BW": ..}}; missing keys
    fall back to the fields above (BW to that stage's B + W)."""
    hidden_in_pair: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    """By stage, the time of its F, B or BW that an OVERLAP_F_B pair can hide behind the
    pair's other part (a collective's wait that runs while the other part computes:
    DualPipe's F&B overlap); each part hides at most the other part's duration, and a pair
    lasts at least its longer part."""

    def __post_init__(self) -> None:
        values = {"f": self.f, "b": self.b, "w": self.w, "bw": self.bw, "send": self.send,
                  "recv": self.recv, "comm": self.comm, "overlap_factor": self.overlap_factor}
        values.update({f"per_stage[{s}][{k!r}]": v for s, d in self.per_stage.items() for k, v in d.items()})
        values.update({f"hidden_in_pair[{s}][{k!r}]": v for s, d in self.hidden_in_pair.items()
                       for k, v in d.items()})
        for name, value in values.items():
            if value is not None and not (0.0 <= value < float("inf")):
                raise PlanError(f"cost {name} must be finite and >= 0, got {value}")
        for stage, d in self.per_stage.items():
            bad = set(d) - {F, B, W, BW}
            if bad:
                raise PlanError(f"per_stage[{stage}] has kinds {sorted(bad)}; valid kinds: F, B, W, BW")

    def of(self, action: Action) -> float:
        kind = action.kind
        if kind == OVERLAP_F_B:
            return self.overlap_factor * self._pair(action.parts)
        if kind in (SEND_F, SEND_B):
            return self.send
        if kind in (RECV_F, RECV_B):
            return self.recv
        over = self.per_stage.get(action.stage, {})
        base = {F: self.f, B: self.b, W: self.w}
        if kind == BW:
            if BW in over:
                return over[BW]
            if self.bw is not None and B not in over and W not in over:
                return self.bw
            return over.get(B, self.b) + over.get(W, self.w)
        return over.get(kind, base[kind])

    def _pair(self, parts) -> float:
        """An F&B pair's parts run together: each hides up to `hidden_in_pair` of its time
        behind the other part."""
        times = [self.of(p) for p in parts]
        if not self.hidden_in_pair or len(parts) != 2:
            return sum(times)
        hidden = sum(min(self.hidden_in_pair.get(p.stage, {}).get(p.kind, 0.0), times[1 - i])
                     for i, p in enumerate(parts))
        return max(max(times), sum(times) - hidden)


def _recv_source(a: Action) -> tuple[str, int, int]:
    if a.kind == RECV_F:
        return (SEND_F, a.stage - 1, a.microbatch)
    return (SEND_B, a.stage + 1, a.microbatch)


def simulate(schedule: Schedule, costs: Costs = Costs(), *, w_retained: float = 0.5,
             check: bool = True) -> Timeline:
    """Run `schedule` under `costs`; `check` validates it first (raises ScheduleError)."""
    if not 0.0 <= w_retained <= 1.0:
        raise PlanError(f"w_retained is a fraction of one activation unit: 0..1, got {w_retained}")
    if check:
        validate(schedule)
    ranks = range(schedule.num_ranks)
    clock = {r: 0.0 for r in ranks}
    pos = {r: 0 for r in ranks}
    sent: dict[tuple[str, int, int], float] = {}  # send key -> arrival time
    waiting: dict[tuple[str, int, int], list[int]] = {}
    events: list[Event] = []
    units = {r: 0.0 for r in ranks}
    peak = {r: 0.0 for r in ranks}
    memory_trace: dict[int, list[tuple[float, float]]] = {r: [(0.0, 0.0)] for r in ranks}
    free_on = {B: 1.0 - w_retained, W: w_retained, BW: 1.0}
    ready = list(ranks)
    while ready:
        r = ready.pop()
        seq = schedule.actions.get(r, [])
        while pos[r] < len(seq):
            a = seq[pos[r]]
            start = clock[r]
            if a.kind in (RECV_F, RECV_B):
                src = _recv_source(a)
                if src not in sent:
                    waiting.setdefault(src, []).append(r)
                    break
                start = max(start, sent[src] - costs.recv)
            end = start + costs.of(a)
            events.append(Event(r, a, start, end))
            clock[r] = end
            if a.kind in (SEND_F, SEND_B):
                sent[(a.kind, a.stage, a.microbatch)] = end + costs.comm
                ready += waiting.pop((a.kind, a.stage, a.microbatch), [])
            for p in a.compute_parts():
                units[r] += 1.0 if p.kind == F else -free_on[p.kind]
                peak[r] = max(peak[r], units[r])
            if a.is_compute:
                memory_trace[r].append((end, units[r]))
            pos[r] += 1
    stuck = [r for r in ranks if pos[r] < len(schedule.actions.get(r, []))]
    if stuck:
        raise PlanError(f"simulation deadlocked on ranks {stuck}; run validate() for details")
    total = max((e.end for e in events), default=0.0)
    busy = {r: 0.0 for r in ranks}
    for e in events:
        busy[e.rank] += e.end - e.start
    copies = {r: len(schedule.stages_of(r)) * schedule.num_ranks / schedule.num_stages for r in ranks}
    return Timeline(schedule=schedule, costs=costs, events=events, total_time=total, busy=busy,
                    peak_activations=peak, param_copies=copies, memory_trace=memory_trace)
