"""Compute orders vs torch.distributed.pipelining's generators (the peer and oracle).

Uses torch's private per-rank order builders on bare instances (no process group); skips
if a torch release renames them.
"""

import pytest

from mxgraph.schedules import BW, Action, B, F, W, build_schedule

ts = pytest.importorskip("torch.distributed.pipelining.schedules")
KIND = {"FORWARD": F, "FULL_BACKWARD": BW, "BACKWARD_INPUT": B, "BACKWARD_WEIGHT": W}


def convert(action) -> Action:
    if action.computation_type.name == "OVERLAP_F_B":
        fwd, bwd = (convert(a) for a in action.sub_actions)
        return Action.overlap(fwd, bwd)
    return Action(action.stage_index, KIND[action.computation_type.name], action.microbatch_index)


def torch_orders(cls, **attrs):
    obj = object.__new__(cls)
    for key, value in attrs.items():
        setattr(obj, key, value)
    try:
        return {r: [convert(a) for a in obj._calculate_single_rank_operations(r) if a is not None]
                for r in range(attrs["pp_group_size"])}
    except AttributeError as err:  # private API moved: the oracle is gone, say so loudly
        pytest.fail(f"torch pipelining internals changed, the reference orders are "
                    f"unavailable: {err}")


@pytest.mark.parametrize("pp, m", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (8, 16), (8, 24)])
def test_dualpipev_matches_torch(pp, m):
    ref = torch_orders(ts.ScheduleDualPipeV, pp_group_size=pp, _n_microbatches=m)
    assert build_schedule("dualpipev", pp, m).compute_only() == ref


@pytest.mark.parametrize("pp, m, vpp", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2), (3, 9, 4)])
def test_interleaved_matches_torch(pp, m, vpp):
    rounds = max(1, m // pp)
    ref = torch_orders(ts.ScheduleInterleaved1F1B, pp_group_size=pp, _n_microbatches=m, n_local_stages=vpp,
                       number_of_rounds=rounds, microbatches_per_round=m // rounds)
    assert build_schedule("interleaved", pp, m, vpp).compute_only() == ref


def test_interleaved_vpp1_is_1f1b():
    assert build_schedule("interleaved", 4, 8, 1).compute_only() == build_schedule("1f1b", 4, 8).compute_only()
