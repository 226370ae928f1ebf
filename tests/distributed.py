"""Run a function on N gloo processes (torch.multiprocessing) and fail if any rank fails."""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        dist.destroy_process_group()  # a peer may be gone: no barrier
        raise
    try:  # no rank tears its connections down while a peer still reads: then no gloo
        # thread or pending work outlives the process (which aborted it at exit, now and then)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Call fn(rank, world, *args) on `world` processes; raise with the first failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or any(p.exitcode != 0 for p in procs):
        raise AssertionError("\n".join(failures) or
                             f"exit codes {[p.exitcode for p in procs]}")
