"""Eager vs torch.compile (inductor, and the mxmaca backend) vs mxgraph.compile (Python or
Inductor codegen, fusion off or on), side by side, on the CPU or a GPU (`--device cuda`).

Models: presets (`llama-tiny`, `llama-20m`, ...) and `hf-llama-20m`, a Hugging Face
`LlamaForCausalLM` of llama-20m's shape with the library's defaults (random init).

For each model: compile time (first step minus a warm step), median step time
(forward + backward, fill .grad), tokens/s, MFU (the model's FLOPs per token as mxgraph
counts them, `mxgraph.train.flops`, x tokens/s / the device's peak: on the CPU the measured fp32
GEMM rate, `mxgraph.train.metrics.cpu_peak_flops`), and peak memory of the timed steps: on the CPU
the resident memory above the resident memory before them (Linux VmHWM after resetting
it), on a GPU `torch.cuda.max_memory_allocated` above the allocation before them. Each
(model, runner) pair runs in its own subprocess so memory and caches do not leak between
them. With `--rounds R` every pair runs R times, the runners interleaved round by round
(a slow spell of a shared machine then hits every runner), and the fastest round counts.
With `--side-by-side P` every model then runs all its runners in one process, each on its
own copy of the model, P passes of one step each with the order rotated, and each runner's
speed is the median over passes of inductor's (or eager's) step / its own in the same pass:
a paired ratio, steady where a shared machine's steps wander by 10% from one second to the
next and from one process to another.

    python benchmarks/bench_compile.py [--models llama-tiny,llama-20m] [--steps 10] [--rounds 1]
        [--runners eager,inductor,mxmaca,mxmaca-inductor,mxgraph,mxgraph-inductor]
        [--batch-size 8] [--seq-len 256] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--side-by-side 0] [--out bench_results/compile.json]
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
    "mxgraph": 'mxgraph.compile(model) (the default plan: codegen="auto", Inductor wherever '
               'it generates code, the CPU with a C++ compiler included)',
    "mxgraph-fusion": "mxgraph.compile(model, Plan(fusion=True))",
    "mxgraph-python": 'mxgraph.compile(model, Plan(codegen="python"))',
    "mxgraph-python-fusion": 'mxgraph.compile(model, Plan(codegen="python", fusion=True))',
    "mxgraph-inductor": 'mxgraph.compile(model, Plan(codegen="inductor"))',
    "mxgraph-inductor-fusion": 'mxgraph.compile(model, Plan(codegen="inductor", fusion=True))',
    "mxgraph-inductor-no-auto-remat": 'mxgraph.compile(model, Plan(codegen="inductor", '
                                      'disable_passes=["auto_remat"])): saves what eager saves',
}
PLANS = {"mxgraph": {}, "mxgraph-fusion": {"fusion": True},
         "mxgraph-python": {"codegen": "python"},
         "mxgraph-python-fusion": {"codegen": "python", "fusion": True},
         "mxgraph-inductor": {"codegen": "inductor"},
         "mxgraph-inductor-fusion": {"codegen": "inductor", "fusion": True},
         "mxgraph-inductor-no-auto-remat": {"codegen": "inductor", "disable_passes": ["auto_remat"]}}
DEFAULT_RUNNERS = ("eager", "inductor", "mxmaca", "mxmaca-inductor", "mxgraph",
                   "mxgraph-inductor")
ROOT = Path(__file__).resolve().parents[1]
HF_MODELS = {"hf-llama-20m": ("hf:llama", {
    "vocab_size": 256, "hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6,
    "num_key_value_heads": 2, "intermediate_size": 1024, "max_position_embeddings": 1024,
    "bos_token_id": 0, "eos_token_id": 0})}
"""Hugging Face models by name: (spec, config overrides), sizes only."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def build(model_name: str, runner: str, batch_size: int, seq_len: int, device: str = "cpu",
          dtype: str = "float32", layers: int | None = None):
    """(step, sync, model, tokens, flops a token) for one runner, built in this process: its
    own copy of the model (seed 0, so every runner's weights are the same) and one batch.
    ``layers`` replaces the model's number of transformer layers (the same layer shapes,
    fewer of them: compile time grows with the layers, the runners' ratios hardly)."""
    import torch

    import models
    import mxgraph
    from mxgraph.train.flops import model_flops_per_token

    torch.manual_seed(0)
    if model_name in HF_MODELS:
        from mxgraph.hf.models import build_hf_model
        spec, config = HF_MODELS[model_name]
        config = config if layers is None else {**config, "num_hidden_layers": layers}
        model = build_hf_model(spec, config, dtype=getattr(torch, dtype)).to(device)
    else:
        overrides = {} if layers is None else {"n_layers": layers}
        model = models.build_model(model_name, device=device, dtype=getattr(torch, dtype),
                                   **overrides)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    y = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    flops_per_token, _ = model_flops_per_token(model, x[0].cpu(), seq_len)
    gpu = device != "cpu"

    def sync():
        if gpu:
            torch.cuda.synchronize()
    if runner == "eager":
        def step():
            model(x, y).backward()
    elif runner in ("inductor", "mxmaca", "mxmaca-inductor"):
        from torch._dynamo import list_backends

        from mxgraph.backend import mxmaca_backend
        # by name where mxgraph is installed (its entry point), else the function itself
        mxmaca = "mxmaca" if "mxmaca" in list_backends(exclude_tags=()) else mxmaca_backend
        options = {"mxmaca": {"backend": mxmaca}, "inductor": {},
                   "mxmaca-inductor": {"backend": mxmaca, "options": {
                       "plan": mxgraph.Plan(codegen="inductor")}}}[runner]
        compiled = torch.compile(model, **options)

        def step():
            compiled(x, y).backward()
    else:
        compiled = mxgraph.compile(model, mxgraph.Plan(**PLANS[runner]))

        def step():
            compiled(x, y)
    return step, sync, model, x, flops_per_token


