"""The slow-node monitor inside compiled steps (`Step.set_monitor`): level 1's timing points
in the generated code time every layer and collective, level 0 adds no code, level 2
profiles the compiled ops; on 4 gloo ranks a straggler injected in one layer of one rank
is named by rank and layer within three report intervals (dp x pp under 1F1B and under
DualPipeV, dp x tp), and 100 clean steps raise nothing."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch.fx import Graph

import models
import mxgraph as mx
from mxgraph.errors import PlanError
from mxgraph.passes.monitor_points import program_points
from mxgraph.runtime.monitor.slow_node import MonitorConfig, ProgramTimer, StepMonitor
from tests.distributed import run_ranks

DELAY_S = 0.05
"""Far above the noise of a loaded machine: the suite runs this beside other multi-process
tests on 2 cores, where time slices of another process show up as tens of ms in a section."""
_SLOW = {"rank": None}
"""The rank whose `mxtest::straggle` sleeps (None: nobody)."""


@torch.library.custom_op("mxtest::straggle", mutates_args=())
def straggle(x: torch.Tensor) -> torch.Tensor:
    """Identity; sleeps DELAY_S on rank `_SLOW["rank"]`: a straggler inside one layer."""
    if _SLOW["rank"] is not None and dist.is_initialized() and dist.get_rank() == _SLOW["rank"]:
        time.sleep(DELAY_S)
    return x.clone()


@straggle.register_fake
def _(x):
    return torch.empty_like(x)


straggle.register_autograd(lambda ctx, grad: grad)


class Straggle(torch.nn.Module):
    """`inner` then `mxtest::straggle`: inside the wrapped module's layer region."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.ops.mxtest.straggle(self.inner(x))


def _batch(seed: int, batch: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (batch, seq), generator=g),
            torch.randint(0, 256, (batch, seq), generator=g))


def _train(step, monitor, batch, steps: int) -> None:
    """The loop `mxgraph train` runs, as the monitor sees it."""
    for _ in range(steps):
        with monitor.section("data"):
            x, y = batch
        step(x, y)
        with monitor.section("optimizer"):
            for p in step.parameters():
                p.grad = None
        monitor.step()


def _sources(step) -> list[str]:
    return [program.source for executor in step.executors() for rt in executor.stages.values()
            for _, program in rt.programs.all()]


# -- one process ------------------------------------------------------------------------
def test_level1_times_every_layer_inside_the_compiled_step():
    torch.manual_seed(0)
    step = mx.compile(models.build_model("llama-tiny"), mx.Plan())
    monitor = StepMonitor(config=MonitorConfig(level=1, report_every=2))
    step.set_monitor(monitor)
    _train(step, monitor, _batch(0), 2)
    sections = monitor.last_summaries[0]["sections"]
    layers = {f"{d}:layer {i}" for d in ("fwd", "bwd") for i in range(4)}
    assert layers <= set(sections)
    assert {monitor.kinds[s] for s in layers} == {"compute"}
    assert sum(sections[s] for s in layers) <= sections["forward_backward"]
    assert {"data", "optimizer", "forward_backward"} <= set(sections)
    assert all("point(" in src for src in _sources(step) if "torch.ops.aten" in src)


def test_level0_adds_no_code_and_level1_needs_it_compiled():
    torch.manual_seed(0)
    step = mx.compile(models.build_model("llama-tiny", n_layers=1), mx.Plan())
    monitor = StepMonitor(config=MonitorConfig(level=0, report_every=2))
    step.set_monitor(monitor)
    _train(step, monitor, _batch(0), 2)
    assert not any("point(" in src for src in _sources(step))
    assert set(monitor.last_summaries[0]["sections"]) == {"data", "forward_backward", "optimizer"}
    with pytest.raises(PlanError, match="before the first step"):
        step.set_monitor(StepMonitor(config=MonitorConfig(level=1)))
    step.set_monitor(None)  # level 0 or None: any time
    step(*_batch(0))


def test_level2_profiles_the_compiled_ops():
    torch.manual_seed(0)
    step = mx.compile(models.build_model("llama-tiny", n_layers=1), mx.Plan())
    monitor = StepMonitor(config=MonitorConfig(level=2, report_every=2))
    step.set_monitor(monitor)
    _train(step, monitor, _batch(0), 2)
    sections = monitor.last_summaries[0]["sections"]
    assert any(s.startswith("op:aten::mm") for s in sections) and "fwd:layer 0" in sections


