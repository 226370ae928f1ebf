"""Validator: hand-broken schedules fail with the failing step marked in the grid."""

import dataclasses

import pytest

from mxgraph.schedules import (
    Action,
    Schedule,
    ScheduleError,
    add_comm_actions,
    build_schedule,
    parse_action,
    validate,
)


def make(rows: dict[int, str], num_stages=2, m=1, stage_to_rank=None, comms=True) -> Schedule:
    stage_to_rank = stage_to_rank or tuple(range(num_stages))
    compute = {r: [parse_action(t) for t in text.split()] for r, text in rows.items()}
    acts = add_comm_actions(compute, stage_to_rank) if comms else compute
    return Schedule(name="hand", num_stages=num_stages, num_microbatches=m,
                    stage_to_rank=stage_to_rank, actions=acts)


def test_good_hand_schedule():
    sched = make({0: "0F0 0F1 0B0 0W0 0BW1", 1: "1F0 1BW0 1F1 1B1 1W1"}, m=2)
    assert validate(sched) == {0: 2, 1: 1}


def test_b_before_f_on_same_rank():
    sched = make({0: "0F0 0BW0", 1: "1BW0 1F0"})
    with pytest.raises(ScheduleError, match="1BW0 needs 1F0, which comes later") as err:
        validate(sched)
    step = [str(a) for a in sched.actions[1]].index("1BW0")
    assert (err.value.rank, err.value.step) == (1, step)
    assert "[1BW0]" in str(err.value) and ">rank 1" in str(err.value)


def test_w_before_b():
    with pytest.raises(ScheduleError, match="0W0 needs 0B0"):
        validate(make({0: "0F0 0W0 0B0", 1: "1F0 1BW0"}))


def test_deadlock_is_reported_with_both_ranks():
    # rank 0 sends microbatch 1 forward only after it waits for microbatch 1's gradient
    sched = make({0: "0F0 0F1 0BW0 0BW1", 1: "1F0 1BW0 1F1 1BW1"}, m=2)
    rank0 = sched.actions[0]
    rank0.remove(Action(0, "SEND_F", 1))
    rank0.insert(rank0.index(Action(0, "RECV_B", 1)) + 1, Action(0, "SEND_F", 1))
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 step 5 waits in 0RECV_B1 for 1SEND_B1 "
                                            r"\(rank 1 step 7\); rank 1 step 4 waits in 1RECV_F1") as err:
        validate(sched)
    assert "[0RECV_B1]" in str(err.value)


def test_send_before_compute():
    sched = make({0: "0F0 0BW0", 1: "1F0 1BW0"}, comms=False)
    sched.actions[0][:] = [parse_action(t) for t in "0SEND_F0 0F0 0RECV_B0 0BW0".split()]
    sched.actions[1][:] = [parse_action(t) for t in "1RECV_F0 1F0 1BW0 1SEND_B0".split()]
    with pytest.raises(ScheduleError, match="0SEND_F0 sends the output of 0F0, which comes later"):
        validate(sched)


def test_missing_and_unexpected_messages():
    sched = make({0: "0F0 0BW0", 1: "1F0 1BW0"})
    sched.actions[1].remove(Action(1, "RECV_F", 0))
    with pytest.raises(ScheduleError, match="missing 1RECV_F0 on rank 1"):
        validate(sched)
    same_rank = make({0: "0F0 1F0 1BW0 0BW0"}, stage_to_rank=(0, 0))
    same_rank.actions[0].insert(1, Action(0, "SEND_F", 0))
    with pytest.raises(ScheduleError, match="unexpected 0SEND_F0"):
        validate(same_rank)


def test_completeness_and_placement():
    with pytest.raises(ScheduleError, match="missing 1F0"):
        validate(make({0: "0F0 0BW0", 1: "1BW0"}))
    with pytest.raises(ScheduleError, match="missing its W"):
        validate(make({0: "0F0 0BW0", 1: "1F0 1B0"}))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(make({0: "0F0 0BW0 0F0", 1: "1F0 1BW0"}))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(make({0: "0F0 0BW0 1F0", 1: "1BW0"}))
    with pytest.raises(ScheduleError, match="names stage 0 / microbatch 5"):
        validate(make({0: "0F0 0BW0 0F5", 1: "1F0 1BW0"}))


def test_memory_bound():
    sched = build_schedule("gpipe", 2, 4)
    assert validate(sched) == {0: 4, 1: 4}
    with pytest.raises(ScheduleError, match="rank 0 step .*: 4 microbatches in flight, more than the bound 3"):
        validate(sched, max_in_flight=3)
    validate(build_schedule("1f1b", 2, 4), max_in_flight={0: 2, 1: 1})


def test_error_grid_window_is_short():
    sched = build_schedule("1f1b", 4, 32)
    broken = dataclasses.replace(sched, actions={r: list(a) for r, a in sched.actions.items()})
    broken.actions[3].reverse()
    with pytest.raises(ScheduleError) as err:
        validate(broken)
    assert len(str(err.value).splitlines()) < 12


def test_blocking_sends_only_gpipe_survives():
    """With rendezvous sends (no isend, no batching) the steady-state 1F1B exchange between
    neighbours deadlocks: the executor must post sends asynchronously."""
    validate(build_schedule("gpipe", 4, 8), blocking_sends=True)
    validate(build_schedule("1f1b", 4, 8))
    with pytest.raises(ScheduleError, match="deadlock: rank 0 step 7 waits in 0SEND_F3 for 1RECV_F3"):
        validate(build_schedule("1f1b", 4, 8), blocking_sends=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(build_schedule("dualpipev", 2, 4), blocking_sends=True)
