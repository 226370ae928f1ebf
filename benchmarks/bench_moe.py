"""MoE optimisations side by side on a shaped link: expert parallelism alone vs hot experts,
capacity + batched GEMM, all-to-all overlap and all of them together, on balanced and on
skewed routing; plus the expert GEMMs alone in one process.

Setting: `--nproc` gloo ranks (default 4) in a private network namespace whose loopback
is rate-limited with tc tbf (../shared/tools/shaped-link, as benchmarks/bench_overlap.py;
if it cannot run, the plain loopback with a loud note in the output and the JSON), each
training `--model` (default moe-20m, `expert_impl="grouped_mm"`, no aux loss) with AdamW
on its own random `--batch-size` x `--seq-len` tokens under `Plan(ep=nproc, ...)` (dp =
ep = nproc), one OpenMP thread per rank. Rows (Plan fields besides ep; ROWS below):
    off            (nothing else)
    hot experts    moe.hot_experts=1 (replicate the most-loaded expert on every EP rank)
    capacity bmm   moe.capacity_factor=1.25, moe.batched_gemm=True
    overlap only   overlap=True (the baseline of the next row)
    a2a overlap    overlap=True, moe.a2a_overlap=True
    all together   capacity bmm + a2a overlap
A row whose plan is refused or whose step fails (e.g. a capability not built yet) is
recorded with its error and shown as "n/a (reason)"; the other rows still run.

Routings: "balanced" is the model as built; "skewed" adds the same bias b to the
selection scores of experts 0 and 1 (`router.expert_bias[:2] = b` in every MoE block;
the gate weights stay unbiased), with b found once by bisection on the eager model and
random tokens so that ~`--skew-share` (0.5) of the (token, choice) assignments go to
those two experts (both on rank 0). The share is printed, and re-measured on the ranks'
own batches ("share_experts_0_1" in the JSON). Each row compiles once and runs both
routings on that step (its graphs read the bias buffer at run time, as they must for any
routing); before each routing the parameters go back to where the compile left them and
a fresh AdamW starts, so both routings train the same weights.

Per row and routing (every rank measures; the table shows the rank mean unless it says
max):
- step s: the median wall time of `--steps` training steps (forward, backward, AdamW)
  after one warm-up step; the slowest rank's median. The compile (with its first step)
  is timed apart ("compile_s" in the JSON).
- vs off: step time of "off" / step time of the row, same routing (> 1: faster).
- a2a MiB in/rank: bytes this rank puts into all-to-alls per step; off-rank mean/max:
  of those, the bytes that leave the rank (its own block excluded), rank mean and max.
  Measured at run time from one profiled step (torch.profiler with record_shapes: the
  input tensor and input split sizes of every `c10d::alltoall_base_`, which the dropless
  and capacity exchanges, synchronous or not, and torch's functional all_to_all_single
  all reach), so data-dependent dropless sizes count as they were; the per-expert count
  exchanges are included. Every collective kind's input bytes are in the JSON.
- comm ms / exposed / hidden / a2a exp ms: from the same profiled step's Chrome trace
  through mxgraph/train/overlap_report.py: transfer time of all collectives, the part of it
  with the main thread computing nothing, 1 - exposed/comm, and the exposed part of the
  all-to-alls alone.
- peak MiB (max over ranks): the peak of tensor memory allocated during that profiled
  step and still live (torch.profiler profile_memory: the largest "Total Allocated" of
  the CPU allocator's [memory] events; the allocator counts only what is allocated while
  profiling, so this is the step's activations, gradients and communication buffers on
  top of the parameters and optimizer state that exist before it, which are "state_mib"
  in the JSON).
- dropped: `step.moe_stats()["dropped"]` after the profiled step, mean over the blocks;
  hot: the experts `step.moe_stats()["hot"]` replicated, over all blocks ("none": the
  option is on but the load was under its threshold; "-": the option is off).

The single-process section (benchmarks/bench_moe_kernels.py) times one MoE layer's
routed experts as grouped GEMM, capacity-padded bmm and a loop over experts.

The JSON also holds the issue's reference figures (REFERENCE) and what the run measured
for each (how: REFERENCE's third field); the table prints both. The default run (4 ranks,
moe-20m, 2 x 128 tokens per rank, 5 steps, one rate) took 6 min 50 s on this 2-core
machine with other jobs loading it (~55-70 s per row: compile, 2 x 7 steps, profiling).

    python benchmarks/bench_moe.py [--rates 1gbit] [--model moe-20m] [--nproc 4]
        [--steps 5] [--batch-size 2] [--seq-len 128] [--out bench_results/moe.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from bench_moe_kernels import expert_kernels
from bench_moe_report import compare, print_tables

ROOT = Path(__file__).resolve().parents[1]
SHAPED_LINK = ROOT.parent / "shared" / "tools" / "shaped-link"
CAPACITY = {"capacity_factor": 1.25, "batched_gemm": True}
OVERLAP = {"overlap": True}
ROWS = {  # name -> (Plan fields besides ep, MoEOptions fields)
    "off": ({}, {}),
    "hot experts": ({}, {"hot_experts": 1}),
    "capacity bmm": ({}, CAPACITY),
    "overlap only": (OVERLAP, {}),
    "a2a overlap": (OVERLAP, {"a2a_overlap": True}),
    "all together": (OVERLAP, {**CAPACITY, "a2a_overlap": True}),
}
ROUTINGS = ("balanced", "skewed")
BYTES_OF = {"float": 4, "double": 8, "long int": 8, "int": 4, "c10::Half": 2,
            "c10::BFloat16": 2, "short int": 2, "bool": 1, "unsigned char": 1,
            "signed char": 1}
"""Element size by the profiler's "Input type" name."""
COLLECTIVE_INPUT = {  # profiler op -> (kind, index of the tensor this rank sends)
    "c10d::alltoall_base_": ("all_to_all", 1), "c10d::allreduce_": ("all_reduce", 0),
    "c10d::_allgather_base_": ("all_gather", 1), "c10d::_reduce_scatter_base_":
    ("reduce_scatter", 1), "c10d::broadcast_": ("broadcast", 0),
}