def test_points_of_an_async_collective_and_a_pause():
    """A functional all-reduce start and its wait: the group meets before the start, the
    wait is timed with its start (comm); nodes without module meta stay in their section.
    A pause (an overlapped F&B pair's other part runs) is not the program's time."""
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    nodes = []
    for target, args, layer in [(aten.mm.default, (x, x), 2), (c10d.all_reduce.default, (x, "sum", "g"), 2),
                                (aten.mm.default, (x, x), 2), (aten.neg.default, (x,), None),
                                (c10d.wait_tensor.default, (1,), None), (aten.add.Tensor, (x, x), 3)]:
        args = tuple(nodes[a] if isinstance(a, int) else a for a in args)
        node = graph.call_function(target, args)
        node.meta["val"] = torch.empty(4, 4)
        if layer is not None or target is c10d.all_reduce.default:
            node.meta["custom"] = {"module": f"layers.{layer}.attn", "layer": layer}
        nodes.append(node)
    graph.output(nodes[-1])
    points = program_points(graph, "bwd")
    assert [(nodes.index(p.node), p.section, p.kind, p.group) for p in points] == [
        (0, "bwd:layer 2", "compute", None), (1, "all_reduce of layer 2.wait", "wait", "g"),
        (1, "all_reduce of layer 2", "comm", None), (2, "bwd:layer 2", "compute", None),
        (4, "all_reduce of layer 2", "comm", None), (5, "bwd:layer 3", "compute", None)]

    monitor = StepMonitor(config=MonitorConfig(level=1, report_every=1))
    clock = ProgramTimer(monitor, [("fwd:layer 0", "compute", None)])

    def program():
        clock.point(0)
        time.sleep(0.01)
        yield  # paused: 50 ms elsewhere
        time.sleep(0.01)
    work = clock.paused(program())
    next(work)
    time.sleep(0.05)
    for _ in work:
        pass
    clock.end()
    monitor.step()
    assert 15 < monitor.last_summaries[0]["sections"]["fwd:layer 0"] < 45


# -- 4 gloo ranks -----------------------------------------------------------------------
SCENARIOS = [  # name, plan, slow rank, slow layer, steps, report_every, layers
    ("dp_pp", {"dp": 2, "pp": 2, "micro_batches": 2}, 3, 1, 15, 5, 2),  # layer 1: ranks 2, 3
    ("tp", {"tp": 2, "dp": 2}, 1, 0, 15, 5, 2),
    # DualPipeV's V: pp rank 1 (ranks 2, 3) runs stages 1 and 2 = layers 1 and 2, and
    # overlaps one micro-batch's F with another's B
    ("dualpipev", {"dp": 2, "pp": 2, "schedule": "dualpipev", "micro_batches": 4}, 2, 2, 15, 5,
     4),
    ("clean", {"tp": 2, "dp": 2}, None, None, 100, 10, 2),
]


def _straggler_worker(rank, world, out_path):
    results, steps = {}, {}
    for name, plan, slow_rank, layer, num_steps, every, layers in SCENARIOS:
        key = tuple(sorted(plan.items()))
        if key not in steps:
            torch.manual_seed(0)
            model = models.build_model("llama-tiny", n_layers=layers)
            model.layers[layer].mlp = Straggle(model.layers[layer].mlp)
            steps[key] = mx.compile(model, mx.Plan(**plan))
        step = steps[key]
        monitor = StepMonitor(config=MonitorConfig(level=1, report_every=every, min_abs_ms=15.0),
                              host=f"node-{rank // 2}")
        step.set_monitor(monitor)
        batch = _batch(100 + step.mesh.coords["dp"], batch=max(2, plan.get("micro_batches", 1)),
                       seq=8)
        step.prepare(*batch)
        _SLOW["rank"] = slow_rank
        _train(step, monitor, batch, num_steps)
        results[name] = {"reports": [json.loads(r.to_json()) for r in monitor.reports],
                         "sections": monitor.last_summaries[rank]["sections"],
                         "kinds": monitor.kinds}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


@pytest.mark.slow
def test_four_ranks_name_the_straggler_layer(tmp_path):
    out = tmp_path / "results.json"
    run_ranks(4, _straggler_worker, str(out))
    results = json.loads(out.read_text())
    for name, _, slow_rank, layer, _num_steps, every, _ in SCENARIOS[:3]:
        reports = results[name]["reports"]
        assert reports, name
        assert {r["rank"] for r in reports} == {slow_rank}, reports
        named = [r for r in reports if r["section"] == f"fwd:layer {layer}"]
        assert named and named[0]["step"] <= 3 * every and named[0]["kind"] == "compute"
        assert named[0]["message"].startswith(f"rank {slow_rank} on node-{slow_rank // 2}: "
                                              f"fwd:layer {layer} is ")
    assert results["clean"]["reports"] == []
    sections, kinds = results["tp"]["sections"], results["tp"]["kinds"]
    for layer in (0, 1):
        assert kinds[f"all_reduce of layer {layer}"] == "comm"
        assert kinds[f"all_reduce of layer {layer}.wait"] == "wait"
        assert f"all_reduce of layer {layer}" in sections
    assert kinds["grad_sync"] == "comm" and "grad_sync.wait" in sections
    pipelined = results["dp_pp"]["sections"]  # rank 0: stage 0
    assert {"pipeline_wait", "fwd:layer 0", "bwd:layer 0"} <= set(pipelined)
    assert "fwd:layer 1" not in pipelined