def measure(model_name: str, runner: str, steps: int, batch_size: int, seq_len: int,
            device: str = "cpu", dtype: str = "float32", layers: int | None = None,
            profile: int = 0) -> dict:
    """Run in this process: build, compile, time; returns one result row (`build` for
    ``layers``). ``profile``: after the timed steps, profile 2 more and keep the ``profile``
    ops (kernels on a GPU) that took the most time, per step (`top_ops`), and how many ran
    (`ops_per_step`)."""
    import torch
    step, sync, model, _, flops_per_token = build(model_name, runner, batch_size, seq_len,
                                                  device, dtype, layers)
    gpu = device != "cpu"
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
    from mxgraph.runtime.cluster.device import detect
    from mxgraph.train.metrics import device_peak
    peak_flops = device_peak(None, detect(torch.device(device)))[1]
    row = {"model": model_name, "runner": runner, "device": device, "dtype": dtype,
            "params": sum(p.numel() for p in model.parameters()),
            "compile_s": max(0.0, first - warm), "step_ms": step_s * 1e3,
            "tokens_per_s": batch_size * seq_len / step_s,
            "mfu": flops_per_token * batch_size * seq_len / step_s / peak_flops,
            "peak_mib": max(0, peak - base) / 2**20}
    if profile:
        row.update(profile_ops(step, sync, gpu, profile))
    return row


def side_by_side(model_name: str, runners: list[str], passes: int, batch_size: int,
                 seq_len: int, device: str = "cpu", dtype: str = "float32",
                 layers: int | None = None) -> dict:
    """Every runner in this one process, each on its own copy of the model (`build`): each
    compiled and warmed (two steps), then `passes` passes that run one step of every
    runner, the order rotated each pass, so a slow spell of a shared machine hits every
    runner alike. Returns runner -> its step times (ms), pass by pass."""
    built = {r: build(model_name, r, batch_size, seq_len, device, dtype, layers) for r in runners}
    for step, sync, model, *_ in built.values():
        for _ in range(2):
            step()
            sync()
            model.zero_grad(set_to_none=True)
    times = {r: [0.0] * passes for r in runners}
    for i in range(passes):
        for r in runners[i % len(runners):] + runners[:i % len(runners)]:
            step, sync, model, *_ = built[r]
            start = time.perf_counter()
            step()
            sync()
            times[r][i] = (time.perf_counter() - start) * 1e3
            model.zero_grad(set_to_none=True)
    return times


def paired(times: dict, runner: str, base: str) -> float | None:
    """The median over passes of base's step time / runner's in the same pass (> 1: the
    runner is faster); None without both."""
    if runner not in times or base not in times:
        return None
    return statistics.median(b / t for b, t in zip(times[base], times[runner], strict=True))