# ---- the ranks ------------------------------------------------------------------------
def worker(args) -> None:
    """One rank under torchrun: every row x routing; rank 0 writes the gathered results."""
    import torch
    import torch.distributed as dist
    join_group(args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = _build(args.model, 0.0).config.vocab_size
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
    targets = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
    biases = {routing: args.bias if routing == "skewed" else 0.0
              for routing in args.routings.split(",")}
    shares = {routing: _share(_build(args.model, bias), tokens) for routing, bias in biases.items()}
    rows = []
    for name in args.rows.split(","):
        started = time.perf_counter()
        for routing, result in run_row(args, name, biases, tokens, targets).items():
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
            rows.append(_merge(args.rate, routing, name, biases[routing], shares[routing],
                               gathered))
            if rank == 0:
                print(f"[rank 0] {name} / {routing}: " + (
                    f"{rows[-1]['step_s']:.3f} s per step" if "error" not in rows[-1]
                    else rows[-1]["error"]), flush=True)
        if rank == 0:
            print(f"[rank 0] {name}: {time.perf_counter() - started:.0f} s in all", flush=True)
    rows.sort(key=lambda r: (list(biases).index(r["routing"]), list(ROWS).index(r["row"])))
    if rank == 0:
        Path(args.json).write_text(json.dumps(rows))
    dist.destroy_process_group()


def join_group(timeout: int) -> None:
    """This rank's gloo group (torchrun's environment), with mxgraph imported first.

    The order matters (issue #47): importing mxgraph imports torch._dynamo and with it
    torch.distributed.nn.functional, whose collectives take `group=group.WORLD` as a default
    argument, evaluated at import. Imported after the group exists (as run_row did), those
    defaults hold the group: `destroy_process_group` then ends nothing, and the group's gloo
    threads (two run loops, the TCP event loop) and connections live on until the interpreter's
    finalization frees the module (gdb: ~ProcessGroupGloo under Py_FinalizeEx ->
    finalize_modules): the C++ teardown runs after atexit, with the interpreter half gone and
    the peer exiting at the same moment. That is the exit path of #47's abort (not reproduced
    here, so suspected, not proven). Imported first, the defaults are None and the group ends
    in `destroy_process_group`, before the worker returns (bench_overlap's and
    bench_load_memory's workers import mxgraph before their groups already)."""
    import torch.distributed as dist

    import mxgraph  # noqa: F401 - before init_process_group, see above
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))


def _build(name: str, bias: float):
    """The model under seed 0 (the same on every rank and in the calibration), with
    `bias` added to the selection scores of experts 0 and 1 of every MoE block."""
    import torch

    import models
    torch.manual_seed(0)
    model = models.build_model(name, expert_impl="grouped_mm", aux_loss_coef=0.0)
    _set_bias(model, bias)
    return model


