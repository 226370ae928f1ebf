"""`mxgraph search`: rank parallel layouts for a model on a cluster, or predict one plan.

    mxgraph search --model deepseek-v3-671b --gpus 1024 --device h800 --global-batch 4096 \\
        --seq-len 4096 --top-k 5 --json top.json --plans-dir plans/ --explain
    mxgraph search --model llama-20m --gpus 4 --device cpu.toml --global-batch 8 \\
        --seq-len 128 --evaluate plan.toml
    mxgraph search --calibrate cpu --nproc 4 --out cpu.toml
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from mxgraph.devices.catalog import load_device
from mxgraph.errors import UserError
from mxgraph.plan import Plan
from mxgraph.search.enumerate import SCHEDULES, Space, search
from mxgraph.search.predict import BREAKDOWN, Prediction, predict_plan
from mxgraph.search.setting import Setting
from mxgraph.train.model_spec import resolve_model

JSON_KEYS = ("plan", "step_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "bubble",
             "exposed_comm_s")


def add_search_parser(commands, parents, library) -> None:
    """Register `search` on the CLI's subparsers; `library`: the model library (`models`)."""
    p = commands.add_parser(
        "search", parents=parents, help="rank parallel layouts by predicted step time "
        "(or predict one plan with --evaluate, or calibrate a device profile)",
        description="Auto Search: enumerate tp/pp/vpp/dp/ep/cp/SP/ZeRO-1/micro-batch/"
        "schedule/recompute/offload layouts, prune by divisibility and memory, and rank "
        "them by the step time predicted from the compiled graphs' costs and a schedule "
        "simulation. Units: seconds, GiB (2^30 bytes), tokens.")
    p.add_argument("--model", help="preset name (e.g. llama2-70b, deepseek-v3-671b) or a "
                   "TOML model file: family = \"gpt\"|\"llama\"|\"moe\" plus that family's "
                   "config fields")
    p.add_argument("--gpus", type=int, help="number of devices (ranks) of the job")
    p.add_argument("--device", default="h800", help="built-in profile (a100-80gb, h100-sxm, h100-hbm2e-500w, "
                   "h800, metax-c500, cpu) or a TOML device file (see --calibrate); "
                   "default h800")
    p.add_argument("--attention-kernel", default="", help="the fused attention kernel the "
                   "job runs when not the device's default: one of the profile's "
                   "attention_kernels (fa2: FlashAttention-2 on Hopper parts, whose default "
                   "is cuDNN's); priced at that kernel's efficiency")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step, over "
                   "all data-parallel ranks")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--top-k", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--json", help="write the plans (best first) as a JSON list of {plan, "
                   "step_s, tokens_per_s_per_gpu, mfu, peak_memory_gib, bubble, "
                   "exposed_comm_s, breakdown_s} to this path")
    p.add_argument("--plans-dir", help="write each top plan as DIR/planN.toml, runnable by "
                   "mxgraph train --plan (its --batch-size is written in a comment)")
    p.add_argument("--explain", action="store_true", help="show the top plan's step time by "
                   "component (GEMMs, attention, memory-bound kernels, exposed layer "
                   "communication, pipeline wait, gradient sync, optimizer) and what is not "
                   "modelled; with a search, also how many candidates each pruning rule "
                   "removed and the best pruned ones with the reason")
    p.add_argument("--evaluate", metavar="PLAN_TOML", help="predict this plan only (same "
                   "columns; --json writes a one-element list)")
    p.add_argument("--max-tp", type=int, default=8, help="largest tp to enumerate "
                   "(default 8: one node)")
    p.add_argument("--max-cp", type=int, default=None, help="largest cp to enumerate "
                   "(default: 1 below 8192 tokens per sequence, else 8)")
    p.add_argument("--max-mbs", type=int, default=8, help="largest micro-batch size in "
                   "sequences (default 8)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="pipeline schedules "
                   f"to enumerate, comma-separated (default {','.join(SCHEDULES)})")
    p.add_argument("--recompute-levels", default=None, help="recompute policies to "
                   "enumerate, separated by ';' ('none' = save everything), e.g. "
                   "'none;norm,act;full' (default: none, norm,act / moe_light, full)")
    p.add_argument("--offload-levels", default="none;all", help="activation offload "
                   "policies to enumerate, separated by ';' (default 'none;all')")
    p.add_argument("--calibrate", metavar="DEVICE", help="measure this machine's GEMM, "
                   "attention, elementwise, AdamW/clipping (seconds per element) and "
                   "collective times and write a device TOML "
                   "(--out); DEVICE is the profile name to write (e.g. cpu)")
    p.add_argument("--nproc", type=int, default=1, help="--calibrate: ranks to measure "
                   "collectives on (started through torchrun; 1 = no collectives)")
    p.add_argument("--quick", action="store_true", help="--calibrate: few sizes and "
                   "repetitions (seconds, less accurate)")
    p.add_argument("--out", default=None, help="--calibrate: the device TOML to write "
                   "(default DEVICE.toml)")
    p.set_defaults(run=functools.partial(run_search, library=library))


