"""Auto Search checked against measured runs: predicted vs measured step time and memory.

Setting (the issue's): 4 gloo ranks (`--nproc`) in a private network namespace whose
loopback is rate-limited to `--rate` (1gbit) with tc tbf (../shared/tools/shaped-link;
`--rate none`: the plain loopback), one OpenMP thread per rank (torchrun's default),
llama-20m and moe-20m (`--llama-model`, `--moe-model`; routed experts as one grouped GEMM,
`expert_impl=grouped_mm`, the form the search traces), global batch `--global-batch`
sequences of `--seq-len` tokens, float32 (what `mxgraph train` runs on the CPU).
`--plans` runs a subset of PLANS (measure and predict).

Steps (each can be skipped; results of earlier steps are read back from `--out`):
1. **measure** - every plan of PLANS runs `mxgraph train` (torchrun, 4 ranks, the shaped
   link) for `--steps` steps with `--batch-size` = global batch / dp. A wrapper around
   the command line (`--worker`) listens to every optimizer step through torch's global
   optimizer hooks: step time = the median interval between consecutive `optimizer.step()`
   ends after `--warmup` steps, the slowest rank's median; one step (the last) is
   profiled for memory and left out of the timing. Peak memory per rank = the bytes of
   every live tensor at that step's start (a `gc` walk over tensors: parameters, optimizer
   state, buffers, unique storages; gradients left out as `zero_grad` frees them, and the
   data loader's token corpus, host data the same for every plan) plus the
   peak of the CPU allocator's running total during the step (torch.profiler
   `profile_memory`, "Total Allocated" of its [memory] events, relative to the step's
   start); the JSON keeps both parts. The worst rank is compared.
2. **calibrate** - `mxgraph search --calibrate cpu --nproc 4` on the same shaped link
   writes the device TOML (GEMM, attention, elementwise and collective timings).
3. **predict** - `mxgraph search --evaluate PLAN --device <calibrated TOML> --json` for
   every measured plan (`--device`: another TOML or a built-in profile instead); Spearman
   rank correlation of step times, median absolute step-time error, memory error, and the
   top-1 of `mxgraph search` for the same setting against the best measured plan (the top-1
   is run with `mxgraph train` too when it is not among the measured plans; unless it is
   the best measured plan, it and the best measured plan run in turn `--rounds` times each
   and their medians are compared, side by side).
4. **scale** - the time `mxgraph search` takes for DeepSeek-V3 671B on 1024 H800s, and
   predicted vs published throughput for the published runs of record in
   published_runs.toml (their table, errors and family orders: bench_search_published.py).

    python benchmarks/bench_search.py [--skip measure,calibrate,predict,scale]
        [--rate 1gbit] [--plans "llama dp4,moe ep4"] [--steps 8] [--global-batch 8]
        [--seq-len 128] [--device cpu] [--out bench_results/search.json]
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

ROOT = Path(__file__).resolve().parents[1]
SHAPED_LINK = ROOT.parent / "shared" / "tools" / "shaped-link"
WORKER = Path(__file__).resolve().parent / "search_worker.py"
"""Each rank of a measured plan: `mxgraph train` with timing and memory hooks."""
NPROC = 4
"""Ranks of the issue's setting (`--nproc`); the PLANS names count them (dp4: all 4 ranks)."""
MOE_CONFIG = "expert_impl=grouped_mm"
PLANS: list[tuple[str, str, dict]] = [  # (name, family, Plan fields; mbs: sequences per micro-batch)
    ("llama dp4", "llama", {"mbs": 2}),
    ("llama dp4 mbs1", "llama", {"mbs": 1}),
    ("llama dp4 zero1", "llama", {"zero1": True, "mbs": 2}),
    ("llama dp4 full", "llama", {"recompute": "full", "mbs": 2}),
    ("llama tp2 dp2", "llama", {"tp": 2, "mbs": 4}),
    ("llama tp2 sp dp2 act", "llama", {"tp": 2, "sequence_parallel": True,
                                       "recompute": "norm,act", "mbs": 4}),
    ("llama tp2 pp2 1f1b", "llama", {"tp": 2, "pp": 2, "schedule": "1f1b", "mbs": 2}),
    ("llama pp2 dp2 1f1b", "llama", {"pp": 2, "schedule": "1f1b", "mbs": 1}),
    ("llama pp4 1f1b", "llama", {"pp": 4, "schedule": "1f1b", "mbs": 1}),
    ("llama pp4 zbh1", "llama", {"pp": 4, "schedule": "zbh1", "mbs": 1}),
    ("moe dp4", "moe", {"mbs": 2}),
    ("moe ep4", "moe", {"ep": 4, "mbs": 2}),
    ("moe ep2", "moe", {"ep": 2, "mbs": 2}),
    ("moe ep4 zero1", "moe", {"ep": 4, "zero1": True, "mbs": 2}),
    ("moe ep4 moe_full", "moe", {"ep": 4, "recompute": "moe_full", "mbs": 2}),
    ("moe pp2 ep2 1f1b", "moe", {"pp": 2, "ep": 2, "schedule": "1f1b", "mbs": 1}),
    ("moe tp2 ep2", "moe", {"tp": 2, "ep": 2, "mbs": 4}),
]
"""The family's preset is `--llama-model` (llama-20m) or `--moe-model` (moe-20m)."""