def _set_bias(model, bias: float) -> None:
    import torch
    with torch.no_grad():
        for block in model.moe_blocks():
            block.router.expert_bias.zero_()
            block.router.expert_bias[:2] = bias


def _share(model, tokens) -> float:
    """The fraction of the (token, choice) assignments that go to experts 0 and 1 over
    every rank's batch (eager model)."""
    import torch
    import torch.distributed as dist
    counts = model.expert_counts(tokens)
    share = torch.tensor([float(sum(c[:2].sum() for c in counts)),
                          float(sum(c.sum() for c in counts))])
    dist.all_reduce(share)
    return float(share[0] / share[1])


def run_row(args, name: str, biases: dict[str, float], tokens, targets) -> dict[str, dict]:
    """This rank's numbers for one row under each routing ({"error": ...} where its plan
    or a step fails). One compiled step serves every routing: its graphs read the router's
    bias buffer at run time, as they must for any routing; between routings the bias is
    set in place and the parameters and the optimizer start again from where the compile
    left them."""
    import torch
    import torch.distributed as dist
    from bench_overlap import _time

    import mxgraph as mx
    fields, moe = ROWS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        started = time.perf_counter()
        model = _build(args.model, 0.0)
        step = mx.compile(model, mx.Plan(ep=world, **fields, moe=mx.MoEOptions(**moe)))
        step(tokens, targets)  # compiles; ep cuts the expert weights to this rank's in place
        compile_s = time.perf_counter() - started
        initial = [p.detach().clone() for p in step.parameters()]
    except Exception as error:  # noqa: BLE001 - recorded per row, the others still run
        return dict.fromkeys(biases, _failure(error))
    results = {}
    for routing, bias in biases.items():
        try:
            with torch.no_grad():
                for p, value in zip(step.parameters(), initial, strict=True):
                    p.copy_(value)
                    p.grad = None
            _set_bias(model, bias)
            opt = torch.optim.AdamW(step.parameters(), lr=1e-4)

            def train_step(opt=opt):
                step(tokens, targets)
                opt.step()
                opt.zero_grad(set_to_none=True)
            seconds = _time(train_step, args.steps)
            trace = Path(args.traces) / (f"{args.rate}_{routing}_{name.replace(' ', '_')}"
                                         f".rank{rank}.json.gz")
            result = dict(_profiled(train_step, trace, rank, world), step_s=seconds,
                          compile_s=compile_s, state_mib=_state_bytes(step, opt) / 2**20)
            stats = step.moe_stats()
            dropped = stats["dropped"]
            result["dropped"] = statistics.mean(dropped.values()) if dropped else None
            result["hot"] = stats["hot"] or None
        except Exception as error:  # noqa: BLE001 - as above
            result = _failure(error)
        results[routing] = result
    return results


def _failure(error: Exception) -> dict:
    """{"error": "Type: first line of the message (at file:line)"}."""
    message = str(error).strip().splitlines()
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return {"error": f"{type(error).__name__}: {message[0] if message else ''} "
                     f"(at {Path(frame.filename).name}:{frame.lineno})"}


def _profiled(fn, path: Path, rank: int, world: int) -> dict:
    """One profiled call of `fn` on rank `rank` of `world` (the EP group): overlap summary,
    bytes put into each collective kind, the all-to-all bytes that leave the rank, and the
    peak of tensor memory allocated during the call (see the module docstring)."""
    from torch import profiler

    from mxgraph.train.overlap_report import overlap_summary
    with profiler.profile(activities=[profiler.ProfilerActivity.CPU], record_shapes=True,
                          profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(path))
    summary = overlap_summary(path)
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    sent: dict[str, int] = {}
    off_rank = 0
    for event in events:
        if event.get("ph") == "X" and event.get("name") in COLLECTIVE_INPUT:
            kind, index = COLLECTIVE_INPUT[event["name"]]
            sent[kind] = sent.get(kind, 0) + _input_bytes(event.get("args", {}), index)
            if kind == "all_to_all":
                off_rank += _off_rank_bytes(event["args"], rank, world)
    peak = max((e["args"].get("Total Allocated", 0) for e in events
                if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0),
               default=0)
    a2a = summary["kinds"].get("all_to_all", {})
    return {"sent_bytes": sent, "a2a_bytes": sent.get("all_to_all", 0),
            "a2a_off_rank_bytes": off_rank,
            "comm_ms": summary["all"]["total_ms"], "exposed_ms": summary["all"]["exposed_ms"],
            "a2a_ms": a2a.get("total_ms", 0.0), "a2a_exposed_ms": a2a.get("exposed_ms", 0.0),
            "compute_ms": summary["compute_ms"], "peak_mib": peak / 2**20}


