"""Page faults and step time of CPU steps with freed memory kept in the process
(`mxgraph/runtime/host_memory.py`) against glibc's own settings (`MXGRAPH_HOST_MALLOC=system`),
side by side.

Each run is a process of its own (glibc's settings are process-wide): a compiled step of
`--model` on `--batch-size` x `--seq-len` tokens runs `--steps` times, and the minor page
faults and the time of the second half of the steps are counted. Runs alternate between the
two settings, `--repeats` of each, so load on a shared machine hits both alike. The ratio is
system's median faults over kept's (higher: more faults saved). A measurement: it depends on
the machine's load and heap layout, which is why it is a benchmark and not a test
(tests/runtime/test_host_memory.py checks the mechanism itself).

    python benchmarks/bench_host_memory.py [--model llama-tiny] [--batch-size 8]
        [--seq-len 256] [--steps 8] [--repeats 3] [--out bench_results/host_memory.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"kept": {}, "system": {"MXGRAPH_HOST_MALLOC": "system"}}
WORKER = """
import resource, sys, time, torch
import mxgraph as mx
import models
from mxgraph.runtime import host_memory
model_name, batch_size, seq_len, steps = sys.argv[1], *map(int, sys.argv[2:5])
torch.manual_seed(0)
model = models.build_model(model_name)
step = mx.compile(model, mx.Plan(codegen="python"))
x = torch.randint(0, 256, (batch_size, seq_len))
y = torch.randint(0, 256, (batch_size, seq_len))
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts, times = [], []
for _ in range(steps):
    before, started = faults(), time.perf_counter()
    step(x, y)
    model.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - started); counts.append(faults() - before)
half = steps // 2
print(host_memory.keep_freed_memory(), sum(counts[half:]), sum(times[half:]) / (steps - half))
"""


def run_once(setting: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **SETTINGS[setting]}
    run = subprocess.run([sys.executable, "-c", WORKER, args.model, str(args.batch_size),
                          str(args.seq_len), str(args.steps)], capture_output=True, text=True,
                         env=env, check=True, timeout=600, cwd=ROOT)
    kept, faults, seconds = run.stdout.split()[-3:]
    return {"setting": setting, "kept": kept == "True", "faults": int(faults),
            "step_ms": float(seconds) * 1e3}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="steps a run (the second half counted)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting")
    parser.add_argument("--out", default="bench_results/host_memory.json")
    args = parser.parse_args(argv)
    runs = [run_once(setting, args) for _ in range(args.repeats) for setting in SETTINGS]
    rows = []
    for setting in SETTINGS:
        mine = [r for r in runs if r["setting"] == setting]
        rows.append({"setting": setting, "kept": mine[0]["kept"],
                     "faults_median": statistics.median(r["faults"] for r in mine),
                     "faults": [r["faults"] for r in mine],
                     "step_ms_median": statistics.median(r["step_ms"] for r in mine)})
    kept, system = rows
    ratio = system["faults_median"] / max(kept["faults_median"], 1)
    speedup = system["step_ms_median"] / kept["step_ms_median"]
    print(f"{args.model}, {args.batch_size} x {args.seq_len} tokens, faults and time of steps "
          f"{args.steps // 2 + 1}-{args.steps}, median of {args.repeats} processes")
    print(f"{'setting':<8} {'kept':>5} {'faults':>10} {'step ms':>9}  faults of each run")
    for row in rows:
        print(f"{row['setting']:<8} {str(row['kept']):>5} {row['faults_median']:>10.0f} "
              f"{row['step_ms_median']:>9.1f}  {row['faults']}")
    print(f"system / kept: faults x{ratio:.1f}, step time x{speedup:.2f}")
    result = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "steps": args.steps, "repeats": args.repeats, "rows": rows,
              "fault_ratio": ratio, "step_time_ratio": speedup}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