def plan_fields(fields: dict, global_batch: int, nproc: int) -> tuple[dict, int]:
    """(Plan fields with micro_batches, per-dp-rank batch) for a PLANS entry on `nproc`
    ranks (dp: the ranks tp, pp and cp leave)."""
    fields = dict(fields)
    mbs = fields.pop("mbs")
    dp = nproc // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1))
    local = global_batch // dp
    return {**fields, "micro_batches": local // mbs}, local


def measure_one(args, name: str, model: str, plan, local: int, workdir: Path) -> dict:
    """Run `plan` with `mxgraph train` on the shaped link, `local` sequences per data-parallel
    rank; the worst rank's numbers."""
    fields = {k: v for k, v in plan.to_dict().items() if v != getattr(type(plan)(), k)}
    plan_path = workdir / (name.replace(" ", "_") + ".toml")
    plan_path.write_text(plan.to_toml())
    out = workdir / (name.replace(" ", "_") + ".json")
    train_argv = ["--model", model, "--plan", str(plan_path), "--steps", str(args.steps),
                  "--batch-size", str(local), "--seq-len", str(args.seq_len), "--warmup", "1",
                  "--val-batches", "1", "--no-progress"]
    if model.startswith("moe"):
        train_argv += ["--model-config", MOE_CONFIG]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", str(WORKER), "--out", str(out), "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--", *train_argv]
    command = shaped(args.rate, command)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    ranks = []
    for r in range(args.nproc):
        path = Path(f"{out}.rank{r}")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    row = {"name": name, "model": model, "plan": fields, "plan_path": str(plan_path),
           "batch_per_dp_rank": local, "wall_s": round(time.perf_counter() - started, 1)}
    if proc.returncode or len(ranks) < args.nproc or any(r["step_s"] is None for r in ranks):
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        return row
    row["step_s"] = max(r["step_s"] for r in ranks)
    row["peak_bytes"] = max(r["peak_bytes"] for r in ranks)
    row["ranks"] = ranks
    return row


def shaped(rate: str, command: list[str]) -> list[str]:
    """`command` on the shaped link of `rate`, or as it is for "none" (the plain loopback)."""
    return command if rate == "none" else [str(SHAPED_LINK), rate, "--"] + command


def selected_plans(args) -> list[tuple[str, str, dict]]:
    """The PLANS entries `--plans` names (all by default), with the family's preset."""
    presets = {"llama": args.llama_model, "moe": args.moe_model}
    return [(name, presets[family], fields) for name, family, fields in PLANS
            if args.plans is None or name in args.plans]


def measure(args, results: dict) -> None:
    from mxgraph.plan import Plan
    workdir = Path(args.out).parent / "search_plans"
    workdir.mkdir(parents=True, exist_ok=True)
    done = {r["name"]: r for r in results.get("measured", []) if "error" not in r}
    rows = []

    def merged() -> list[dict]:  # this run's plans, then the others measured before
        names = {r["name"] for r in rows}
        return rows + [r for name, r in done.items() if name not in names]
    for name, model, fields in selected_plans(args):
        if name in done and done[name]["model"] == model and not args.remeasure:
            rows.append(done[name])
            continue
        fields, local = plan_fields(fields, args.global_batch, args.nproc)
        row = measure_one(args, name, model, Plan(**fields), local, workdir)
        rows.append(row)
        print(f"measured {name}: " + (f"{row['step_s']:.3f} s/step, peak "
                                      f"{row['peak_bytes'] / 2**20:.0f} MiB"
                                      if "error" not in row else "FAILED " + row["error"][-300:]),
              f"({row['wall_s']} s)", flush=True)
        results["measured"] = merged()
        save(args, results)
    results["measured"] = merged()


def save(args, results: dict) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman rank correlation of measured and predicted (bench_search_published's)."""
    from bench_search_published import spearman as rank_correlation
    return rank_correlation(xs, ys)


def _setting(model: str, device, args):
    import dataclasses

    import models
    from mxgraph.search.setting import Setting
    config = models.preset_config(model)
    if model.startswith("moe"):
        config = dataclasses.replace(config, expert_impl="grouped_mm")
    return Setting(config, device, args.nproc, args.global_batch, args.seq_len, models)


def later_steps(args, results: dict, skip: set) -> None:
    """Steps 2-4 (calibrate, predict, scale)."""
    device_path = Path(args.out).parent / "cpu_calibrated.toml"
    if "calibrate" not in skip:
        command = shaped(args.rate, [sys.executable, "-m", "mxgraph.cli", "search",
                                     "--calibrate", "cpu", "--nproc", str(args.nproc), "--out",
                                     str(device_path)])
        started = time.perf_counter()
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        results["calibration"] = {"path": str(device_path),
                                  "seconds": round(time.perf_counter() - started, 1)}
        save(args, results)
    if "predict" not in skip:
        predict_step(args, results, args.device or device_path, skip)
        save(args, results)
    if "scale" not in skip:
        scale_step(args, results)


def predict_step(args, results: dict, device_path: Path | str, skip: set) -> None:
    from mxgraph.devices.catalog import load_device
    from mxgraph.plan import Plan
    from mxgraph.search.enumerate import search
    from mxgraph.search.predict import predict_plan
    device = load_device(str(device_path))
    settings = {}
    wanted = {(name, model) for name, model, _ in selected_plans(args)}
    rows = [r for r in results.get("measured", [])
            if "error" not in r and (r["name"], r["model"]) in wanted]
    if not rows:
        raise SystemExit("predict: --out holds no measurement of the chosen plans and models; "
                         "run the measure step first")
    for row in rows:
        setting = settings.setdefault(row["model"], _setting(row["model"], device, args))
        p = predict_plan(setting, Plan.from_toml(row["plan_path"]), row["plan_path"])
        row["predicted"] = p.to_json()
        row["step_error"] = p.step_s / row["step_s"] - 1
        row["memory_error"] = p.peak_memory_gib * 2 ** 30 / row["peak_bytes"] - 1
    measured = [r["step_s"] for r in rows]
    predicted = [r["predicted"]["step_s"] for r in rows]
    summary = {"plans": len(rows), "spearman": spearman(measured, predicted),
               "median_abs_step_error": statistics.median(abs(r["step_error"]) for r in rows),
               "median_abs_memory_error": statistics.median(abs(r["memory_error"])
                                                            for r in rows),
               "max_abs_memory_error": max(abs(r["memory_error"]) for r in rows)}
    top = {}
    for model in sorted({r["model"] for r in rows}):
        started = time.perf_counter()
        best = search(settings[model], top_k=1).best[0]
        mine = [r for r in rows if r["model"] == model]
        best_measured = min(mine, key=lambda r: r["step_s"])
        top[model] = {"top1": best.to_json(), "search_s": round(time.perf_counter() - started, 1),
                      "best_measured": best_measured["name"],
                      "best_measured_step_s": best_measured["step_s"]}
        same = [r for r in mine if _same(r, best)]
        dp = args.nproc // (best.plan.tp * best.plan.pp * best.plan.cp)
        top1_run = (f"top-1 {model}", best.plan, args.global_batch // dp)
        if args.rounds and (same[0] is not best_measured if same else "measure" not in skip):
            side = side_by_side(args, model, top1_run, best_measured)
            top[model].update(side_by_side=side, top1_vs_best=side["top1_vs_best"],
                              top1_measured_step_s=statistics.median(side["top1_s"]))
            continue
        if not same and "measure" not in skip:  # run the top-1 too
            name, plan, local = top1_run
            row = measure_one(args, name, model, plan, local, Path(args.out).parent / "search_plans")
            print(f"measured the top-1 of {model}: " + (f"{row['step_s']:.3f} s/step"
                  if "error" not in row else "FAILED " + row["error"][-300:]), flush=True)
            same = [row] if "error" not in row else []
        top[model]["top1_measured_step_s"] = same[0]["step_s"] if same else None
        if same:
            top[model]["top1_vs_best"] = same[0]["step_s"] / best_measured["step_s"] - 1
    summary["top1"] = top
    results["summary"] = summary
    print(f"{'plan':<24} {'measured s':>10} {'predicted s':>11} {'error':>7} "
          f"{'meas MiB':>9} {'pred MiB':>9} {'error':>7}")
    for r in rows:
        print(f"{r['name']:<24} {r['step_s']:>10.3f} {r['predicted']['step_s']:>11.3f} "
              f"{r['step_error']:>7.1%} {r['peak_bytes'] / 2**20:>9.0f} "
              f"{r['predicted']['peak_memory_gib'] * 1024:>9.0f} {r['memory_error']:>7.1%}")
    print(json.dumps(summary, indent=1))


def side_by_side(args, model: str, top1_run: tuple, best_measured: dict) -> dict:
    """The search's top-1 (`top1_run`: name, Plan, sequences per data-parallel rank) and the
    best measured plan, run in turn `--rounds` times each (one machine state for both: two
    runs of one plan differ by up to ~17% on this 2-vCPU VM); the medians' ratio is the
    top-1's distance from the best."""
    from mxgraph.plan import Plan
    workdir = Path(args.out).parent / "search_plans"
    runs = {"top1": top1_run,
            "best": (best_measured["name"], Plan.from_toml(best_measured["plan_path"]),
                     best_measured["batch_per_dp_rank"])}
    times = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, (name, plan, local) in runs.items():
            row = measure_one(args, name, model, plan, local, workdir)
            if "error" in row:
                raise SystemExit(f"{name} failed: {row['error'][-300:]}")
            times[key].append(row["step_s"])
    ratio = statistics.median(times["top1"]) / statistics.median(times["best"]) - 1
    print(f"{model}: top-1 {times['top1']} s/step, {best_measured['name']} {times['best']} "
          f"s/step, side by side: top-1 {ratio:+.1%} against the best", flush=True)
    return {"top1_s": times["top1"], "best_s": times["best"], "top1_vs_best": ratio}


def _same(row: dict, prediction) -> bool:
    plan = prediction.plan.to_dict()
    fields = dict(row["plan"])
    keys = ("tp", "pp", "ep", "cp", "sequence_parallel", "zero1", "micro_batches", "schedule",
            "recompute", "offload", "vpp")
    defaults = {"tp": 1, "pp": 1, "ep": 1, "cp": 1, "sequence_parallel": False, "zero1": False,
                "micro_batches": 1, "schedule": "1f1b", "recompute": "", "offload": "", "vpp": 1}
    return all(fields.get(k, defaults[k]) == plan[k] for k in keys)


def scale_step(args, results: dict) -> None:
    """DeepSeek-V3 on 1024 H800s: search time; predicted vs published throughput of every
    row of published_runs.toml."""
    command = [sys.executable, "-m", "mxgraph.cli", "search", "--model", "deepseek-v3-671b",
               "--gpus", "1024", "--device", "h800", "--global-batch", "4096", "--seq-len",
               "4096", "--top-k", "5"]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    results["deepseek_search"] = {"command": " ".join(command[2:]), "code": proc.returncode,
                                  "wall_s": round(time.perf_counter() - started, 1),
                                  "output": proc.stdout[-3000:] or proc.stderr[-2000:]}
    print(proc.stdout[-3000:], proc.stderr[-500:])
    from bench_search_published import load_runs, predict_rows
    published = []
    for row in predict_rows(load_runs()):
        published.append({key: row[key] for key in (
            "what", "plan", "published_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu",
            "predicted_mfu", "peak_memory_gib", "source")})
        print(f"{row['what']}: predicted {row['predicted_tokens_per_s_per_gpu']:.0f} vs published "
              f"{row['published_tokens_per_s_per_gpu']:.0f} tokens/s/GPU (predicted step "
              f"{row['predicted_step_s']:.2f} s, MFU {row['predicted_mfu']:.1%}, bubble "
              f"{row['bubble']:.1%}, exposed comm {row['exposed_comm_s']:.2f} s, peak "
              f"{row['peak_memory_gib']:.0f} GiB)")
    results["published"] = published


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="comma list of steps to skip: measure, "
                        "calibrate, predict, scale")
    parser.add_argument("--rate", default="1gbit",
                        help="shaped link rate (tc tbf), or 'none' for the plain loopback")
    parser.add_argument("--plans", default=None,
                        help=f"comma list of PLANS names to measure and predict (default all: "
                        f"{', '.join(name for name, _, _ in PLANS)})")
    parser.add_argument("--nproc", type=int, default=NPROC,
                        help=f"ranks (default {NPROC}, as the plan names count); a plan's dp is "
                        "what its tp, pp and cp leave")
    parser.add_argument("--llama-model", default="llama-20m", help="preset of the llama plans")
    parser.add_argument("--moe-model", default="moe-20m", help="preset of the moe plans")
    parser.add_argument("--device", default=None,
                        help="predict: a built-in device profile (e.g. cpu) or device TOML "
                        "(default: the calibrate step's, cpu_calibrated.toml beside --out)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per measured plan")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3,
                        help="when the top-1 is not the best measured plan: runs of each, in "
                        "turn, to compare the two side by side (0: compare the single runs)")
    parser.add_argument("--remeasure", action="store_true",
                        help="measure plans already in --out again")
    parser.add_argument("--out", default="bench_results/search.json")
    args = parser.parse_args(argv)
    if args.plans is not None:
        args.plans = args.plans.split(",")
        unknown = sorted(set(args.plans) - {name for name, _, _ in PLANS})
        if unknown:
            parser.error(f"unknown plan(s) {unknown}")
    skip = set(filter(None, args.skip.split(",")))
    results = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    results["setting"] = {"nproc": args.nproc, "rate": args.rate, "global_batch": args.global_batch,
                          "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                          "llama_model": args.llama_model, "moe_model": args.moe_model}
    if "measure" not in skip:
        measure(args, results)
        save(args, results)
    later_steps(args, results, skip)
    save(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
