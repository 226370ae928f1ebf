"""Run a function on N gloo processes (torch.multiprocessing) and fail if any rank fails.

Ranks fork from a "forkserver" process that imported torch, mxgraph, the presets and
transformers once and ran one tiny compile (`PRELOAD`), instead of each re-importing them
as under "spawn" (4-7 s of CPU a rank on 2 cores). The server starts no CUDA, no process
group and keeps no thread of its own; each rank gets the caller's environment of the
moment (as a spawned process would), not the one the server started with."""
from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import tempfile
import traceback
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A loopback port free at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.export",
           "torch._functorch.aot_autograd", "torch.distributed.checkpoint", "mxgraph",
           "mxgraph.hf", "mxgraph.train", "models", "tests.distributed", "tests.helpers",
           "tests.overlap_checks", "pytest", "hypothesis", "transformers",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           *(f"transformers.models.{family}.modeling_{family}"
             for family in ("llama", "gpt2", "mixtral", "qwen2_moe")), "tests.rank_warmup"]
"""Imported once by the fork server (a module that is not installed is skipped); the last
compiles a tiny model, so that a rank's first compile finds torch's lazy imports and caches
filled."""


class _ParentFd:
    """One of the caller's file descriptors, duplicated into the rank as it is pickled for
    it (a forked rank's own stdout and stderr are the fork server's)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


_fatal_log = None
"""The open file a rank's faulthandler writes to (kept open for the rank's life)."""


def _worker(rank, world, port, env, fds, fatal_path, fn, args, errors):
    global _fatal_log
    for fd, target in zip(fds, (1, 2), strict=True):  # print where a spawned rank would: the caller's
        os.dup2(fd, target)              # stdout and stderr (pytest's capture)
        os.close(fd)
    # a rank killed by a signal (SIGSEGV, SIGABRT) writes its threads' stacks there, and
    # run_ranks puts them in its failure message (captured stderr may be cut from a CI log)
    _fatal_log = open(fatal_path, "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=_fatal_log, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.seed()  # a seed of its own, as a spawned rank has (a fork has the server's state)
    # Inductor's cache_dir() (called by a rank's first compile: compiler_bisector) writes
    # TORCHINDUCTOR_CACHE_DIR into the environment; adding a variable reallocates glibc's
    # environ, which a getenv on another thread (gloo's, once the group is up) may be reading.
    # Set it here, while the rank has one thread: later writes only replace a value. (The one
    # thread-unsafe step found on the path of test_overlap[4]'s lost ranks; not proven to be
    # their cause.)
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    cache_dir()
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
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (once)
    errors = ctx.SimpleQueue()
    port = free_port()
    fds = (_ParentFd(1), _ParentFd(2))
    with tempfile.TemporaryDirectory(prefix="mxgraph-ranks-") as fatal_dir:
        paths = [os.path.join(fatal_dir, f"rank{r}.txt") for r in range(world)]
        procs = [ctx.Process(target=_worker, args=(r, world, port, dict(os.environ), fds,
                                                   paths[r], fn, args, errors))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        codes = [p.exitcode for p in procs]
        # a negative code is the signal that killed that rank (-9: SIGKILL, e.g. out of
        # memory; -11: SIGSEGV); first in the message, with the stacks it left
        killed = [f"rank {r} killed by signal {-code}; its threads' stacks:\n{_read(paths[r])}"
                  for r, code in enumerate(codes) if code is not None and code < 0]
    if failures or any(code != 0 for code in codes):
        raise AssertionError("\n".join([f"exit codes by rank {codes}", *killed, *failures]))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "(none written)"
    except OSError as error:
        return f"(unreadable: {error})"