def run_search(args, library) -> int:
    """The `search` command; returns the exit status (user errors raise UserError)."""
    if args.calibrate:
        from mxgraph.search.calibrate import calibrate_command
        return calibrate_command(args)
    for flag in ("model", "gpus", "global_batch", "seq_len"):
        if getattr(args, flag) is None:
            raise UserError(f"--{flag.replace('_', '-')} is required (see mxgraph search --help)")
    for flag in ("gpus", "global_batch", "seq_len", "top_k"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be a positive integer")
    config = resolve_model(args.model, command="search").config
    device = load_device(args.device)
    setting = Setting(config, device, args.gpus, args.global_batch, args.seq_len, library,
                      attention_kernel=args.attention_kernel)
    started = time.perf_counter()
    if args.evaluate:
        predictions = [predict_plan(setting, Plan.from_toml(args.evaluate), args.evaluate)]
        result = None
    else:
        space = Space(max_tp=args.max_tp, max_mbs=args.max_mbs,
                      max_cp=args.max_cp or (1 if args.seq_len < 8192 else 8),
                      schedules=tuple(s for s in args.schedules.split(",") if s),
                      recompute=_levels(args.recompute_levels),
                      offload=_levels(args.offload_levels))
        result = search(setting, args.top_k, space)
        predictions = result.best
    elapsed = time.perf_counter() - started
    print(format_table(predictions, setting))
    if result is not None:
        print(f"{result.candidates} candidates, {setting.cache.compiles} compiled layer "
              f"strategies ({setting.cache.compile_s:.1f} s of tracing), {elapsed:.1f} s on "
              f"{device.name} x {args.gpus}")
        if args.explain:
            print(explain(result))
    if args.explain and predictions:
        print(breakdown_text(predictions[0]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([p.to_json() for p in predictions], indent=1))
    if args.plans_dir:
        write_plans(predictions, setting, Path(args.plans_dir))
    return 0


def _levels(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple("" if part.strip() == "none" else part.strip() for part in text.split(";"))


def plan_label(plan: Plan) -> str:
    parts = [f"tp{plan.tp}", f"pp{plan.pp}"]
    if plan.vpp > 1:
        parts.append(f"vpp{plan.vpp}")
    parts.append(f"dp{plan.dp}")
    for name in ("ep", "cp"):
        if getattr(plan, name) > 1:
            parts.append(f"{name}{getattr(plan, name)}")
    if plan.sequence_parallel:
        parts.append("sp")
    if plan.zero1:
        parts.append("zero1")
    return " ".join(parts)


def format_table(predictions: list[Prediction], setting: Setting) -> str:
    header = (f"{'#':>2} {'layout':<28} {'sched':<11} {'mbs':>3} {'m':>4} {'recompute':<9} "
              f"{'offload':<7} {'step s':>9} {'tok/s/GPU':>10} {'MFU':>6} {'peak GiB':>9} "
              f"{'bubble':>6} {'exp.comm s':>10}")
    lines = [header]
    for i, p in enumerate(predictions):
        plan = p.plan
        lines.append(f"{i + 1:>2} {plan_label(plan):<28} {plan.schedule:<11} {p.mbs:>3} "
                     f"{plan.micro_batches:>4} {plan.recompute or '-':<9} "
                     f"{plan.offload or '-':<7} {p.step_s:>9.4g} "
                     f"{p.tokens_per_s_per_gpu:>10.1f} {p.mfu:>6.1%} "
                     f"{p.peak_memory_gib:>9.2f} {p.bubble:>6.1%} {p.exposed_comm_s:>10.4g}")
    return "\n".join(lines)


def explain(result) -> str:
    lines = ["pruned: " + ", ".join(f"{rule} {n}" for rule, n in result.pruned.items())]
    for rule, kept in result.examples.items():
        for pruned in kept:
            fields = pruned.plan.to_dict()
            short = {k: fields[k] for k in ("tp", "pp", "vpp", "dp", "ep", "cp",
                                            "sequence_parallel", "zero1", "micro_batches",
                                            "schedule", "recompute", "offload") if k in fields}
            lines.append(f"  {rule}: mbs={pruned.mbs} {short}: {pruned.reason}")
    return "\n".join(lines)


NOT_MODELLED = ("FP8 GEMMs (mxgraph trains in bf16 or fp32)", "multi-token-prediction layers",
                "a dispatcher that sends a token once per node (node-limited routing saves "
                "no inter-node bytes without it)", "FSDP / ZeRO-3 parameter gathers",
                "stragglers and clock throttling at the power limit")
"""What the search does not price (`--explain` names them)."""


def breakdown_text(prediction: Prediction) -> str:
    """The top plan's step seconds by component (`predict.BREAKDOWN`), with its share."""
    lines = [f"step {prediction.step_s:.4g} s of the top plan, by component (busiest "
             f"pipeline rank):"]
    for name, what in BREAKDOWN.items():
        seconds = prediction.breakdown_s.get(name, 0.0)
        share = seconds / prediction.step_s if prediction.step_s else 0.0
        lines.append(f"  {name:<14} {seconds:>10.4g} s {share:>6.1%}  {what}")
    lines.append("not modelled: " + "; ".join(NOT_MODELLED))
    return "\n".join(lines)


def write_plans(predictions: list[Prediction], setting: Setting, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(predictions):
        batch = setting.global_batch // (p.plan.dp or 1)
        text = (f"# mxgraph search: predicted {p.step_s:.4g} s per step on "
                f"{setting.device.name} x {setting.gpus}; run with mxgraph train --plan "
                f"this.toml --batch-size {batch} --seq-len {setting.seq_len}\n")
        (directory / f"plan{i + 1}.toml").write_text(text + p.plan.to_toml())
