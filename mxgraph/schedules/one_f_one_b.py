"""1F1B (PipeDream-flush): warm up with forwards, then alternate one F and one full B."""

from mxgraph.schedules.action import BW, Action, F
from mxgraph.schedules.schedule import Schedule, add_comm_actions


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Stage s on rank s. Rank r: min(p-1-r, m) warm-up F, then (F, BW) pairs, then the
    remaining BW. At most p-r microbatches are in flight on rank r."""
    stage_to_rank = tuple(range(num_ranks))
    compute = {}
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, num_microbatches)
        order = [Action(r, F, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [Action(r, F, warmup + i), Action(r, BW, i)]
        order += [Action(r, BW, m) for m in range(num_microbatches - warmup, num_microbatches)]
        compute[r] = order
    return Schedule(name="1f1b", num_stages=num_ranks, num_microbatches=num_microbatches,
                    stage_to_rank=stage_to_rank, actions=add_comm_actions(compute, stage_to_rank))
