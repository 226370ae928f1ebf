"""`Schedule`: per-rank action lists plus the metadata needed to check and run them.

Stages are numbered along the model, 0 (embedding side) to `num_stages - 1` (the loss
stage). `stage_to_rank[s]` is the pipeline rank holding stage `s`. Generators emit the
compute order only and call `add_comm_actions`, which derives every SEND/RECV from the
stage placement: none between two stages on the same rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mxgraph.errors import PlanError
from mxgraph.schedules.action import (
    BACKWARD_KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    F,
    parse_action,
)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What every pipeline rank runs, in order."""

    name: str
    """Generator name ("1f1b", "zbh1", ...) or a free label for hand-written schedules."""
    num_stages: int
    """Model stages, counting every virtual stage (pp * vpp for interleaved)."""
    num_microbatches: int
    """Microbatches per step; each passes through every stage forward and backward."""
    stage_to_rank: tuple[int, ...]
    """`stage_to_rank[s]` is the rank holding stage `s`."""
    actions: dict[int, list[Action]] = field(default_factory=dict)
    """rank -> ordered actions (compute and comm)."""

    def __post_init__(self) -> None:
        if len(self.stage_to_rank) != self.num_stages:
            raise PlanError(f"stage_to_rank has {len(self.stage_to_rank)} entries for "
                            f"num_stages={self.num_stages}")

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank) + 1

    @property
    def loss_stage(self) -> int:
        return self.num_stages - 1

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def compute_only(self) -> dict[int, list[Action]]:
        return {r: [a for a in acts if a.is_compute] for r, acts in self.actions.items()}

    def to_text(self) -> str:
        """One line per rank: `rank: action action ...` (see `schedule_from_text`)."""
        header = (f"# {self.name} stages={self.num_stages} microbatches={self.num_microbatches} "
                  f"stage_to_rank={','.join(map(str, self.stage_to_rank))}")
        lines = [header] + [f"{r}: " + " ".join(map(str, self.actions[r])) for r in sorted(self.actions)]
        return "\n".join(lines) + "\n"


def schedule_from_text(text: str) -> Schedule:
    """Inverse of `Schedule.to_text`."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("# "):
        raise PlanError("schedule text must start with a '# name stages=.. microbatches=.. "
                        "stage_to_rank=..' header")
    name, *fields = lines[0][2:].split()
    meta = dict(f.split("=", 1) for f in fields)
    actions = {}
    for ln in lines[1:]:
        rank, _, rest = ln.partition(":")
        actions[int(rank)] = [parse_action(t) for t in rest.split()]
    return Schedule(name=name, num_stages=int(meta["stages"]),
                    num_microbatches=int(meta["microbatches"]),
                    stage_to_rank=tuple(int(x) for x in meta["stage_to_rank"].split(",")),
                    actions=actions)


def add_comm_actions(compute: dict[int, list[Action]], stage_to_rank: tuple[int, ...]) -> dict[int, list[Action]]:
    """Insert each compute action's receives right before it and its sends right after.

    F of stage s receives from s-1 and sends to s+1; B/BW of stage s receives the output
    gradient from s+1 and sends the input gradient to s-1; W communicates nothing. A
    neighbour on the same rank needs no message. Sends are asynchronous (see validate.py).
    """
    last = len(stage_to_rank) - 1

    def remote(s: int, t: int) -> bool:
        return 0 <= t <= last and stage_to_rank[s] != stage_to_rank[t]

    out: dict[int, list[Action]] = {}
    for rank, acts in compute.items():
        seq: list[Action] = []
        for a in acts:
            before, after = [], []
            for p in a.compute_parts():
                s, m = p.stage, p.microbatch
                if p.kind == F:
                    if remote(s, s - 1):
                        before.append(Action(s, RECV_F, m))
                    if remote(s, s + 1):
                        after.append(Action(s, SEND_F, m))
                elif p.kind in BACKWARD_KINDS:
                    if remote(s, s + 1):
                        before.append(Action(s, RECV_B, m))
                    if remote(s, s - 1):
                        after.append(Action(s, SEND_B, m))
            seq += before + [a] + after
        out[rank] = seq
    return out


def format_grid(schedule: Schedule, *, mark: tuple[int, int] | None = None,
                compute_only: bool = False, window: tuple[int, int] | None = None) -> str:
    """Ranks as rows, steps (positions in each rank's list) as columns.

    `mark=(rank, step)` brackets that cell, e.g. `[0B3]`. `compute_only` drops comm
    actions (columns are then compute steps). `window=(first, last)` limits columns.
    """
    rows = schedule.compute_only() if compute_only else schedule.actions
    length = max((len(a) for a in rows.values()), default=0)
    lo, hi = window if window else (0, length - 1)
    lo, hi = max(lo, 0), min(hi, length - 1)
    cells = {r: [str(a) for a in acts] for r, acts in rows.items()}
    if mark is not None and mark[0] in cells and 0 <= mark[1] < len(cells[mark[0]]):
        cells[mark[0]][mark[1]] = f"[{cells[mark[0]][mark[1]]}]"
    width = max([len(c) for cs in cells.values() for c in cs[lo:hi + 1]] + [len(str(hi)), 1])
    head = "step    " + " ".join(f"{i:>{width}}" for i in range(lo, hi + 1))
    out = [head]
    for r in sorted(cells):
        row = [cells[r][i] if i < len(cells[r]) else "." for i in range(lo, hi + 1)]
        marker = ">" if mark is not None and mark[0] == r else " "
        out.append(f"{marker}rank {r:<2} " + " ".join(f"{c:>{width}}" for c in row))
    if lo > 0 or hi < length - 1:
        out.append(f"(steps {lo}..{hi} of 0..{length - 1})")
    return "\n".join(out)
