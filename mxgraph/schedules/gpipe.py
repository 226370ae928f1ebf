"""GPipe: every rank runs all forwards, then all full backwards (microbatch order)."""

from mxgraph.schedules.action import BW, Action, F
from mxgraph.schedules.schedule import Schedule, add_comm_actions


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """Stage s on rank s. Peak in-flight activations: all m microbatches on every rank."""
    stage_to_rank = tuple(range(num_ranks))
    compute = {
        r: [Action(r, F, m) for m in range(num_microbatches)]
        + [Action(r, BW, m) for m in range(num_microbatches)]
        for r in range(num_ranks)
    }
    return Schedule(name="gpipe", num_stages=num_ranks, num_microbatches=num_microbatches,
                    stage_to_rank=stage_to_rank, actions=add_comm_actions(compute, stage_to_rank))
