"""Eager vs torch.compile (inductor, and the mxmaca backend) vs mxgraph.compile (Python or
Inductor codegen, fusion off or on), side by side, on the CPU or a GPU (`--device cuda`).

For each model: compile time (first step minus a warm step), median step time
(forward + backward, fill .grad), tokens/s, and peak memory of the timed steps: on the CPU
the resident memory above the resident memory before them (Linux VmHWM after resetting
it), on a GPU `torch.cuda.max_memory_allocated` above the allocation before them. Each
(model, runner) pair runs in its own subprocess so memory and caches do not leak between
them.

    python benchmarks/bench_compile.py [--models llama-tiny,llama-20m] [--steps 10]
        [--runners eager,inductor,mxmaca,mxmaca-inductor,mxgraph,mxgraph-inductor]
        [--batch-size 8] [--seq-len 256] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--out bench_results/compile.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNNERS = {
    "eager": "the model's own forward + backward",
    "inductor": "torch.compile(model)",
    "mxmaca": 'torch.compile(model, backend="mxmaca")',
    "mxmaca-inductor": 'torch.compile(model, backend="mxmaca", '
                       'options={"plan": Plan(codegen="inductor")})',
    "mxgraph": 'mxgraph.compile(model) (the default plan: codegen="auto", Inductor on a GPU, '
               'Python on the CPU)',
    "mxgraph-fusion": "mxgraph.compile(model, Plan(fusion=True))",
    "mxgraph-python": 'mxgraph.compile(model, Plan(codegen="python"))',
    "mxgraph-python-fusion": 'mxgraph.compile(model, Plan(codegen="python", fusion=True))',
    "mxgraph-inductor": 'mxgraph.compile(model, Plan(codegen="inductor"))',
    "mxgraph-inductor-fusion": 'mxgraph.compile(model, Plan(codegen="inductor", fusion=True))',
}
PLANS = {"mxgraph": {}, "mxgraph-fusion": {"fusion": True},
         "mxgraph-python": {"codegen": "python"},
         "mxgraph-python-fusion": {"codegen": "python", "fusion": True},
         "mxgraph-inductor": {"codegen": "inductor"},
         "mxgraph-inductor-fusion": {"codegen": "inductor", "fusion": True}}
DEFAULT_RUNNERS = ("eager", "inductor", "mxmaca", "mxmaca-inductor", "mxgraph",
                   "mxgraph-inductor")
ROOT = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(model_name: str, runner: str, steps: int, batch_size: int, seq_len: int,
            device: str = "cpu", dtype: str = "float32") -> dict:
    """Run in this process: build, compile, time; returns one result row."""
    import torch

    import models
    import mxgraph

    torch.manual_seed(0)
    model = models.build_model(model_name, device=device, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=g).to(device)
    y = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=g).to(device)
    gpu = device != "cpu"

    def sync():
        if gpu:
            torch.cuda.synchronize()
    if runner == "eager":
        def step():
            model(x, y).backward()
    elif runner in ("inductor", "mxmaca", "mxmaca-inductor"):
        options = {"mxmaca": {"backend": "mxmaca"}, "inductor": {},
                   "mxmaca-inductor": {"backend": "mxmaca", "options": {
                       "plan": mxgraph.Plan(codegen="inductor")}}}[runner]
        compiled = torch.compile(model, **options)

        def step():
            compiled(x, y).backward()
    else:
        compiled = mxgraph.compile(model, mxgraph.Plan(**PLANS[runner]))

        def step():
            compiled(x, y)
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step()
    sync()
    warm = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    if gpu:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if gpu else _status_kib("VmHWM") * 1024
    step_s = statistics.median(times)
    return {"model": model_name, "runner": runner, "device": device, "dtype": dtype,
            "params": sum(p.numel() for p in model.parameters()),
            "compile_s": max(0.0, first - warm), "step_ms": step_s * 1e3,
            "tokens_per_s": batch_size * seq_len / step_s,
            "peak_mib": max(0, peak - base) / 2**20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-tiny,llama-20m")
    parser.add_argument("--runners", default=",".join(DEFAULT_RUNNERS),
                        help="comma-separated, of " + "; ".join(f"{k}: {v}" for k, v in RUNNERS.items()))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU, MXMACA's too)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's parameter dtype")
    parser.add_argument("--out", default="bench_results/compile.json")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "RUNNER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        row = measure(*args.one, args.steps, args.batch_size, args.seq_len, args.device,
                      args.dtype)
        print("ROW " + json.dumps(row))
        return 0
    unknown = [r for r in args.runners.split(",") if r not in RUNNERS]
    if unknown:
        parser.error(f"unknown runner {unknown[0]!r}; choose from {', '.join(RUNNERS)}")
    rows = []
    for model_name in args.models.split(","):
        for runner in args.runners.split(","):
            command = [sys.executable, __file__, "--one", model_name, runner,
                       "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                       "--seq-len", str(args.seq_len), "--device", args.device,
                       "--dtype", args.dtype]
            print(f"running {model_name} / {runner} ...", file=sys.stderr, flush=True)
            env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's mxgraph and models
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            lines = [l for l in result.stdout.splitlines() if l.startswith("ROW ")]
            if result.returncode or not lines:
                print(result.stderr[-2000:], file=sys.stderr)
                rows.append({"model": model_name, "runner": runner, "error": True})
                continue
            rows.append(json.loads(lines[0][4:]))
    print_table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"batch_size": args.batch_size, "seq_len":
                                          args.seq_len, "device": args.device,
                                          "dtype": args.dtype, "rows": rows}, indent=2))
    return 0


def print_table(rows) -> None:
    """One row per (model, runner); speed-ups over eager and over torch.compile (inductor)."""
    ok = [r for r in rows if "error" not in r]
    eager = {r["model"]: r for r in ok if r["runner"] == "eager"}
    inductor = {r["model"]: r for r in ok if r["runner"] == "inductor"}
    print(f"{'model':<12} {'runner':<23} {'params':>9} {'compile s':>9} {'step ms':>9} "
          f"{'tokens/s':>9} {'vs eager':>9} {'vs inductor':>11} {'peak MiB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<12} {r['runner']:<23} failed")
            continue
        ratios = [f"{base[r['model']]['step_ms'] / r['step_ms']:.2f}x" if r["model"] in base
                  else "-" for base in (eager, inductor)]
        print(f"{r['model']:<12} {r['runner']:<23} {r['params'] / 1e6:>8.2f}M "
              f"{r['compile_s']:>9.2f} {r['step_ms']:>9.1f} {r['tokens_per_s']:>9.0f} "
              f"{ratios[0]:>9} {ratios[1]:>11} "
              f"{r['peak_mib']:>9.1f}")


if __name__ == "__main__":
    sys.exit(main())
