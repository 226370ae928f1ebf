"""Communication-compute overlap on a shaped link: overlap off vs on, side by side.

For each link rate (the loopback of a private network namespace rate-limited with tc tbf:
../shared/tools/shaped-link, the same `unshare -n` + `tc qdisc ... tbf` commands the issue
gives), 2 gloo ranks run llama-20m under dp2, tp2+SP, pp2 1f1b and pp2 dualpipev, each with
`Plan(overlap=None)` and `Plan(overlap=True)` (tp2+SP also with `tp_chunks`), plus torch.distributed.pipelining's
Schedule1F1B on the same link as the peer for pp2. Per row: median step time, the
communication time and the exposed part of it from a torch.profiler trace of one step
(mxgraph/train/overlap_report.py: time the compute thread spends blocked on transfers), the
fraction hidden, and the step-time ratio off/on (> 1: overlap faster).

`--layouts` runs a subset (the peer runs with "pp2 1f1b"); `--rates none` the plain loopback;
`--codegens python,inductor` runs every row under each codegen (`Plan.codegen`).

    python benchmarks/bench_overlap.py [--rates 1gbit,4gbit] [--model llama-20m]
        [--layouts dp2,tp2+SP,"pp2 1f1b","pp2 dualpipev"] [--steps 5] [--batch-size 4]
        [--seq-len 128] [--micro-batches 4] [--tp-chunks 4] [--codegens python]
        [--out bench_results/overlap.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPED_LINK = ROOT.parent / "shared" / "tools" / "shaped-link"
LAYOUTS = {  # name -> Plan fields
    "dp2": dict(dp=2),
    "tp2+SP": dict(tp=2, sequence_parallel=True),
    "pp2 1f1b": dict(pp=2, schedule="1f1b"),
    "pp2 dualpipev": dict(pp=2, schedule="dualpipev"),
}


def _time(fn, steps: int) -> float:
    """The median seconds of `steps` calls after a warm-up (bench_pipeline_real's)."""
    from bench_pipeline_real import _time as median_time
    return median_time(fn, steps)


def _profiled(fn, path: Path) -> dict:
    """Profile one call of `fn` into a Chrome trace at `path`; its overlap summary."""
    import torch.profiler as profiler

    from mxgraph.train.overlap_report import overlap_summary
    with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
        fn()
    prof.export_chrome_trace(str(path))
    return overlap_summary(path)


def worker(args) -> None:
    """One rank under torchrun: every layout, overlap off and on, and the peer."""
    import torch
    import torch.distributed as dist

    import models
    import mxgraph as mx
    dist.init_process_group("gloo")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    targets = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    rows, traces = [], Path(args.traces)
    for codegen, layout in ((c, la) for c in args.codegens.split(",")
                            for la in args.layouts.split(",")):
        fields = LAYOUTS[layout]
        if "pp" in fields:
            fields = dict(fields, micro_batches=args.micro_batches)
        options = [None, True] + ([{"tp_chunks": args.tp_chunks}] if "tp" in fields else [])
        for overlap in options:
            torch.manual_seed(0)
            model = models.build_model(args.model)
            step = mx.compile(model, mx.Plan(**fields, overlap=overlap, codegen=codegen))
            opt = torch.optim.AdamW(step.parameters() if "pp" not in fields else
                                    model.parameters(), lr=1e-4)

            def train_step(step=step, opt=opt):
                step(tokens, targets)
                opt.step()
                opt.zero_grad(set_to_none=True)
            seconds = _time(train_step, args.steps)
            label = _label(overlap)
            name = f"{layout.replace(' ', '_').replace('+', '')}_{label.replace(' ', '')}"
            summary = _profiled(train_step, traces / f"{name}_{codegen}.rank{rank}.json")
            rows.append(_row(args.rate, layout, label, seconds, summary) | {"codegen": codegen})
            del step, opt, model
    if "pp2 1f1b" in args.layouts.split(","):
        rows.append(_peer_row(args, rank, tokens, targets, traces))
    if rank == 0:
        Path(args.json).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _label(overlap) -> str:
    if overlap is None:
        return "off"
    return "on" if overlap is True else f"on, {overlap['tp_chunks']} chunks"


def _row(rate, layout, overlap, seconds, summary) -> dict:
    total, exposed = summary["all"]["total_ms"], summary["all"]["exposed_ms"]
    return {"rate": rate, "layout": layout, "overlap": overlap, "step_s": seconds,
            "comm_ms": total, "exposed_ms": exposed,
            "hidden": 1 - exposed / total if total > 0 else 0.0,
            "by_kind": summary["kinds"]}


def _peer_row(args, rank, tokens, targets, traces) -> dict:
    """torch.distributed.pipelining's Schedule1F1B on the same link: the peer for pp2."""
    import torch
    import torch.distributed.pipelining as pipelining
    from bench_pipeline_real import StageModule, _loss

    import models
    torch.manual_seed(0)
    model = models.build_model(args.model)
    per = model.config.n_layers // 2
    stage = pipelining.PipelineStage(StageModule(model, rank * per, (rank + 1) * per,
                                                 rank == 0, rank == 1), rank, 2,
                                     torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=args.micro_batches,
                                       loss_fn=_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = _time(train_step, args.steps)
    summary = _profiled(train_step, traces / f"torch_1f1b.rank{rank}.json")
    return _row(args.rate, "pp2 1f1b", "torch Schedule1F1B", seconds, summary) | {
        "codegen": "torch"}


def run_rate(args, rate: str, traces: Path) -> list[dict]:
    """Launch the 2 ranks on a link of `rate` ("none": the unshaped loopback)."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--worker", "--rate", rate,
               "--json", str(out), "--traces", str(traces), "--model", args.model,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--micro-batches", str(args.micro_batches),
               "--tp-chunks", str(args.tp_chunks), "--layouts", args.layouts,
               "--codegens", args.codegens]
    if rate != "none":
        command = [str(SHAPED_LINK), rate, "--"] + command
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(command, check=True, env=env)
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,4gbit",
                        help="comma list of tc rates, or 'none' for the plain loopback")
    parser.add_argument("--model", default="llama-20m")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma list of layouts (default all: {', '.join(LAYOUTS)}); the "
                        "torch peer runs with pp2 1f1b")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4, help="for the pp2 rows")
    parser.add_argument("--tp-chunks", type=int, default=4,
                        help="overlap.tp_chunks of the extra tp2+SP row")
    parser.add_argument("--codegens", default="python",
                        help="comma-separated codegens (Plan.codegen): python, inductor")
    parser.add_argument("--out", type=Path, default=Path("bench_results/overlap.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--traces", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name for name in args.layouts.split(",") if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; layouts: {', '.join(LAYOUTS)}")
    if args.worker:
        worker(args)
        return []
    traces = args.out.parent / "overlap_traces"
    traces.mkdir(parents=True, exist_ok=True)
    rows = [row for rate in args.rates.split(",") for row in run_rate(args, rate, traces)]
    print_table(rows)
    args.out.write_text(json.dumps(rows, indent=2))
    return rows


def print_table(rows: list[dict]) -> None:
    """One line per row; off/on: the step time with overlap off over this row's (the same
    rate, layout and codegen; the peer against mxgraph's Python codegen)."""
    print(f"{'rate':<6} {'layout':<14} {'codegen':<9} {'overlap':<19} {'step s':>7} "
          f"{'comm ms':>8} {'exposed':>8} {'hidden':>7} {'off/on':>7}")
    off = {(r["rate"], r["layout"], r["codegen"]): r["step_s"] for r in rows
           if r["overlap"] == "off"}
    for r in rows:
        codegen = "python" if r["codegen"] == "torch" else r["codegen"]
        ratio = off.get((r["rate"], r["layout"], codegen), float("nan")) / r["step_s"]
        print(f"{r['rate']:<6} {r['layout']:<14} {r['codegen']:<9} {r['overlap']:<19} "
              f"{r['step_s']:>7.3f} {r['comm_ms']:>8.1f} {r['exposed_ms']:>8.1f} "
              f"{r['hidden']:>7.0%} {ratio:>7.2f}")


if __name__ == "__main__":
    main()
