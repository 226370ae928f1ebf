"""Overlap is not free (`DeviceProfile.overlap_slowdown`): every collective the search hides
behind compute - a data-parallel bucket and ZeRO-1's gathers, a sequence-parallel gather or
scatter split in tp chunks, an F&B pair's collectives under DualPipeV - adds
`overlap_slowdown` of its hidden seconds to the step. Each is checked against the same
prediction with the slowdown at 0 (overlap free), which the hidden seconds come from."""
from __future__ import annotations

import dataclasses

import pytest

import models
from mxgraph.devices.catalog import BUILTIN, load_device
from mxgraph.plan import Plan
from mxgraph.search.layer_cost import TraceCache
from mxgraph.search.part_time import hidden_share, part_times
from mxgraph.search.predict import pair_hidden, plan_costs, predict
from mxgraph.search.setting import Setting

H100 = load_device("h100-sxm")
FREE = dataclasses.replace(H100, overlap_slowdown=0.0)
CACHE = TraceCache(models)
"""One trace per strategy of llama-tiny for every setting here."""


def setting(device, gpus: int = 4) -> Setting:
    return Setting(models.preset_config("llama-tiny"), device, gpus, 2 * gpus, 64, models,
                   cache=CACHE)


def test_gpu_profiles_price_overlap_and_name_a_source():
    for name, profile in BUILTIN.items():
        if name == "cpu":  # a placeholder until --calibrate measures it
            assert profile.overlap_slowdown == 0.0
            continue
        assert 0.0 < profile.overlap_slowdown < 0.5
        assert "overlap_slowdown" in profile.sources
    assert H100.overlap_cost(2.0) == pytest.approx(2.0 * H100.overlap_slowdown)
    assert H100.overlap_cost(-1.0) == 0.0


@pytest.mark.parametrize("zero1", [False, True])
def test_hidden_gradient_buckets_slow_the_backward(zero1):
    """Many buckets, overlapped: all but the last (and ZeRO-1's first gather) hide, and the
    step grows by overlap_slowdown of the hidden seconds."""
    plan = Plan(dp=4, zero1=zero1, bucket_mb=0.05, overlap=True)
    free, paid = (predict(setting(d), plan, 1) for d in (FREE, H100))
    hidden = free.parts_s["grad_sync"]
    off = predict(setting(FREE), dataclasses.replace(plan, overlap=None), 1)
    busy = off.parts_s["grad_sync"]  # overlap off: every bucket exposed
    assert busy > hidden > 0
    assert paid.parts_s["grad_sync"] == pytest.approx(
        hidden + H100.overlap_slowdown * (busy - hidden), rel=1e-9)
    assert paid.step_s - free.step_s == pytest.approx(
        H100.overlap_slowdown * (busy - hidden), rel=1e-9)
    assert sum(paid.breakdown_s.values()) == pytest.approx(paid.step_s, rel=1e-9)


def test_chunked_tp_collectives_slow_the_gemms_they_hide_behind():
    plan = Plan(tp=2, dp=2, sequence_parallel=True, overlap={"tp_chunks": 2})
    share = hidden_share(plan, "tp", "all_gather")
    assert share == pytest.approx(0.5)
    free_setting, paid_setting = setting(FREE), setting(H100)
    costs = plan_costs(free_setting, plan, True)
    free = part_times(free_setting, plan, costs, "dense", "F", 1)
    paid = part_times(paid_setting, plan, plan_costs(paid_setting, plan, True), "dense", "F", 1)
    whole = part_times(free_setting, dataclasses.replace(plan, overlap=None), costs, "dense",
                       "F", 1)["comm"]  # every collective exposed
    assert whole > free["comm"] > 0
    assert paid["comm"] == pytest.approx(
        free["comm"] + H100.overlap_slowdown * (whole - free["comm"]), rel=1e-9)
    assert {k: paid[k] for k in ("gemm", "attention", "memory")} == \
        {k: free[k] for k in ("gemm", "attention", "memory")}


def test_an_f_and_b_pair_hides_what_contention_leaves():
    comm = {0: {"F": 2.0, "B": 3.0, "W": 1.0}}
    plan = Plan(pp=2, dp=1, schedule="dualpipev", micro_batches=4, overlap=True)
    assert pair_hidden(plan, comm) == {0: {"F": 2.0, "B": 3.0, "BW": 4.0}}
    keep = 1 - H100.overlap_slowdown
    assert pair_hidden(plan, comm, H100.overlap_slowdown)[0] == pytest.approx(
        {"F": 2.0 * keep, "B": 3.0 * keep, "BW": 4.0 * keep})
    assert pair_hidden(dataclasses.replace(plan, overlap=None), comm, 0.2) == {}


def test_calibration_over_two_ranks_measures_the_slowdown(tmp_path):
    """`mxgraph search --calibrate cpu --nproc 2 --quick`: the device file holds a measured
    overlap_slowdown (GEMMs beside all-gathers against alone: a finite share, at least 0)
    beside its collective fits, and the search reads it back."""
    import math
    import subprocess
    import sys
    out = tmp_path / "cpu2.toml"
    subprocess.run([sys.executable, "-m", "mxgraph.cli", "search", "--calibrate", "cpu",
                    "--nproc", "2", "--quick", "--out", str(out)], check=True, timeout=600,
                   capture_output=True)
    device = load_device(str(out))
    assert math.isfinite(device.overlap_slowdown) and 0.0 <= device.overlap_slowdown < 4.0
    assert "overlap_slowdown" in out.read_text()
    assert {fit.kind for fit in device.collective} >= {"all_gather", "reduce_scatter"}
