"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with B and W split.

Rank r (holding stage r) warms up with min(p-r, m) forwards, exactly the microbatches
1F1B holds in flight, then runs rounds k = 0..m-1 of

    B_k,  W_{k-r} (once k >= r),  F_{k+warmup} (while any remain)

and finally the W it still owes. Rank r thus runs its weight gradients r rounds late: the
deferred W fill the cool-down bubbles that 1F1B leaves, while stage 0 (r = 0) runs every
W right after its B and so never holds more activation than 1F1B. With F = B = W the
idle time per rank is (p-1)(F+B-2W) instead of 1F1B's (p-1)(F+B+W) for m >= p.
"""

from mxgraph.schedules.action import Action, B, F, W
from mxgraph.schedules.schedule import Schedule, add_comm_actions


def zbh1(num_ranks: int, num_microbatches: int) -> Schedule:
    p, m = num_ranks, num_microbatches
    compute = {}
    for r in range(p):
        warmup = min(p - r, m)
        order = [Action(r, F, k) for k in range(warmup)]
        next_w = 0
        for k in range(m):
            order.append(Action(r, B, k))
            if k >= r:
                order.append(Action(r, W, next_w))
                next_w += 1
            if k + warmup < m:
                order.append(Action(r, F, k + warmup))
        order += [Action(r, W, k) for k in range(next_w, m)]
        compute[r] = order
    stage_to_rank = tuple(range(p))
    return Schedule(name="zbh1", num_stages=p, num_microbatches=m,
                    stage_to_rank=stage_to_rank, actions=add_comm_actions(compute, stage_to_rank))
