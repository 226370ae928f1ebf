"""Simulator vs closed-form bubbles and memory (unit costs F = B = W = 1, BW = 2, comm 0).

Formulas checked (p ranks, m microbatches, v chunks per rank, idle = total - busy per rank):
- GPipe, 1F1B:      idle = (p-1)(F+BW),         bubble ratio = (p-1)/(m+p-1)
- interleaved:      idle = (p-1)(F+BW) with per-chunk costs, ratio = (p-1)/(v*m+p-1), m % p == 0
- ZB-H1 (m >= p):   idle = (p-1)(F+B_full-2W) = (p-1)(F+B-W) = (p-1), one third of 1F1B's
                    (p-1)(F+B_full) = 3(p-1) (B_full = B + W, the DualPipe table's "B");
                    stage-0 peak activation = 1F1B's (= p units); rank r peak = (p-r) + r*w_retained
- DualPipeV:        idle = (S/2-1)(F&B + B_full - 3W) with S = 2p stages (the DualPipe table's
                    PP counts stages, i.e. the ranks of the DualPipe it was cut from), F&B = F + B_full
                    (no overlap speed-up), B_full = B + W; i.e. (p-1)(F&B + B_full - 3W) = 2(p-1);
                    peak = S + 1 = 2p+1 stage-units on every rank; 1 parameter copy per rank.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxgraph.errors import PlanError
from mxgraph.schedules import Costs, build_schedule, simulate

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
UNIT = Costs(f=1, b=1, w=1)  # bw = b + w = 2


def close(a, b):
    return abs(a - b) < 1e-9


@SETTINGS
@given(name=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(2, 16), m=st.integers(1, 48))
def test_gpipe_and_1f1b_bubble(name, p, m):
    tl = simulate(build_schedule(name, p, m), UNIT)
    assert close(tl.total_time, 3 * (m + p - 1))
    assert all(close(i, (p - 1) * 3) for i in tl.idle.values())
    assert close(tl.overall_bubble_ratio, (p - 1) / (m + p - 1))
    assert all(close(b, (p - 1) / (m + p - 1)) for b in tl.bubble_ratio.values())


@SETTINGS
@given(p=st.integers(2, 12), v=st.integers(1, 4), k=st.integers(1, 4))
def test_interleaved_bubble(p, v, k):
    m = k * p
    tl = simulate(build_schedule("interleaved", p, m, v), UNIT)
    assert all(close(i, 3 * (p - 1)) for i in tl.idle.values())
    assert close(tl.overall_bubble_ratio, (p - 1) / (v * m + p - 1))


@SETTINGS
@given(p=st.integers(2, 16), extra=st.integers(0, 32), w_retained=st.sampled_from([0.0, 0.5, 1.0]))
def test_zbh1_third_of_1f1b_and_same_stage0_memory(p, extra, w_retained):
    m = p + extra
    zb = simulate(build_schedule("zbh1", p, m), UNIT, w_retained=w_retained)
    ref = simulate(build_schedule("1f1b", p, m), UNIT, w_retained=w_retained)
    f, b, w = 1, 1, 1
    b_full = b + w  # the DualPipe table's B; the ZB paper writes (p-1)(F + B - W) with B = B_input
    assert all(close(i, (p - 1) * (f + b_full - 2 * w)) for i in zb.idle.values())  # = p - 1
    assert all(close(i, (p - 1) * (f + b_full)) for i in ref.idle.values())  # 1F1B: 3(p - 1)
    assert all(close(3 * z, r) for z, r in zip(zb.idle.values(), ref.idle.values(), strict=True))
    assert close(zb.total_time, 3 * m + p - 1)
    assert zb.peak_activations[0] == ref.peak_activations[0] == p
    for r in range(p):
        assert close(zb.peak_activations[r], (p - r) + r * w_retained)


@SETTINGS
@given(p=st.integers(1, 16), extra=st.integers(0, 24), c=st.sampled_from([1.0, 0.5, 2.5]))
def test_dualpipev_bubble_memory_params(p, extra, c):
    m = 2 * p + extra
    costs = Costs(f=c, b=c, w=c)
    tl = simulate(build_schedule("dualpipev", p, m), costs)
    f, b_full, w = c, 2 * c, c
    f_and_b = f + b_full
    stages = 2 * p
    assert all(close(i, (stages / 2 - 1) * (f_and_b + b_full - 3 * w)) for i in tl.idle.values())
    assert set(tl.peak_activations.values()) == {stages + 1}
    assert set(tl.param_copies.values()) == {1.0}


@pytest.mark.parametrize("f, b, w, overlap_factor", [(1, 2, 1, 1), (2, 3, 1, 1), (1, 1.5, 0.5, 1), (1, 1, 1, 0.8)])
def test_dualpipev_table_formula_bounds_unequal_costs(f, b, w, overlap_factor):
    """With B != W (or a real overlap speed-up) the table's formula is an upper bound here,
    not exact: e.g. F=1, B=2, W=1 on 4 ranks idles 11, the formula says 12."""
    p = 4
    tl = simulate(build_schedule("dualpipev", p, 12), Costs(f=f, b=b, w=w, overlap_factor=overlap_factor))
    bound = (p - 1) * (overlap_factor * (f + b + w) + (b + w) - 3 * w)
    assert all(i <= bound + 1e-9 for i in tl.idle.values())


def test_param_copies_and_activation_normalisation():
    for name, vpp in [("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("dualpipev", 2)]:
        tl = simulate(build_schedule(name, 4, 8, vpp), UNIT)
        assert set(tl.param_copies.values()) == {1.0}
    tl = simulate(build_schedule("dualpipev", 4, 8), UNIT)
    assert tl.peak_activation_microbatches[0] == pytest.approx(9 / 2)


def test_comm_latency_and_per_stage_costs():
    p = 4
    one = build_schedule("1f1b", p, 1)
    assert simulate(one, Costs(comm=0.25)).total_time == pytest.approx(p * 1 + p * 2 + 2 * (p - 1) * 0.25)
    slow = Costs(per_stage={2: {"F": 3.0, "W": 2.0}})
    assert slow.of(one.actions[2][1]) == 3.0  # 2F0
    assert simulate(one, slow).total_time == pytest.approx((p - 1) + 3 + (p - 1) * 2 + (1 + 2))
    assert Costs(bw=1.5).of(build_schedule("gpipe", 1, 1).actions[0][1]) == 1.5


def test_bad_costs():
    with pytest.raises(PlanError, match="cost f must be finite and >= 0"):
        Costs(f=-1)
    with pytest.raises(PlanError, match="valid kinds: F, B, W, BW"):
        Costs(per_stage={0: {"X": 1.0}})
    with pytest.raises(PlanError, match="w_retained"):
        simulate(build_schedule("1f1b", 2, 2), UNIT, w_retained=2.0)


def test_exports(tmp_path):
    tl = simulate(build_schedule("dualpipev", 2, 4), UNIT)
    trace = tmp_path / "t.json"
    tl.to_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X"]
    assert len(compute) == sum(1 for e in tl.events if e.action.is_compute)
    assert {e["tid"] for e in compute} == {0, 1}
    png = tmp_path / "t.png"
    tl.to_png(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(tl.summary())


def test_time_grid():
    text = simulate(build_schedule("1f1b", 2, 2), UNIT).to_text()
    rows = text.splitlines()
    assert rows[1].split()[2:] == ["0F0", "0F1", ".", ".", "0BW0", "0BW0", ".", "0BW1", "0BW1"]
    assert rows[2].split()[2:] == [".", "1F0", "1BW0", "1BW0", "1F1", "1BW1", "1BW1", ".", "."]
