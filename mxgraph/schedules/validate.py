"""`validate(schedule)`: is this schedule complete, ordered, matched and deadlock-free?

Checks, in order (the first failure raises `ScheduleError` with the grid, failing step
bracketed):

1. every action names a stage and microbatch that exist, on the rank that holds the stage;
2. every (stage, microbatch) has exactly one F and either one BW or one B and one W;
3. every message the placement needs (see `add_comm_actions`) is listed exactly once, on
   the right ranks, and no other message is;
4. running the ranks in order, with sends that never block (buffered, like `isend`) and
   receives that block until the matching send has run (like `irecv(...).wait()`), or,
   with `blocking_sends=True`, sends that also wait for their receive to be reached
   (rendezvous, like a blocking `dist.send` with no batching):
   - F of stage s runs after F of s-1 (same rank) or after its RECV_F (other rank);
   - B/BW of stage s runs after F of s and after B of s+1 (or its RECV_B); the loss stage's
     B needs only its F; W runs after its B; a SEND runs after the compute it sends;
   - if no rank can move and some have actions left, the schedule deadlocks;
5. (optional) in-flight microbatches per rank (F done, B not yet) stay within
   `max_in_flight`.
"""

from __future__ import annotations

from typing import Mapping

from mxgraph.errors import PlanError
from mxgraph.schedules.action import (
    BACKWARD_KINDS,
    BW,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
)
from mxgraph.schedules.schedule import Schedule, format_grid


class ScheduleError(PlanError):
    """A schedule breaks a rule; `.rank`/`.step` locate the failing action, if any."""

    def __init__(self, message: str, schedule: Schedule | None = None,
                 rank: int | None = None, step: int | None = None):
        self.rank, self.step = rank, step
        if schedule is not None:
            mark = (rank, step) if rank is not None and step is not None else None
            window = (step - 6, step + 6) if step is not None else (0, 12)
            message += "\n" + format_grid(schedule, mark=mark, window=window)
        super().__init__(message)


def expected_comms(schedule: Schedule) -> dict[Action, int]:
    """Every SEND/RECV the stage placement needs -> the rank that must run it."""
    s2r, last = schedule.stage_to_rank, schedule.loss_stage
    out = {}
    for s in range(last):  # boundary s -> s+1
        if s2r[s] == s2r[s + 1]:
            continue
        for m in range(schedule.num_microbatches):
            out[Action(s, SEND_F, m)] = s2r[s]
            out[Action(s + 1, RECV_F, m)] = s2r[s + 1]
            out[Action(s + 1, SEND_B, m)] = s2r[s + 1]
            out[Action(s, RECV_B, m)] = s2r[s]
    return out


def _partner(comm: Action) -> Action:
    """The other end of a message: SEND_F s <-> RECV_F s+1, SEND_B s <-> RECV_B s-1."""
    step, kind = {SEND_F: (1, RECV_F), RECV_F: (-1, SEND_F), SEND_B: (-1, RECV_B), RECV_B: (1, SEND_B)}[comm.kind]
    return Action(comm.stage + step, kind, comm.microbatch)


def _key(a: Action) -> tuple[str, int, int]:
    return (a.kind, a.stage, a.microbatch)


