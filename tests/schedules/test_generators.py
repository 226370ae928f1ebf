"""Generators: every legal (pp, vpp, microbatches) validates; every illegal one raises PlanError."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxgraph.errors import PlanError
from mxgraph.schedules import (
    BW,
    OVERLAP_F_B,
    RECV_F,
    SCHEDULES,
    SEND_F,
    F,
    W,
    build_schedule,
    validate,
)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def legal(name, pp, m, vpp):
    if name in ("gpipe", "1f1b", "zbh1"):
        return vpp == 1
    if name == "interleaved":
        return m % pp == 0
    return vpp == 2 and m >= 2 * pp  # dualpipev


def expected_peak_in_flight(name, pp, m, vpp, rank):
    """Peak (F done, B not yet) stage-microbatches on `rank`, from each schedule's design."""
    if name == "gpipe":
        return m
    if name in ("1f1b", "zbh1"):
        return min(pp - rank, m)
    return None


@pytest.mark.parametrize("name", list(SCHEDULES))
@SETTINGS
@given(pp=st.integers(2, 16), vpp=st.integers(1, 4), m=st.integers(1, 64), legal_bias=st.booleans())
def test_sweep(name, pp, vpp, m, legal_bias):
    if legal_bias:  # steer half the examples to legal inputs
        vpp = {"interleaved": vpp, "dualpipev": 2}.get(name, 1)
        m = max(m - m % pp, pp) if name == "interleaved" else m
        m = max(m, 2 * pp) if name == "dualpipev" else m
    if not legal(name, pp, m, vpp):
        with pytest.raises(PlanError):
            build_schedule(name, pp, m, vpp)
        return
    sched = build_schedule(name, pp, m, vpp)
    peaks = validate(sched)
    assert sched.num_microbatches == m and sched.num_ranks == pp
    for r in range(pp):
        want = expected_peak_in_flight(name, pp, m, vpp, r)
        if want is not None:
            assert peaks[r] == want
        # the max_in_flight bound is checked against the same count
        validate(sched, max_in_flight=peaks)


@pytest.mark.parametrize("name, pp, m, vpp, match", [
    ("nope", 4, 8, 1, "valid schedules: gpipe, 1f1b, interleaved, zbh1, dualpipev"),
    ("1f1b", 4, 8, 2, "vpp must be 1"),
    ("zbh1", 4, 8, 3, "vpp must be 1"),
    ("gpipe", 0, 8, 1, "pp must be an integer >= 1"),
    ("gpipe", 4, 0, 1, "num_microbatches must be an integer >= 1"),
    ("interleaved", 4, 6, 2, "multiple of pp=4"),
    ("dualpipev", 4, 7, 2, r"num_microbatches >= 2 \* pp = 8"),
    ("dualpipev", 4, 8, 1, "vpp must be 2"),
])
def test_plan_errors_name_value_and_choices(name, pp, m, vpp, match):
    with pytest.raises(PlanError, match=match):
        build_schedule(name, pp, m, vpp)


def test_default_vpp():
    assert build_schedule("interleaved", 2, 4).num_stages == 4
    assert build_schedule("dualpipev", 2, 4).num_stages == 4
    assert build_schedule("1f1b", 2, 4).num_stages == 2


def test_one_f_one_b_order():
    sched = build_schedule("1f1b", 4, 6)
    assert " ".join(str(a) for a in sched.compute_only()[1]) == \
        "1F0 1F1 1F2 1BW0 1F3 1BW1 1F4 1BW2 1F5 1BW3 1BW4 1BW5"


def test_zbh1_defers_w_by_rank():
    sched = build_schedule("zbh1", 4, 6)
    rank0 = " ".join(str(a) for a in sched.compute_only()[0])
    assert rank0.startswith("0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5")
    last = " ".join(str(a) for a in sched.compute_only()[3])
    assert last.startswith("3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4")
    assert last.endswith("3B5 3W2 3W3 3W4 3W5")


def test_interleaved_placement_and_order():
    sched = build_schedule("interleaved", 2, 4, 2)
    assert sched.stage_to_rank == (0, 1, 0, 1)
    assert [str(a) for a in sched.compute_only()[0]][:6] == ["0F0", "0F1", "2F0", "2F1", "0F2", "2BW0"]


def test_comm_actions_follow_placement():
    sched = build_schedule("1f1b", 3, 2)
    rank1 = [str(a) for a in sched.actions[1]]
    assert rank1[:3] == ["1RECV_F0", "1F0", "1SEND_F0"]
    assert "1RECV_B0" in rank1 and "1SEND_B0" in rank1
    assert not any(a.kind == RECV_F for a in sched.actions[0])


def test_dualpipev_shape():
    pp = 4
    sched = build_schedule("dualpipev", pp, 10)
    assert sched.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert sched.stages_of(1) == [1, 6]
    last = sched.actions[pp - 1]
    # the turn (stage 3 -> 4) and the loss stage on rank 0 need no messages
    turn = {str(a) for a in last if a.is_comm and a.stage in (pp - 1, pp)}
    assert not any(t.startswith((f"{pp - 1}SEND_F", f"{pp}RECV_F", f"{pp}SEND_B", f"{pp - 1}RECV_B"))
                   for t in turn)
    assert not any(a.kind == SEND_F and a.stage == 2 * pp - 1 for acts in sched.actions.values() for a in acts)
    kinds = {a.kind for acts in sched.actions.values() for a in acts}
    assert {OVERLAP_F_B, F, BW, W} <= kinds
    # rank p-1's first step-4 pair runs unoverlapped: F of stage p-1 then BW of stage p
    comp = [str(a) for a in sched.compute_only()[pp - 1]]
    i = comp.index("4BW0")
    assert comp[i - 1] == "3F4" and "&" in comp[i + 1]
