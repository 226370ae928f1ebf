"""Slow-node detection: scoring rules, report format, levels 1/2 of an eager model in one
process, 4 gloo ranks end to end (compiled steps: tests/runtime/test_monitor_compiled.py)."""

import collections
import dataclasses
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mxgraph.runtime.monitor.slow_node import MonitorConfig, StepMonitor, score


def _summ(vals, kind="compute", name="backward"):
    return [{"host": f"h{r}", "sections": {name: v}, "kinds": {name: kind}}
            for r, v in enumerate(vals)]


def test_score_names_the_outlier_only():
    cfg = MonitorConfig(min_abs_ms=1.0)
    found = score(_summ([10.0, 10.4, 9.8, 14.0]), {}, cfg)
    assert [(f.rank, f.section, f.basis) for f in found] == [(3, "backward", "ranks")]
    assert 1.35 < found[0].slowdown < 1.45
    assert score(_summ([10.0, 10.4, 9.8, 10.9]), {}, cfg) == []  # noise
    assert score(_summ([0.1, 0.1, 0.1, 0.5]), {}, cfg) == []  # below the ms floor
    assert score(_summ([10.0, 10.0, 10.0, 40.0], kind="wait"), {}, cfg) == []  # never blamed


def test_score_compares_the_ranks_holding_a_section():
    """Pipeline ranks hold different layers: a section is scored over the ranks that
    report it; with two, the slower against the faster."""
    cfg = MonitorConfig(min_abs_ms=1.0)
    summaries = _summ([10.0, 10.2, 30.0, 10.1], name="fwd:layer 5")
    for r in (0, 1):  # pp rank 0 holds other layers
        summaries[r] = {"host": f"h{r}", "sections": {"fwd:layer 0": 5.0 + 20.0 * r},
                        "kinds": {"fwd:layer 0": "compute"}}
    found = score(summaries, {}, cfg)
    assert {(f.rank, f.section, f.ranks) for f in found} == {(1, "fwd:layer 0", 2),
                                                            (2, "fwd:layer 5", 2)}
    assert found[0].reference_ms == 5.0 and found[0].slowdown == 5.0


def test_score_drops_comm_of_ranks_that_waited_for_a_straggler():
    cfg = MonitorConfig(min_abs_ms=1.0)
    summaries = [{"host": "h0", "sections": {"forward_backward": 40.0, "grad_sync": 2.0},
                  "kinds": {"forward_backward": "compute", "grad_sync": "comm"}},
                 {"host": "h1", "sections": {"forward_backward": 10.0, "grad_sync": 32.0},
                  "kinds": {"forward_backward": "compute", "grad_sync": "comm"}}]
    assert [(f.rank, f.section) for f in score(summaries, {}, cfg)] == [(0, "forward_backward")]
    summaries[0]["sections"]["forward_backward"] = 10.0  # no straggler: a slow transfer
    assert [(f.rank, f.section) for f in score(summaries, {}, cfg)] == [(1, "grad_sync")]


def test_score_uses_own_history_when_all_ranks_slow_down():
    cfg = MonitorConfig(min_abs_ms=1.0)
    hist = {(r, "all_to_all"): collections.deque([10.0, 10.2, 9.9]) for r in range(4)}
    found = score(_summ([25.0, 25.5, 24.8, 25.2], kind="comm", name="all_to_all"), hist, cfg)
    assert {(f.rank, f.basis) for f in found} == {(r, "history") for r in range(4)}


def test_report_needs_consecutive_intervals_and_is_delivered(tmp_path):
    got = []
    mon = StepMonitor(config=MonitorConfig(report_every=1, min_intervals=2), callback=got.append,
                      json_path=str(tmp_path / "slow.jsonl"))
    fake = _summ([10.0, 10.0, 30.0, 10.0])
    assert mon.ingest(fake) == []
    reps = mon.ingest(fake)
    assert [(r.rank, r.section, r.intervals) for r in reps] == [(2, "backward", 2)]
    assert got == reps and reps[0].message == \
        "rank 2 on h2: backward is 3.0x the median (30.0 ms vs 10.0 ms per step, 2 intervals)"
    rec = json.loads((tmp_path / "slow.jsonl").read_text().splitlines()[0])
    assert {k: rec[k] for k in ("rank", "host", "section", "kind", "slowdown", "value_ms",
                                "reference_ms", "step")} == \
        {"rank": 2, "host": "h2", "section": "backward", "kind": "compute", "slowdown": 3.0,
         "value_ms": 30.0, "reference_ms": 10.0, "step": 0}


def test_eager_levels_1_and_2_add_layer_and_op_sections():
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8)]))
    layers = model[0]
    mon = StepMonitor(config=MonitorConfig(level=2, report_every=3))
    mon.instrument_layers(model)
    for _ in range(3):
        with mon.section("forward"):
            x = torch.randn(4, 8, requires_grad=True)
            y = layers[0](x)
        with mon.section("backward"):
            y.sum().backward()
        mon.step()
    sections = mon.last_summaries[0]["sections"]
    assert {"forward", "backward", "fwd:0.0", "bwd:0.0"} <= set(sections)
    assert any(k.startswith("op:aten::") for k in sections)


# -- 4 ranks ------------------------------------------------------------------------------
DELAY_S = 0.03
SCENARIOS = {  # name: (steps, slow rank, where the delay goes)
    "clean": (100, None, None),
    "backward": (30, 1, "backward"),
    "collective": (30, 2, "collective"),
}


def _worker(rank, world, init_file, out_path):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    results = {}
    for scenario, (steps, slow_rank, where) in SCENARIOS.items():
        slow = rank == slow_rank

        def sync(flat, slow=slow and where == "collective"):
            dist.all_reduce(flat)
            if slow:
                time.sleep(DELAY_S)  # a slow link/stack on this rank: its collective ends late

        cfg = MonitorConfig(level=1, report_every=10, min_abs_ms=5.0)
        mon = StepMonitor(config=cfg, host=f"node-{rank // 2}")
        for _ in range(steps):
            with mon.section("data"):
                x = torch.randn(16, 32)
            with mon.section("forward"):
                loss = model(x).square().mean()
            with mon.section("backward"):
                loss.backward()
                if slow and where == "backward":
                    time.sleep(DELAY_S)
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            mon.collective("grad_sync", sync, flat)
            with mon.section("optimizer"):
                opt.step()
                opt.zero_grad()
            mon.step()
        results[scenario] = [dataclasses.asdict(r) for r in mon.reports]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_four_ranks_find_the_slow_rank_and_section(tmp_path):
    out = tmp_path / "reports.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(4, str(tmp_path / "store"), str(out)), nprocs=4, join=True)
    results = json.loads(out.read_text())
    assert results["clean"] == []
    bwd = results["backward"]
    assert bwd
    assert {(r["rank"], r["section"], r["kind"]) for r in bwd} == {(1, "backward", "compute")}
    assert bwd[0]["step"] <= 30 and bwd[0]["host"] == "node-0"
    coll = results["collective"]
    assert coll and {(r["rank"], r["section"], r["kind"]) for r in coll} == \
        {(2, "grad_sync", "comm")}
    assert coll[0]["step"] <= 30
