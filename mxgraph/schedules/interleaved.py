"""Interleaved 1F1B (Megatron-LM virtual pipeline): v model chunks per rank.

Stage s = chunk * p + r lives on rank r = s % p. Virtual microbatches are taken in
groups of p: the k-th forward of a rank runs chunk (k // p) % v on microbatch
(k // (p*v)) * p + k % p; backwards visit chunks in reverse (v-1-chunk). Rank r warms up
with (p-1-r)*2 + (v-1)*p forwards, then alternates F and BW, then drains. With v = 1 the
warm-up is 1F1B's p-1-r and the order is exactly 1F1B's. For v >= 2 the order equals
torch.distributed.pipelining's ScheduleInterleaved1F1B (tests compare them).
"""

from mxgraph.schedules.action import BW, Action, F
from mxgraph.schedules.schedule import Schedule, add_comm_actions


def _virtual(k: int, num_ranks: int, num_chunks: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of a rank's k-th forward (or backward)."""
    chunk = (k // num_ranks) % num_chunks
    if backward:
        chunk = num_chunks - 1 - chunk
    microbatch = (k // (num_ranks * num_chunks)) * num_ranks + k % num_ranks
    return chunk, microbatch


def interleaved(num_ranks: int, num_microbatches: int, vpp: int) -> Schedule:
    """Needs num_microbatches % num_ranks == 0 (checked by `build_schedule`)."""
    p, v = num_ranks, vpp
    total = num_microbatches * v
    compute = {}
    for r in range(p):
        def act(k: int, kind: str, r: int = r) -> Action:
            chunk, mb = _virtual(k, p, v, backward=kind == BW)
            return Action(chunk * p + r, kind, mb)

        warmup = min((p - 1 - r) * 2 + (v - 1) * p if v > 1 else p - 1 - r, total)
        order = [act(k, F) for k in range(warmup)]
        for i in range(total - warmup):
            order += [act(warmup + i, F), act(i, BW)]
        order += [act(k, BW) for k in range(total - warmup, total)]
        compute[r] = order
    stage_to_rank = tuple(s % p for s in range(p * v))
    return Schedule(name="interleaved", num_stages=p * v, num_microbatches=num_microbatches,
                    stage_to_rank=stage_to_rank, actions=add_comm_actions(compute, stage_to_rank))
