"""One rank of a plan bench_search.py measures: `mxgraph train` with optimizer hooks that time
every step and profile the last one (run under torchrun by `bench_search.measure_one`).

    python -m torch.distributed.run ... benchmarks/search_worker.py --out PATH --steps 8 \\
        --warmup 2 -- <mxgraph train arguments>

Writes `PATH.rank<r>`: the step intervals, the median step time past the warm-up, the
monitor's level-0 sections of its last full interval, and the peak bytes (on the CPU: live
tensors at the profiled step's start plus the allocator's peak during it; on a GPU:
`torch.cuda.max_memory_allocated` over the whole run).
"""
from __future__ import annotations

import argparse
import gc
import gzip
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SECTION_STEPS = 3
"""The slow-node monitor's interval: its last full one (steps 4-6 of 8) gives each rank's
mean seconds per step in data, forward_backward, grad_sync, pipeline_wait, param_gather and
optimizer (kept in the JSON as `sections_s`, to see where a misprediction comes from)."""

def live_tensor_bytes() -> int:
    """Bytes of every live CPU tensor's storage (each storage once), gradients and the
    training corpus (`mxgraph.data.batches.Batches.tokens`: host data on any device, the same for
    every plan) excluded."""
    import torch

    from mxgraph.data.batches import Batches
    objects = gc.get_objects()
    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    left_out = {_storage_key(o.tokens) for o in objects if isinstance(o, Batches)}
    for t in tensors:
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            left_out.add(_storage_key(t.grad))
    seen, total = set(), 0
    for t in tensors:
        key = _storage_key(t)
        if key is None or key in seen or key in left_out:
            continue
        seen.add(key)
        total += key[1]
    return total


def _storage_key(t):
    try:
        if t.device.type != "cpu" or type(t).__name__ == "FakeTensor":
            return None
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes())
    except Exception:  # noqa: BLE001 - fake, functional or storage-less tensors
        return None


def trace_peak(path: Path) -> int:
    """Peak of the CPU allocator's running total in a profiler trace, relative to its start."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    totals = [(e["ts"], e["args"]["Total Allocated"], e["args"].get("Bytes", 0))
              for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if not totals:
        return 0
    totals.sort()
    start = totals[0][1] - totals[0][2]
    return max(0, max(t for _, t, _ in totals) - start)


def profile_peak(prof) -> int:
    """`trace_peak` of a stopped `torch.profiler.profile(profile_memory=True)`."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_peak(path)


def worker(out: str, steps: int, warmup: int, train_argv: list[str]) -> int:
    """Run `mxgraph train` with optimizer hooks that time every step and profile one."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from mxgraph.cli.main import main as cli_main
    rank = int(os.environ.get("RANK", "0"))
    ends: list[float] = []
    memory: dict = {}
    profiled = steps - 1  # the step after this one's end (the last) is profiled: the gc walk
    # and the profiler's start run in this hook, inside the optimizer section, after the
    # monitor's last full interval (`SECTION_STEPS`)
    state = {}

    def hook(optimizer, args, kwargs):
        ends.append(time.perf_counter())
        if len(ends) == profiled:
            memory["state_bytes"] = live_tensor_bytes()
            state["prof"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            state["prof"].start()
        elif len(ends) == profiled + 1 and "prof" in state:
            state["prof"].stop()
            memory["step_peak_bytes"] = profile_peak(state["prof"])
            ends.append(time.perf_counter())  # the export is not the next step's time
    register_optimizer_step_post_hook(hook)
    import mxgraph.train.loop as train_module
    make_monitor, monitors = train_module.slow_node_monitor, []

    def keep_monitor(*args, **kwargs):  # its level-0 sections: where the step's time goes
        monitors.append(make_monitor(*args, **kwargs))
        return monitors[-1]
    train_module.slow_node_monitor = keep_monitor
    code = cli_main(["train", *train_argv, "--monitor-every", str(SECTION_STEPS)])
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    skip = {profiled - 1, profiled}  # the profiled step and the export
    timed = [d for i, d in enumerate(intervals) if i >= warmup - 1 and i not in skip]
    summaries = monitors[0].last_summaries if monitors else []
    sections = {name: ms / 1e3 for name, ms in
                summaries[rank]["sections"].items()} if len(summaries) > rank else {}
    result = {"rank": rank, "code": code, "intervals": intervals,
              "step_s": statistics.median(timed) if timed else None,
              "sections_s": sections, **memory}
    result["peak_bytes"] = memory.get("state_bytes", 0) + memory.get("step_peak_bytes", 0)
    if torch.cuda.is_available():  # on a GPU: the caching allocator's peak over the run
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    return code


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results path prefix (one file per rank)")
    parser.add_argument("--steps", type=int, required=True, help="training steps")
    parser.add_argument("--warmup", type=int, required=True, help="steps left out of the timing")
    known = parser.parse_args(argv[:split])
    return worker(known.out, known.steps, known.warmup, argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