def _input_bytes(event_args: dict, index: int) -> int:
    """Bytes of input `index` of a profiled op (a tensor, or a list of tensors)."""
    dims = event_args.get("Input Dims", [])
    types = event_args.get("Input type", [])
    if index >= len(dims) or not dims[index]:
        return 0
    shapes = dims[index] if isinstance(dims[index][0], list) else [dims[index]]
    size = BYTES_OF.get(types[index] if index < len(types) else "", 4)
    return sum(math.prod(shape) * size for shape in shapes)


def _off_rank_bytes(event_args: dict, rank: int, world: int) -> int:
    """Bytes of an `alltoall_base_`'s input that go to the other ranks: all but this
    rank's own block (its input_split_sizes entry, from the profiler's Concrete Inputs;
    "[]" means equal blocks)."""
    total = _input_bytes(event_args, 1)
    rows = event_args["Input Dims"][1][0] if event_args["Input Dims"][1] else 0
    concrete = event_args.get("Concrete Inputs", [])
    splits = json.loads(concrete[4]) if len(concrete) > 4 and concrete[4] else []
    own = splits[rank] if splits else rows // world
    return total - total * own // rows if rows else 0


def _state_bytes(step, opt) -> int:
    """Bytes of this rank's parameters and optimizer state."""
    import torch
    tensors = list(step.parameters()) + [v for state in opt.state.values()
                                        for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _merge(rate, routing, name, bias, share, per_rank: list[dict]) -> dict:
    """One row from every rank's numbers: means, the max for time and memory."""
    row = {"rate": rate, "routing": routing, "row": name, "bias": bias,
           "share_experts_0_1": share}
    errors = sorted({r["error"] for r in per_rank if "error" in r})
    if errors:
        return dict(row, error="; ".join(errors))
    mean = {key: statistics.mean(r[key] for r in per_rank)
            for key in ("a2a_bytes", "a2a_off_rank_bytes", "comm_ms", "exposed_ms", "a2a_ms",
                        "a2a_exposed_ms", "compute_ms")}
    dropped = [r["dropped"] for r in per_rank if r["dropped"] is not None]
    return dict(row, **mean, step_s=max(r["step_s"] for r in per_rank),
                hidden=1 - mean["exposed_ms"] / mean["comm_ms"] if mean["comm_ms"] else 0.0,
                a2a_off_rank_max_bytes=max(r["a2a_off_rank_bytes"] for r in per_rank),
                peak_mib=max(r["peak_mib"] for r in per_rank),
                state_mib=max(r["state_mib"] for r in per_rank),
                compile_s=max(r["compile_s"] for r in per_rank),
                dropped=statistics.mean(dropped) if dropped else None,
                hot=per_rank[0]["hot"], per_rank=per_rank)


# ---- the parent -----------------------------------------------------------------------
def calibrate(args) -> dict:
    """The bias b on experts 0 and 1 that sends ~args.skew_share of the assignments there
    (bisection on the eager model, random tokens of one step of all ranks)."""
    import torch
    model = _build(args.model, 0.0)
    g = torch.Generator().manual_seed(12345)
    tokens = torch.randint(0, model.config.vocab_size,
                           (args.nproc * args.batch_size, args.seq_len), generator=g)

    def share(bias: float) -> tuple[float, list[float]]:
        _set_bias(model, bias)
        counts = model.expert_counts(tokens)
        per_block = [float(c[:2].sum() / c.sum()) for c in counts]
        return sum(float(c[:2].sum()) for c in counts) / sum(float(c.sum()) for c in counts), \
            per_block
    low, high = 0.0, 0.25
    while share(high)[0] < args.skew_share and high < 64:
        low, high = high, 2 * high
    for _ in range(args.calibration_steps):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle)[0] < args.skew_share else (low, middle)
    bias = (low + high) / 2
    measured, per_block = share(bias)
    return {"bias": bias, "share": measured, "share_per_block": per_block,
            "balanced_share": share(0.0)[0]}


