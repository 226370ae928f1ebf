"""Overhead of the slow-node monitor's levels on a compiled step, side by side in one run.

Five compiled steps of the same model (same seed): two without a monitor (the second
shows the noise floor), and with a monitor at level 0, 1 and 2 (`Step.set_monitor`
before the first call, as `mxgraph train` does).
Rounds run one report interval of each in turn, rotating the order, so drift on a shared
machine hits all alike (intervals, not single steps: the profiler is the process's, and
level 2's must see only its own steps). Each step is timed around what the training loop
does: `step(x, y)`, zeroing the gradients and `monitor.step()` (whose exchange and
level-2 profile summary run once per `--report-every` steps: the mean shows them, the
median hides them). Overhead = the median (and mean, min, and median CPU time of this
process, which other jobs on a shared machine disturb less) step time over the
unmonitored one, minus 1.

End-to-end differences of a few percent drown in a shared machine's noise, so the
monitor's own time is estimated too ("self"): the timings each step records (sections
entered, segments between timing points) times their cost per call, measured here, plus
the measured `monitor.step()`. Level 2's profiler also slows every op while it records:
only the end-to-end figures show that. On one process level 1's meeting before each
collective (a one-element all-reduce on its group) does not run: a single-device step has
no collectives.

    python benchmarks/bench_monitor.py [--model llama-tiny] [--steps 60]
        [--batch-size 8] [--seq-len 128] [--report-every 10] [--device cpu]
        [--out bench_results/monitor.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import models
import mxgraph as mx
from mxgraph.runtime.monitor.slow_node import MonitorConfig, StepMonitor
from mxgraph.runtime.pipeline.programs import Program

VARIANTS = ("off", "off_again", "level0", "level1", "level2")
"""`off_again`, a second unmonitored step, shows the noise floor: its 'overhead' is none."""


def build(name: str, level: int | None, args, device: torch.device):
    torch.manual_seed(0)
    model = models.build_model(args.model, device=device)
    step = mx.compile(model, mx.Plan())
    monitor = None
    if level is not None:
        monitor = StepMonitor(config=MonitorConfig(level=level, report_every=args.report_every),
                              device=device)
        step.set_monitor(monitor)
    return step, monitor


def timed_step(step, monitor, batch, device: torch.device) -> tuple[float, float, float, int]:
    """(wall ms, this process's CPU ms, ms in `monitor.step()`, timings recorded) of one
    step as the training loop runs it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    step(*batch)
    for p in step.parameters():
        p.grad = None
    in_step, timings = 0.0, 0
    if monitor is not None:
        timings = monitor.timings_this_step
        begin = time.perf_counter()
        monitor.step()
        in_step = (time.perf_counter() - begin) * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3, in_step, timings


def call_costs_us(device: torch.device, calls: int = 20000) -> dict[str, float]:
    """Microseconds per `monitor.section` (enter, exit, record) and per timing point as the
    generated code calls it (its `point(i, section)`, `Program.point`, `ProgramTimer.point`)."""
    monitor = StepMonitor(config=MonitorConfig(level=1), device=device)
    start = time.perf_counter()
    for _ in range(calls):
        with monitor.section("forward_backward"):
            pass
    section = (time.perf_counter() - start) / calls * 1e6
    program = Program(gm=None, inputs=[], outputs=[])
    program.clock = monitor.program_timer([("fwd:layer 0", "compute", None),
                                           ("fwd:layer 1", "compute", None)])

    def point(index, section):  # as codegen writes it
        program.point(index)
    start = time.perf_counter()
    for i in range(calls):
        point(i & 1, "fwd:layer 0")
    program.clock.end()
    timing_point = (time.perf_counter() - start) / calls * 1e6
    return {"section_us": section, "point_us": timing_point}


def count_points(step) -> int:
    return sum(len(program.points) for executor in step.executors()
               for rt in executor.stages.values() for _, program in rt.programs.all())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench_results/monitor.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g).to(device)
                  for _ in range(2))
    runs = {name: build(name, int(name[-1]) if name.startswith("level") else None, args, device)
            for name in VARIANTS}
    for step, _ in runs.values():
        step.prepare(*batch)
    times: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in VARIANTS}
    blocks = -(-args.steps // args.report_every)
    for i in range(1 + blocks):  # a warm-up block, then the measured ones
        order = VARIANTS[i % len(VARIANTS):] + VARIANTS[:i % len(VARIANTS)]
        for name in order:  # one report interval each: level 2's profile sees only its own
            for _ in range(args.report_every):
                ms = timed_step(*runs[name], batch, device)
                if i:
                    times[name].append(ms)
    stats = {name: {"median_ms": statistics.median(s[0] for s in samples),
                    "mean_ms": statistics.fmean(s[0] for s in samples),
                    "min_ms": min(s[0] for s in samples),
                    "cpu_median_ms": statistics.median(s[1] for s in samples)}
             for name, samples in times.items()}
    costs = call_costs_us(device)
    rows = []
    for name in VARIANTS:
        step, monitor = runs[name]
        points = count_points(step)
        timings = max(s[3] for s in times[name])
        sections = timings - points  # the rest are segments: one (or more) per point run
        estimate_ms = (sections * costs["section_us"] + points * costs["point_us"]) / 1e3 + \
            statistics.fmean(s[2] for s in times[name])  # monitor.step(), reports included
        self_time = {"self_ms": round(estimate_ms, 4),
                     "self_pct": round(100 * estimate_ms / stats["off"]["median_ms"], 3)}
        row = {"variant": name, **{k: round(v, 3) for k, v in stats[name].items()}}
        for key in stats[name]:  # overhead against the unmonitored step, per statistic
            row[key.replace("_ms", "_overhead_pct")] = round(
                100 * (stats[name][key] / stats["off"][key] - 1), 2)
        sections = len(monitor.last_summaries[0]["sections"]) if monitor and monitor.last_summaries \
            else 0
        rows.append({**row, **self_time, "timing_points": points, "sections": sections})
    result = {"model": args.model, "device": str(device), "batch_size": args.batch_size,
              "seq_len": args.seq_len, "steps": blocks * args.report_every, "report_every": args.report_every,
              "torch": torch.__version__, "call_costs_us": costs, "rows": rows}
    print(f"{args.model} on {device}, batch {args.batch_size} x {args.seq_len}, "
          f"{blocks * args.report_every} steps each, report every {args.report_every}")
    print("overhead % vs no monitor: of the median, mean and min wall time, of the median CPU"
          " time of this process; self: timings x their call cost + monitor.step(), % of the"
          " unmonitored median")
    print(f"per call: section {costs['section_us']:.2f} us, timing point {costs['point_us']:.2f} us")
    print(f"{'variant':8s} {'median ms':>10s} {'ovh %':>7s} {'mean ms':>9s} {'ovh %':>7s} "
          f"{'min ms':>8s} {'ovh %':>7s} {'cpu ms':>8s} {'ovh %':>7s} {'self %':>7s} {'points':>7s} "
          f"{'sections':>9s}")
    for r in rows:
        print(f"{r['variant']:8s} {r['median_ms']:10.2f} {r['median_overhead_pct']:7.2f} "
              f"{r['mean_ms']:9.2f} {r['mean_overhead_pct']:7.2f} {r['min_ms']:8.2f} "
              f"{r['min_overhead_pct']:7.2f} {r['cpu_median_ms']:8.2f} "
              f"{r['cpu_median_overhead_pct']:7.2f} {r['self_pct']:7.3f} {r['timing_points']:7d} "
              f"{r['sections']:9d}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
