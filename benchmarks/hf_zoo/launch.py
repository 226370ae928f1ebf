"""Run cells in worker processes, each under a time limit, and hand each result back.

A batch is a list of (model_type, plan name) cells of one world size. It runs in a worker
process (`python benchmarks/bench_hf_zoo.py --worker SPEC`, its own session): world 1 runs
the cells one after another; world 2 makes one `tests.distributed.run_ranks` launch whose
two gloo ranks loop over the cells (start-up and the fork server's imports paid once per
batch), each cell's exceptions caught per rank. Every cell's result is a file
`<out>/<index>.rank<r>.json`, written as soon as it is known.

The parent polls the files. A cell over its limit (the in-process SIGALRM missed it: a rank
waiting in a collective for a peer that failed, a C++ loop) or a worker that died (a
segfault) ends the worker's whole process group; that cell is recorded (timeout, or crash
with the exit code, or the one rank's result when its peer is stuck), and the batch's
remaining cells go on in a new worker.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

STARTUP_S = 120
"""Allowance for a worker's imports (and a fork server's warm-up compile) before its first cell."""
PEER_GRACE_S = 60
"""How long a rank's result may wait for its peer's before the peer counts as stuck."""
SEVERITY = ("pass", "refused", "wrong", "timeout", "crash")
CELLS_PER_LAUNCH = 4
"""Cells per run_ranks launch: it joins each rank for at most 600 s (tests/distributed.py),
so a launch stays well within that; later launches reuse the worker's fork server."""


@dataclass
class Batch:
    world: int
    cells: list[tuple[str, str]]
    timeout: float


@dataclass
class _Running:
    batch: Batch
    proc: subprocess.Popen
    out: Path
    done: int = 0
    since: float = field(default_factory=time.monotonic)
    first_rank_at: float | None = None


def run_batches(batches: list[Batch], jobs: int, on_result, bench_script: Path) -> None:
    """Run every batch (up to `jobs` workers at once); on_result(model_type, plan, result)
    for each cell, in the parent process."""
    pending, running = list(batches), []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(_start(pending.pop(0), bench_script))
            time.sleep(0.5)
            for job in list(running):
                rest = _poll(job, on_result)
                if rest is not None:
                    running.remove(job)
                    if rest.cells:
                        pending.insert(0, rest)
    finally:
        for job in running:
            _kill(job.proc)


def _start(batch: Batch, bench_script: Path) -> _Running:
    out = Path(tempfile.mkdtemp(prefix="hf_zoo_"))
    spec = out / "spec.json"
    spec.write_text(json.dumps({"world": batch.world, "cells": batch.cells, "timeout": batch.timeout,
                                "out": str(out)}))
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, str(bench_script), "--worker", str(spec)],
                                start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    return _Running(batch, proc, out, since=time.monotonic() + STARTUP_S)


def _poll(job: _Running, on_result) -> Batch | None:
    """Hand over finished cells; None while the worker goes on, else the cells left over."""
    batch = job.batch
    while job.done < len(batch.cells):
        ranks = [_read(job.out / f"{job.done}.rank{r}.json") for r in range(batch.world)]
        if any(r is None for r in ranks):
            break
        on_result(*batch.cells[job.done], merge(ranks))
        job.done, job.since, job.first_rank_at = job.done + 1, time.monotonic(), None
    if job.done == len(batch.cells):
        job.proc.wait()
        shutil.rmtree(job.out, ignore_errors=True)
        return Batch(batch.world, [], batch.timeout)
    now, exit_code = time.monotonic(), job.proc.poll()
    ranks = [_read(job.out / f"{job.done}.rank{r}.json") for r in range(batch.world)]
    present = [r for r in ranks if r is not None]
    if present and job.first_rank_at is None:
        job.first_rank_at = now
    if exit_code is not None:
        detail = f"worker exited with code {exit_code} ({_signal_name(exit_code)}); log {job.out / 'log.txt'}"
        result = _merge_partial(present, {"status": "crash", "detail": detail})
    elif present and now - job.first_rank_at > PEER_GRACE_S:
        result = _merge_partial(present, {"status": "timeout", "detail": "a rank is stuck (its peer failed?)"})
    elif now - job.since > batch.timeout + PEER_GRACE_S:
        result = {"status": "timeout", "detail": f"over {batch.timeout:.0f} s (worker killed)"}
    else:
        return None
    _kill(job.proc)
    if exit_code is None:  # the log of a worker that died is kept (its path is in the detail)
        shutil.rmtree(job.out, ignore_errors=True)
    on_result(*batch.cells[job.done], result)
    return Batch(batch.world, batch.cells[job.done + 1:], batch.timeout)


def merge(ranks: list[dict]) -> dict:
    """One cell from its ranks' results: the most severe, naming the rank when they differ."""
    worst = max(range(len(ranks)), key=lambda r: SEVERITY.index(ranks[r]["status"])
                if ranks[r]["status"] in SEVERITY else len(SEVERITY))
    result = dict(ranks[worst])
    if len(ranks) > 1 and len({r["status"] for r in ranks}) > 1:
        result["detail"] = f"rank {worst}: {result.get('detail', '')}"
        result["ranks"] = [r["status"] for r in ranks]
    return result


def _merge_partial(present: list[dict], missing: dict) -> dict:
    if not present:
        return missing
    result = merge(present)
    if SEVERITY.index(result["status"]) < SEVERITY.index(missing["status"]):
        return {**missing, "detail": f"{missing['detail']}; the other rank: {result['status']} "
                                     f"{result.get('detail', '')}".strip()}
    return {**result, "detail": f"{result.get('detail', '')}; the other rank: {missing['detail']}"}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name if code < 0 else "error"
    except ValueError:
        return "error"


def _kill(proc: subprocess.Popen) -> None:
    """End the worker and everything it started (its own session: fork server, ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---- the worker side ----------------------------------------------------------------------
def worker_main(spec_path: str) -> int:
    """Run the cells of a spec (see _start); each result to its file."""
    from . import cells
    spec = json.loads(Path(spec_path).read_text())
    out, timeout = Path(spec["out"]), spec["timeout"]
    if spec["world"] == 1:
        for index, (model_type, plan) in enumerate(spec["cells"]):
            result = cells.eager_cell(model_type) if plan == "eager" else \
                cells.run_cell(model_type, cells.PLANS[plan], timeout=timeout)
            _write(out / f"{index}.rank0.json", result)
        return 0
    from tests.distributed import run_ranks
    for first in range(0, len(spec["cells"]), CELLS_PER_LAUNCH):
        run_ranks(spec["world"], rank_main, spec["cells"][first:first + CELLS_PER_LAUNCH], first, str(out), timeout)
    return 0


def rank_main(rank: int, world: int, cell_list: list, first: int, out: str, timeout: float) -> None:
    """Every cell on this rank, in order; a cell's failure is its result, not the launch's."""
    from . import cells
    for index, (model_type, plan) in enumerate(cell_list, start=first):
        result = cells.run_cell(model_type, cells.PLANS[plan], rank, world, timeout)
        _write(Path(out) / f"{index}.rank{rank}.json", result)


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
