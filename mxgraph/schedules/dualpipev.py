"""DualPipeV (DeepSeek, "cut-in-half" DualPipe): a V-shaped schedule on p ranks, 2p stages.

Rank r holds stage r (phase 0, going down the ranks) and stage 2p-1-r (phase 1, coming
back up), so the turn at rank p-1 (stages p-1 -> p) and the loss stage 2p-1 on rank 0 need
no message, and each rank holds one copy of 1/p of the parameters. The per-rank order
follows DualPipe's eight steps (phase 0 = stage r, phase 1 = stage 2p-1-r; microbatches
are taken in order per stage and kind; W queue is first-in first-out):

1. nF0        (p-r-1)*2 forwards of phase 0
2. nF0F1      r+1 times: F phase 0, F phase 1
3. nB1W1F1    p-r-1 times: B phase 1 (W deferred), one queued W, F phase 1
4. nF0B1F1B0  m-2p+r+1 times: F0&BW1 overlapped, F1&BW0 overlapped (rank p-1's first
              F0, BW1 run one after the other, not overlapped)
5. nB1F1B0    p-r-1 times: BW phase 1, F1&BW0 overlapped
6. nB1B0      r+1 times: backward phase 1, backward phase 0; from the middle iteration
              on, backwards are B only with W deferred (zero bubble)
7. nWB0       p-r-1 times: one queued W, B phase 0 (W deferred)
8. nW         r+1 times: one queued W

Step 4 runs at least once on rank 0 only if m >= 2p: that is the minimum number of
microbatches.

Bubble (simulated, tests/schedules/test_simulate.py): with F = B = W and an overlapped
pair costing F + BW, every rank idles (p-1)(F&B + B_full - 3W), which is the DualPipe
table's (PP/2-1)(F&B + B_full - 3W) with PP = 2p, the number of stages (the rank count of
the two-copy DualPipe this schedule is cut from), not the p ranks. With B != W the table
is an upper bound here, not exact. Peak activation: 2p + 1 stage-units on every rank.
"""

from collections import deque

from mxgraph.schedules.action import BW, Action, B, F, W
from mxgraph.schedules.schedule import Schedule, add_comm_actions


def dualpipev_min_microbatches(num_ranks: int) -> int:
    return 2 * num_ranks


def _rank_order(rank: int, p: int, m: int) -> list[Action]:
    stage = (rank, 2 * p - 1 - rank)  # phase -> stage
    next_mb = {}  # (phase, "F" or "B") -> next microbatch
    weight_queue: deque[Action] = deque()

    def take(phase: int, direction: str) -> int:
        key = (phase, direction)
        next_mb[key] = next_mb.get(key, 0) + 1
        return next_mb[key] - 1

    def fwd(phase: int) -> Action:
        return Action(stage[phase], F, take(phase, "F"))

    def bwd(phase: int, zero_bubble: bool = False) -> Action:
        mb = take(phase, "B")
        if zero_bubble:
            weight_queue.append(Action(stage[phase], W, mb))
            return Action(stage[phase], B, mb)
        return Action(stage[phase], BW, mb)

    def overlap(f_phase: int, b_phase: int) -> Action:
        return Action.overlap(fwd(f_phase), bwd(b_phase))

    out: list[Action] = []
    for _ in range((p - rank - 1) * 2):                      # step 1
        out.append(fwd(0))
    for _ in range(rank + 1):                                # step 2
        out += [fwd(0), fwd(1)]
    for _ in range(p - rank - 1):                            # step 3
        out.append(bwd(1, zero_bubble=True))
        out.append(weight_queue.popleft())
        out.append(fwd(1))
    for i in range(m - 2 * p + rank + 1):                    # step 4
        if i == 0 and rank == p - 1:
            out += [fwd(0), bwd(1)]
        else:
            out.append(overlap(0, 1))
        out.append(overlap(1, 0))
    for _ in range(p - rank - 1):                            # step 5
        out.append(bwd(1))
        out.append(overlap(1, 0))
    zero_bubble = False
    steps_6 = rank + 1
    for i in range(steps_6):                                 # step 6
        if i == steps_6 // 2 and rank % 2 == 1:
            zero_bubble = True
        out.append(bwd(1, zero_bubble))
        if i == steps_6 // 2 and rank % 2 == 0:
            zero_bubble = True
        out.append(bwd(0, zero_bubble))
    for _ in range(p - rank - 1):                            # step 7
        out.append(weight_queue.popleft())
        out.append(bwd(0, zero_bubble=True))
    for _ in range(rank + 1):                                # step 8
        out.append(weight_queue.popleft())
    assert not weight_queue, weight_queue
    return out


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """Needs num_microbatches >= 2 * num_ranks (checked by `build_schedule`)."""
    p = num_ranks
    stage_to_rank = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    compute = {r: _rank_order(r, p, num_microbatches) for r in range(p)}
    return Schedule(name="dualpipev", num_stages=2 * p, num_microbatches=num_microbatches,
                    stage_to_rank=stage_to_rank, actions=add_comm_actions(compute, stage_to_rank))
