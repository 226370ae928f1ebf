"""Auto Search on the GPU it runs on: calibrate this device, predict a one-GPU run of a
llama-1b-class model under three layouts, measure each with `mxgraph train`, and print the
errors (issue #31's GPU check; `benchmarks/gpu_check.sh` runs it on a GPU).

1. **calibrate** - `mxgraph search --calibrate gpu` (`--quick`: fewer sizes and repeats)
   writes OUT/device.toml: GEMMs by shape, attention, memory-bound kernels, the optimizer.
2. **search** - `mxgraph search` for `--model` with `--layers` transformer layers (the same
   layer shapes, fewer of them, so that compiling stays short) on 1 GPU, global batch
   `--global-batch` sequences of `--seq-len` tokens; its top plan, and that plan with
   selective (`norm,act`) and with full recompute: the three layouts.
3. **predict** - `mxgraph search --evaluate` of each layout on the calibrated profile.
4. **measure** - each layout runs `mxgraph train` for `--steps` steps (`search_worker.py`:
   the median interval between optimizer steps past `--warmup`; peak memory from
   `torch.cuda.max_memory_allocated`).

    python benchmarks/bench_search_gpu.py [--model llama-1b] [--layers 4]
        [--global-batch 8] [--seq-len 2048] [--steps 8] [--warmup 3] [--quick]
        [--layouts top,selective,full] [--timeout 180] [--out bench_results/search_gpu]

Prints a table (predicted and measured step seconds and peak GiB, the errors) and writes
OUT/search_gpu.json. On the CPU it runs the same way (tiny sizes: the test suite does).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "search_worker.py"
VARIANTS = {"top": ("top plan", None), "selective": ("selective recompute", "norm,act"),
            "full": ("full recompute", "full")}
"""The layouts (`--layouts`): the search's top plan, and that plan with `recompute` set to
each policy."""


def checkout_env() -> dict:
    """This process's environment with this checkout first on the path."""
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cli(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    """`mxgraph ARGV` in a subprocess with this checkout on the path; its output is kept."""
    return subprocess.run([sys.executable, "-m", "mxgraph.cli", *argv], env=checkout_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def model_toml(name: str, layers: int | None) -> str:
    """A search model file for preset `name`, with `layers` transformer layers."""
    import models
    config = dataclasses.asdict(models.preset_config(name))
    if layers is not None:
        config["n_layers"] = layers
    lines = [f'family = "{models.PRESETS[name][0]}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in config.items() if v is not None]
    return "\n".join(lines) + "\n"


def with_recompute(plan_toml: str, recompute: str | None) -> str:
    """`plan_toml` with its `recompute` line set to `recompute` (None: as it is)."""
    if recompute is None:
        return plan_toml
    lines = [f'recompute = "{recompute}"' if line.startswith("recompute =") else line
             for line in plan_toml.splitlines()]
    return "\n".join(lines) + "\n"


def measure(args, plan_path: Path, out: Path) -> dict:
    """Train `plan_path` for `args.steps` steps in one process; the worker's row."""
    train = ["--model", args.model, "--plan", str(plan_path), "--steps", str(args.steps),
             "--batch-size", str(args.global_batch), "--seq-len", str(args.seq_len),
             "--warmup", "1", "--val-batches", "1", "--no-progress"]
    if args.layers is not None:
        train += ["--model-config", f"n_layers={args.layers}"]
    command = [sys.executable, str(WORKER), "--out", str(out), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--", *train]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, env=checkout_env(), capture_output=True, text=True,
                              timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired as timeout:
        said = timeout.stderr or b""
        said = said.decode(errors="replace") if isinstance(said, bytes) else said
        return {"error": f"timed out after {args.timeout:.0f} s: {said[-1500:]}"}
    path = Path(f"{out}.rank0")
    if proc.returncode or not path.exists():
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    row = json.loads(path.read_text())
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", help="model preset")
    parser.add_argument("--layers", type=int, default=4,
                        help="transformer layers (0: the preset's own)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="training steps per layout")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--quick", action="store_true", help="calibrate with few sizes")
    parser.add_argument("--layouts", default="top,selective,full",
                        help="comma-separated, of: top (the search's top plan), selective "
                             "(it with norm,act recompute), full (it with full recompute)")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds each calibration, search or training run may take")
    parser.add_argument("--out", default="bench_results/search_gpu")
    args = parser.parse_args(argv)
    args.layers = args.layers or None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = out / "device.toml"
    started = time.perf_counter()
    proc = cli("search", "--calibrate", "gpu", "--out", str(device),
               *(["--quick"] if args.quick else []), timeout=args.timeout)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    print(f"calibrated in {time.perf_counter() - started:.0f} s: {device}", flush=True)
    (out / "model.toml").write_text(model_toml(args.model, args.layers))
    setting = ["--model", str(out / "model.toml"), "--gpus", "1", "--device", str(device),
               "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len)]
    proc = cli("search", *setting, "--top-k", "1", "--plans-dir", str(out / "plans"),
               "--explain", timeout=args.timeout)
    print(proc.stdout, proc.stderr[-3000:], flush=True)
    if proc.returncode:
        return 1
    top = (out / "plans" / "plan1.toml").read_text()
    rows = []
    for name, recompute in (VARIANTS[key] for key in args.layouts.split(",")):
        plan_path = out / f"{name.replace(' ', '_')}.toml"
        plan_path.write_text(with_recompute(top, recompute))
        row = {"layout": name, "recompute": recompute or "(the top plan's)"}
        proc = cli("search", *setting, "--evaluate", str(plan_path), "--json",
                   str(out / "evaluate.json"), timeout=args.timeout)
        if proc.returncode:
            row["error"] = proc.stderr[-2000:]
        else:
            predicted = json.loads((out / "evaluate.json").read_text())[0]
            row.update(predicted_s=predicted["step_s"],
                       predicted_gib=predicted["peak_memory_gib"],
                       breakdown_s=predicted.get("breakdown_s"))
            measured = measure(args, plan_path, out / f"{name.replace(' ', '_')}.run")
            row.update(measured_s=measured.get("step_s"),
                       measured_gib=(measured.get("peak_bytes") or 0) / 2**30,
                       sections_s=measured.get("sections_s"), error=measured.get("error"))
        rows.append(row)
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'breakdown_s'})}",
              flush=True)
        (out / "search_gpu.json").write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 0 if all(r.get("measured_s") for r in rows) else 1


def print_table(rows: list[dict]) -> None:
    """Predicted against measured step time and peak memory, per layout."""
    print(f"{'layout':<20} {'pred s':>8} {'meas s':>8} {'error':>7} {'pred GiB':>9} "
          f"{'meas GiB':>9} {'error':>7}")
    for r in rows:
        if not r.get("measured_s"):
            print(f"{r['layout']:<20} failed: {(r.get('error') or '')[-300:]}")
            continue
        step_error = r["predicted_s"] / r["measured_s"] - 1
        memory_error = r["predicted_gib"] / r["measured_gib"] - 1 if r["measured_gib"] else 0
        print(f"{r['layout']:<20} {r['predicted_s']:>8.4f} {r['measured_s']:>8.4f} "
              f"{step_error:>+7.1%} {r['predicted_gib']:>9.2f} {r['measured_gib']:>9.2f} "
              f"{memory_error:>+7.1%}")


if __name__ == "__main__":
    sys.exit(main())
