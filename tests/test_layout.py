"""Stage layouts: parsing, min-max balancing, empty-layer padding (61 -> 64 at PP=8, VPP=2)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxgraph.errors import PlanError
from mxgraph.schedules.layout import (
    balance_layers,
    format_layout,
    pad_empty_layers,
    parse_layout,
    slots_to_layout,
    stage_costs,
)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def test_parse_example():
    stages = parse_layout("E t*3 | t*4 | t*4 | t*3 L")
    assert stages == [["E", "t", "t", "t"], ["t"] * 4, ["t"] * 4, ["t", "t", "t", "L"]]
    assert format_layout(stages) == "E t*3 | t*4 | t*4 | t*3 L"
    assert parse_layout("E _ t | t _") == [["E", "_", "t"], ["t", "_"]]


@pytest.mark.parametrize("text, match", [
    ("E t | | t L", "stage 1 is empty"),
    ("t E | t", "'E' .* must be the first token"),
    ("t L | t", "'L' .* must be the last token"),
    ("t*0 | t", "repeat count"),
    ("E x*3 | t", "bad layout token 'x\\*3'"),
    ("E t*a", "bad layout token"),
])
def test_parse_errors(text, match):
    with pytest.raises(PlanError, match=match):
        parse_layout(text)


def brute_force_best(costs, k, embed, head):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        stages = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
        best = min(best, max(stage_costs(stages, costs, embed, head)))
    return best


@SETTINGS
@given(costs=st.lists(st.integers(0, 9).map(float), min_size=1, max_size=9), k=st.integers(1, 5),
       embed=st.sampled_from([0.0, 1.0, 4.0]), head=st.sampled_from([0.0, 2.0, 6.0]))
def test_balance_is_optimal_and_contiguous(costs, k, embed, head):
    if k > len(costs):
        with pytest.raises(PlanError, match="pad_empty_layers"):
            balance_layers(costs, k, embed, head)
        return
    stages = balance_layers(costs, k, embed, head)
    assert [i for s in stages for i in s] == list(range(len(costs)))
    assert all(stages)
    assert max(stage_costs(stages, costs, embed, head)) == pytest.approx(brute_force_best(costs, k, embed, head))


def test_balance_moves_layers_off_the_head_stage():
    stages = balance_layers([1.0] * 8, 2, embed_cost=0.0, head_cost=2.0)
    assert [len(s) for s in stages] == [5, 3]


def test_deepseek_v3_61_to_64():
    slots = pad_empty_layers(61, pp=8, vpp=2)
    assert len(slots) == 16 and all(len(s) == 4 for s in slots)
    assert sum(len(s) for s in slots) == 64
    assert [x for s in slots for x in s if x is not None] == list(range(61))
    assert slots[0] == [None, 0, 1, 2] and slots[15] == [59, 60, None, None]
    assert all(None not in s for s in slots[1:15])
    per_rank = [sum(len(slots[s]) for s in range(16) if s % 8 == r) for r in range(8)]
    assert per_rank == [8] * 8
    assert slots_to_layout(slots).startswith("E _ t*3 | t*4") and slots_to_layout(slots).endswith("t*2 _*2 L")


@SETTINGS
@given(layers=st.integers(1, 130), pp=st.integers(1, 16), vpp=st.integers(1, 4))
def test_padding_properties(layers, pp, vpp):
    stages = pp * vpp
    if layers < stages:
        with pytest.raises(PlanError, match="virtual stages"):
            pad_empty_layers(layers, pp, vpp)
        return
    slots = pad_empty_layers(layers, pp, vpp)
    width = -(-layers // stages)
    assert len(slots) == stages and all(len(s) == width for s in slots)
    assert [x for s in slots for x in s if x is not None] == list(range(layers))
    assert all(any(x is not None for x in s) for s in slots)  # every stage keeps a real layer
    # placeholders fill the outermost stages first: a stage only has them if all stages
    # further out (by distance to the nearer end) are full of placeholders but one layer
    empties = [s.count(None) for s in slots]
    for s, e in enumerate(empties):
        if e:
            outer = [t for t in range(stages) if min(t, stages - 1 - t) < min(s, stages - 1 - s)]
            assert all(empties[t] == width - 1 for t in outer)


def test_padding_errors():
    with pytest.raises(PlanError, match="pp must be >= 1"):
        pad_empty_layers(8, 0, 1)
    with pytest.raises(PlanError, match="cannot give each of pp\\*vpp = 16"):
        pad_empty_layers(15, 8, 2)