def validate(schedule: Schedule, *, max_in_flight: int | Mapping[int, int] | None = None,
             blocking_sends: bool = False) -> dict[int, int]:
    """Raise ScheduleError if `schedule` is wrong; return peak in-flight microbatches per rank
    (stage-microbatches with F done and B/BW not yet done)."""
    sched, acts = schedule, schedule.actions
    ranks = range(schedule.num_ranks)
    for r in acts:
        if r not in ranks:
            raise ScheduleError(f"rank {r} holds no stage (stage_to_rank={sched.stage_to_rank})", sched)

    # 1-2: ranges, placement, exactly-once compute.
    where: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, stage, mb) -> (rank, step)
    for r in ranks:
        for i, a in enumerate(acts.get(r, [])):
            for p in a.compute_parts() or (a,):
                if p.stage >= sched.num_stages or p.microbatch >= sched.num_microbatches:
                    raise ScheduleError(f"{a} names stage {p.stage} / microbatch {p.microbatch}; the "
                                        f"schedule has {sched.num_stages} stages and "
                                        f"{sched.num_microbatches} microbatches", sched, r, i)
                if sched.stage_to_rank[p.stage] != r:
                    raise ScheduleError(f"{a} is on rank {r} but stage {p.stage} lives on rank "
                                        f"{sched.stage_to_rank[p.stage]}", sched, r, i)
                key = (p.kind, p.stage, p.microbatch)
                if key in where:
                    raise ScheduleError(f"{p} appears twice (first at rank {where[key][0]} step "
                                        f"{where[key][1]})", sched, r, i)
                where[key] = (r, i)
    for s in range(sched.num_stages):
        for m in range(sched.num_microbatches):
            name = f"{s}?{m}"
            if (F, s, m) not in where:
                raise ScheduleError(f"missing {name.replace('?', F)}", sched)
            has_b, has_w, has_bw = ((k, s, m) in where for k in (B, W, BW))
            if has_bw and (has_b or has_w):
                raise ScheduleError(f"{s}BW{m} and a split {s}B{m}/{s}W{m} both appear", sched,
                                    *where[(BW, s, m)])
            if not has_bw and not (has_b and has_w):
                missing = "B and W (or BW)" if not has_b and not has_w else ("W" if has_b else "B")
                at = where.get((B, s, m)) or where.get((W, s, m)) or (None, None)
                raise ScheduleError(f"stage {s} microbatch {m} is missing its {missing}", sched, *at)

    # 3: messages.
    expected = expected_comms(sched)
    for a, r in expected.items():
        if (a.kind, a.stage, a.microbatch) not in where:
            raise ScheduleError(f"missing {a} on rank {r}", sched)
    for key, (r, i) in where.items():
        if key[0] in (SEND_F, RECV_F, SEND_B, RECV_B) and Action(key[1], key[0], key[2]) not in expected:
            raise ScheduleError(f"unexpected {acts[r][i]}: stages {key[1]} and its neighbour are on the "
                                "same rank or the neighbour does not exist", sched, r, i)

    # 4-5: run.
    bound = ({r: max_in_flight for r in ranks} if isinstance(max_in_flight, int)
             else dict(max_in_flight or {}))
    done: set[tuple[str, int, int]] = set()
    pos = {r: 0 for r in ranks}
    in_flight = {r: 0 for r in ranks}
    peak = {r: 0 for r in ranks}
    waiting: dict[tuple[str, int, int], list[int]] = {}  # send key -> ranks blocked on its recv
    parked: dict[tuple[str, int, int], int] = {}  # blocking_sends: comm key -> rank stopped at it
    ready = list(ranks)

    def need(r: int, i: int, a: Action, key: tuple[str, int, int], why: str) -> None:
        if key in done:
            return
        if key in where:
            wr, wi = where[key]
            raise ScheduleError(f"rank {r} step {i}: {a} {why} {key[1]}{key[0]}{key[2]}, which "
                                f"comes later (rank {wr} step {wi})", sched, r, i)
        raise ScheduleError(f"rank {r} step {i}: {a} {why} {key[1]}{key[0]}{key[2]}, which is "
                            "missing", sched, r, i)

    while ready:
        r = ready.pop()
        seq = acts.get(r, [])
        while pos[r] < len(seq):
            i, a = pos[r], seq[pos[r]]
            if a.kind == SEND_F:
                need(r, i, a, (F, a.stage, a.microbatch), "sends the output of")
            elif a.kind == SEND_B:
                bkey = (BW if (BW, a.stage, a.microbatch) in where else B, a.stage, a.microbatch)
                need(r, i, a, bkey, "sends the gradient of")
            if a.is_comm and blocking_sends:
                other = _key(_partner(a))
                if other not in parked:  # the other end is not there yet: stop here
                    parked[_key(a)] = r
                    break
                peer = parked.pop(other)  # both ends meet: the message completes
                done.add(other)
                pos[peer] += 1
                ready.append(peer)
            elif a.kind in (RECV_F, RECV_B):
                skey = _key(_partner(a))
                if skey not in done:
                    waiting.setdefault(skey, []).append(r)
                    break
            for p in a.compute_parts():
                s, m = p.stage, p.microbatch
                if p.kind == F and s > 0:
                    remote = sched.stage_to_rank[s - 1] != r
                    need(r, i, a, (RECV_F, s, m) if remote else (F, s - 1, m), "needs")
                elif p.kind in BACKWARD_KINDS:
                    need(r, i, a, (F, s, m), "needs")
                    if s < sched.loss_stage:
                        remote = sched.stage_to_rank[s + 1] != r
                        nb = BW if (BW, s + 1, m) in where else B
                        need(r, i, a, (RECV_B, s, m) if remote else (nb, s + 1, m), "needs")
                elif p.kind == W:
                    need(r, i, a, (B, s, m), "needs")
            for p in a.compute_parts() or (a,):
                done.add((p.kind, p.stage, p.microbatch))
                if p.kind == F:
                    in_flight[r] += 1
                elif p.kind in BACKWARD_KINDS:
                    in_flight[r] -= 1
                peak[r] = max(peak[r], in_flight[r])
                if r in bound and in_flight[r] > bound[r]:
                    raise ScheduleError(f"rank {r} step {i}: {in_flight[r]} microbatches in flight, "
                                        f"more than the bound {bound[r]}", sched, r, i)
            if a.kind in (SEND_F, SEND_B):
                ready += waiting.pop((a.kind, a.stage, a.microbatch), [])
            pos[r] += 1

    stuck = [r for r in ranks if pos[r] < len(acts.get(r, []))]
    if stuck:
        lines = []
        for r in stuck:
            a = acts[r][pos[r]]
            other = _partner(a)
            wr, wi = where[_key(other)]
            lines.append(f"rank {r} step {pos[r]} waits in {a} for {other} (rank {wr} step {wi})")
        raise ScheduleError("deadlock: " + "; ".join(lines), sched, stuck[0], pos[stuck[0]])
    return peak