def profile_ops(step, sync, gpu: bool, top: int, steps: int = 2) -> dict:
    """The `top` ops by time per step over `steps` profiled steps: on a GPU the device
    kernels (name, ms, calls per step), on the CPU the ATen ops by self CPU time; and the
    number of them per step (kernel launches on a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    if gpu:  # device kernels: events that ran on the GPU
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        totals: dict[str, list] = {}
        for e in events:
            entry = totals.setdefault(e.name, [0.0, 0])
            entry[0] += e.device_time_total / 1e3
            entry[1] += 1
        count = len(events)
    else:
        averages = [a for a in prof.key_averages() if a.key.startswith("aten::")]
        totals = {a.key: [a.self_cpu_time_total / 1e3, a.count] for a in averages}
        count = sum(a.count for a in averages)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return {"ops_per_step": count / steps,
            "top_ops": [[name[:80], ms / steps, calls / steps] for name, (ms, calls) in ranked]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-tiny,llama-20m")
    parser.add_argument("--runners", default=",".join(DEFAULT_RUNNERS),
                        help="comma-separated, of " + "; ".join(f"{k}: {v}" for k, v in RUNNERS.items()))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every (model, runner), interleaved; the fastest counts "
                             "(0: none, with --side-by-side alone)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU, MXMACA's too)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's parameter dtype")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer layers of every model (default: the model's own)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds one (model, runner) run may take; past it the row fails")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="after the timed steps, profile 2 more and print each runner's "
                             "K most expensive ops (GPU kernels) and its ops (launches) a step")
    parser.add_argument("--side-by-side", type=int, default=0, metavar="P",
                        help="then, per model, every runner in one process: P passes of one "
                             "step each, the order rotated, and per runner the median over "
                             "passes of inductor's step time / its own in the same pass "
                             "(`side_by_side`); 0: off")
    parser.add_argument("--out", default="bench_results/compile.json")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "RUNNER"), help=argparse.SUPPRESS)
    parser.add_argument("--all-in-one", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.all_in_one:
        times = side_by_side(args.all_in_one, args.runners.split(","), args.side_by_side,
                             args.batch_size, args.seq_len, args.device, args.dtype, args.layers)
        print("SIDE " + json.dumps(times))
        return 0
    if args.one:
        row = measure(*args.one, args.steps, args.batch_size, args.seq_len, args.device,
                      args.dtype, args.layers, args.profile)
        print("ROW " + json.dumps(row))
        return 0
    unknown = [r for r in args.runners.split(",") if r not in RUNNERS]
    if unknown:
        parser.error(f"unknown runner {unknown[0]!r}; choose from {', '.join(RUNNERS)}")
    pairs = [(m, r) for m in args.models.split(",") for r in args.runners.split(",")]
    best = {pair: {"model": pair[0], "runner": pair[1], "error": True} for pair in pairs}
    rounds = {pair: [] for pair in pairs}  # step ms of every round that ran
    for round_ in range(args.rounds):
        for model_name, runner in pairs:
            command = _child(args, "--one", model_name, runner, "--steps", str(args.steps))
            command += ["--profile", str(args.profile)] if args.profile else []
            print(f"round {round_ + 1}/{args.rounds}: {model_name} / {runner} ...",
                  file=sys.stderr, flush=True)
            env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's mxgraph and models
            try:
                result = subprocess.run(command, capture_output=True, text=True, env=env,
                                        timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"  timed out after {args.timeout:.0f} s", file=sys.stderr)
                continue
            lines = [l for l in result.stdout.splitlines() if l.startswith("ROW ")]
            if result.returncode or not lines:
                print(result.stderr[-2000:], file=sys.stderr)
                continue
            row = json.loads(lines[0][4:])
            print(f"  {row['step_ms']:.1f} ms a step, compile {row['compile_s']:.1f} s",
                  file=sys.stderr, flush=True)
            rounds[(model_name, runner)].append(row["step_ms"])
            kept = best[(model_name, runner)]
            if "error" in kept or row["step_ms"] < kept["step_ms"]:
                best[(model_name, runner)] = row
            write_rows(args, pairs, best, rounds)  # so far: a run cut short keeps its rows
    side = {}
    for model_name in dict.fromkeys(m for m, _ in pairs) if args.side_by_side else ():
        print(f"side by side: {model_name}, {args.side_by_side} passes ...", file=sys.stderr,
              flush=True)
        command = _child(args, "--all-in-one", model_name, "--runners", args.runners,
                         "--side-by-side", str(args.side_by_side))
        result = subprocess.run(command, capture_output=True, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        lines = [l for l in result.stdout.splitlines() if l.startswith("SIDE ")]
        if result.returncode or not lines:
            print(result.stderr[-2000:], file=sys.stderr)
            continue
        side[model_name] = json.loads(lines[0][5:])
    rows = write_rows(args, pairs, best, rounds, side)
    if args.rounds:
        print_table(rows)
    print_side_by_side(side, args.side_by_side)
    return 0


def _child(args, *words: str) -> list[str]:
    """The command line of a subprocess of this benchmark: `words`, then the batch, device,
    dtype and layers of `args`."""
    command = [sys.executable, __file__, *words, "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--device", args.device, "--dtype", args.dtype]
    return command + ([] if args.layers is None else ["--layers", str(args.layers)])


def print_side_by_side(side: dict, passes: int) -> None:
    """Per model and runner: the median step of the one-process passes, and the paired
    ratios (`paired`) over eager and over inductor."""
    if not side:
        return
    print(f"\nside by side, every runner in one process, {passes} passes (median step ms; "
          f"ratios: median over passes of the base's step / the runner's, > 1 faster)")
    print(f"{'model':<12} {'runner':<23} {'step ms':>9} {'vs eager':>9} {'vs inductor':>11}")
    for model_name, times in side.items():
        for runner, ms in times.items():
            ratios = [f"{r:.3f}x" if (r := paired(times, runner, base)) else "-"
                      for base in ("eager", "inductor")]
            print(f"{model_name:<12} {runner:<23} {statistics.median(ms):>9.1f} "
                  f"{ratios[0]:>9} {ratios[1]:>11}")


def write_rows(args, pairs, best, rounds, side=None) -> list[dict]:
    """Write the JSON of every (model, runner) pair as it stands; returns its rows. `side`:
    model -> runner -> step ms of the one-process passes, kept per row as `side_by_side_ms`
    with the paired ratios `side_by_side_vs_eager` and `side_by_side_vs_inductor`."""
    rows = [best[pair] if "error" in best[pair] else {**best[pair], "rounds": rounds[pair]}
            for pair in pairs]
    for row in rows:
        times = (side or {}).get(row["model"], {})
        if row["runner"] in times:
            row["side_by_side_ms"] = times[row["runner"]]
            for base in ("eager", "inductor"):
                row[f"side_by_side_vs_{base}"] = paired(times, row["runner"], base)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"batch_size": args.batch_size, "seq_len":
                                          args.seq_len, "device": args.device,
                                          "dtype": args.dtype, "rounds": args.rounds,
                                          "layers": args.layers, "side_by_side": args.side_by_side,
                                          "rows": rows}, indent=2))
    return rows


def print_table(rows) -> None:
    """One row per (model, runner); speed-ups over eager and over torch.compile (inductor)."""
    ok = [r for r in rows if "error" not in r]
    eager = {r["model"]: r for r in ok if r["runner"] == "eager"}
    inductor = {r["model"]: r for r in ok if r["runner"] == "inductor"}
    print(f"{'model':<12} {'runner':<23} {'params':>9} {'compile s':>9} {'step ms':>9} "
          f"{'tokens/s':>9} {'MFU':>6} {'vs eager':>9} {'vs inductor':>11} {'peak MiB':>9}  "
          f"rounds (step ms)")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<12} {r['runner']:<23} failed")
            continue
        ratios = [f"{base[r['model']]['step_ms'] / r['step_ms']:.2f}x" if r["model"] in base
                  else "-" for base in (eager, inductor)]
        print(f"{r['model']:<12} {r['runner']:<23} {r['params'] / 1e6:>8.2f}M "
              f"{r['compile_s']:>9.2f} {r['step_ms']:>9.1f} {r['tokens_per_s']:>9.0f} "
              f"{r['mfu']:>6.1%} {ratios[0]:>9} {ratios[1]:>11} {r['peak_mib']:>9.1f}  "
              f"{' '.join(f'{ms:.1f}' for ms in r.get('rounds', ()))}")
    for r in ok:
        if "top_ops" in r:
            print(f"\n{r['model']} / {r['runner']}: {r['ops_per_step']:.0f} ops a step; "
                  f"the most expensive (ms a step, calls a step):")
            for name, ms, calls in r["top_ops"]:
                print(f"  {ms:9.2f} {calls:6.0f}  {name}")


if __name__ == "__main__":
    sys.exit(main())