def link_check(rate: str) -> str | None:
    """None if the shaped link runs here, else why not."""
    try:
        done = subprocess.run([str(SHAPED_LINK), rate, "true"], check=False,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return None if done.returncode == 0 else (done.stderr.strip() or f"rc {done.returncode}")


def run_rate(args, rate: str, shaped: bool, bias: float, traces: Path) -> list[dict]:
    """Launch the ranks on a link of `rate` (the plain loopback unless `shaped`)."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), __file__, "--worker", "--rate", rate,
               "--json", str(out), "--traces", str(traces), "--bias", repr(bias),
               "--model", args.model, "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--rows", args.rows, "--routings", args.routings, "--timeout", str(args.timeout)]
    if shaped:
        command = [str(SHAPED_LINK), rate, "--"] + command
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
               OMP_NUM_THREADS="1")
    subprocess.run(command, check=True, env=env)
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Units: seconds, MiB (2**20 bytes), ms.")
    parser.add_argument("--rates", default="1gbit",
                        help="comma list of tc rates of the shaped link (e.g. 1gbit,4gbit), "
                             "or 'none' for the plain loopback (default 1gbit)")
    parser.add_argument("--model", default="moe-20m", help="MoE model preset (models/presets.py; default moe-20m)")
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks; ep = this (default 4)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed training steps per row, after 1 warm-up (default 5)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma list of rows to run (default all: {', '.join(ROWS)})")
    parser.add_argument("--routings", default=",".join(ROUTINGS),
                        help="comma list of routings: balanced, skewed (default both)")
    parser.add_argument("--skew-share", type=float, default=0.5,
                        help="skewed routing: target fraction of the (token, choice) "
                             "assignments that go to experts 0 and 1 (default 0.5)")
    parser.add_argument("--calibration-steps", type=int, default=12,
                        help="bisection steps for the skew bias (default 12)")
    parser.add_argument("--kernel-tokens", type=int, default=None,
                        help="single-process section: tokens through the layer (rows = this x "
                             "topk); default nproc x batch-size x seq-len; 0 skips the section")
    parser.add_argument("--kernel-reps", type=int, default=20,
                        help="single-process section: timed runs per variant (default 20)")
    parser.add_argument("--kernel-threads", type=int, default=1,
                        help="single-process section: torch threads (default 1, as each rank "
                             "has; 2 OpenMP threads on a loaded 2-core machine run ~50x slower)")
    parser.add_argument("--timeout", type=int, default=600,
                        help="seconds a rank waits in a collective before failing (default 600)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/moe.json"),
                        help="JSON results (default bench_results/moe.json); the profiler "
                             "traces go to moe_traces/ beside it")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--rate", "--json", "--traces"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--bias", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    for name in args.rows.split(","):
        if name not in ROWS:
            parser.error(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
    started = time.perf_counter()
    calibration = calibrate(args) if "skewed" in args.routings.split(",") else {"bias": 0.0}
    if "share" in calibration:
        print(f"skewed routing: bias {calibration['bias']:.4f} on experts 0, 1 sends "
              f"{calibration['share']:.1%} of the assignments there (balanced: "
              f"{calibration['balanced_share']:.1%}; per block "
              + ", ".join(f"{s:.0%}" for s in calibration["share_per_block"]) + ")", flush=True)
    traces = args.out.parent / "moe_traces"
    traces.mkdir(parents=True, exist_ok=True)
    rows, links = [], {}
    for rate in args.rates.split(","):
        problem = None if rate == "none" else link_check(rate)
        links[rate] = "unshaped loopback" if rate == "none" else (
            f"shaped {rate}" if problem is None else
            f"UNSHAPED loopback: shaped-link {rate} failed here ({problem})")
        if problem is not None:
            print(f"\n!!! WARNING: the shaped link cannot run ({problem}); rate {rate} runs on "
                  f"the plain, unshaped loopback !!!\n", flush=True)
        rows += run_rate(args, rate, problem is None and rate != "none", calibration["bias"],
                         traces)
    if args.kernel_tokens is None:
        args.kernel_tokens = args.nproc * args.batch_size * args.seq_len
    kernels = {}
    if args.kernel_tokens > 0:
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(args.kernel_threads)
        kernels = expert_kernels(args)
        torch.set_num_threads(threads)
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                           if k not in ("worker", "rate", "json", "traces", "bias")},
              "links": links, "calibration": calibration, "rows": rows, "expert_kernels": kernels,
              "reference": compare(rows, kernels),
              "bytes_method": "run time: input tensors of c10d::alltoall_base_ ops in one "
                              "profiled step (record_shapes)",
              "peak_memory_method": "torch.profiler profile_memory: max 'Total Allocated' of "
                                    "the CPU allocator during one profiled step (allocations "
                                    "made during the step only)"}
    result["elapsed_s"] = time.perf_counter() - started
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out} ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
