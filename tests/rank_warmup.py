"""Imported by `run_ranks`' fork server only (tests/distributed.py `PRELOAD`): one tiny
compile and step of a preset and of a Hugging Face MoE model, in one process, so that what
torch and mxgraph load and cache on a process's first compile (lazy imports, the
dispatcher's and the fake tensors' caches: ~3 s on 2 cores) is in every rank from the
start.

It leaves no trace a rank could see: the random number generators are restored, no
thread stays (fx's Interpreter starts tqdm's monitor thread: stopped here; Python codegen,
whatever MXGRAPH_CODEGEN says, so no Inductor compile workers), no process group, no CUDA.
"""
from __future__ import annotations

import random

import torch
import tqdm

import models
import mxgraph as mx


def _step(model, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 8))
    step = mx.compile(model, mx.Plan(codegen="python"))  # Inductor starts compile workers
    # (threads, a process pool) that a forked rank would inherit dead and wait on forever
    step(tokens, tokens)


def warm_up() -> None:
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _step(models.build_model("llama-tiny"), 256)
        try:
            from mxgraph.hf.models import TINY, build_hf_model
            _step(build_hf_model("hf:mixtral", TINY["mixtral"]), TINY["mixtral"]["vocab_size"])
        except ImportError:  # no transformers: the presets only
            pass
    random.setstate(state)
    monitor = tqdm.tqdm.monitor
    if monitor is not None:
        monitor.exit()
        tqdm.tqdm.monitor = None


torch.set_num_threads(1)  # as each rank: intra-op work stays on this thread (no pool to fork)
try:
    # Under a CUDA build of torch (PyPI's default wheel on Linux), a process that ran a
    # backward forks children that cannot (autograd's device threads: "Unable to handle
    # autograd's threading in combination with fork-based multiprocessing"), GPU or not; a
    # warm-up's compile derives a backward, so there the ranks start cold.
    if torch.version.cuda is None:
        warm_up()
except Exception as error:  # noqa: BLE001 - only a head start: a rank that needs what failed
    print(f"tests/rank_warmup.py: warm-up failed ({error!r}); ranks start cold")  # fails itself
