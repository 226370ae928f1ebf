"""Action string form, Schedule text form and the grid printer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxgraph.errors import PlanError
from mxgraph.schedules import (
    BW,
    COMM_KINDS,
    COMPUTE_KINDS,
    OVERLAP_F_B,
    Action,
    F,
    build_schedule,
    format_grid,
    parse_action,
    schedule_from_text,
)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)

plain = st.builds(Action, st.integers(0, 99), st.sampled_from(COMPUTE_KINDS + COMM_KINDS), st.integers(0, 999))


@SETTINGS
@given(plain)
def test_plain_round_trip(action):
    assert parse_action(str(action)) == action


@SETTINGS
@given(st.integers(0, 99), st.integers(0, 999), st.integers(0, 99), st.sampled_from(["B", "BW"]), st.integers(0, 999))
def test_overlap_round_trip(fs, fm, bs, bkind, bm):
    action = Action.overlap(Action(fs, F, fm), Action(bs, bkind, bm))
    assert action.kind == OVERLAP_F_B
    assert (action.stage, action.microbatch) == (fs, fm)
    assert parse_action(str(action)) == action
    assert str(action) == f"{fs}F{fm}&{bs}{bkind}{bm}"


def test_examples():
    assert str(Action(1, F, 0)) == "1F0"
    assert parse_action("0W3") == Action(0, "W", 3)
    assert parse_action("2SEND_F1") == Action(2, "SEND_F", 1)
    assert parse_action("3BW12") == Action(3, BW, 12)  # not "3B" + "W12"
    assert parse_action("1F3&6BW0").parts == (Action(1, F, 3), Action(6, BW, 0))


@pytest.mark.parametrize("text", ["", "F0", "1X0", "1F", "-1F0", "1F0&2F1", "1F0&2B1&3B2", "1 F0"])
def test_bad_strings(text):
    with pytest.raises(PlanError):
        parse_action(text)


def test_bad_actions():
    with pytest.raises(PlanError, match="valid kinds"):
        Action(0, "Q", 0)
    with pytest.raises(PlanError):
        Action(0, OVERLAP_F_B, 0)  # no parts
    with pytest.raises(PlanError):
        Action(0, F, 0, (Action(0, F, 0),))


def test_schedule_text_round_trip():
    sched = build_schedule("dualpipev", 3, 6)
    again = schedule_from_text(sched.to_text())
    assert again == sched


def test_grid_marks_step():
    sched = build_schedule("1f1b", 2, 2)
    grid = format_grid(sched, mark=(1, 2))
    rows = grid.splitlines()
    assert rows[0].startswith("step")
    assert rows[2].startswith(">rank 1")
    assert f"[{sched.actions[1][2]}]" in rows[2]
    compute = format_grid(sched, compute_only=True)
    assert "SEND" not in compute and "1F0" in compute
