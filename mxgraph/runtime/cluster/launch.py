"""Joining the job torchrun started, from its environment (as torchtitan's trainer does)."""
from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist

from mxgraph.runtime.checkpoint.state import init_restartable_process_group
from mxgraph.runtime.cluster.device import detect


def init_from_environment() -> None:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) when WORLD_SIZE > 1 and none exists; otherwise do nothing.

    The backend is this process's device's (`runtime.cluster.device.detect`): "nccl" on a GPU (MCCL
    behind it under MXMACA), with that GPU (LOCAL_RANK) made the current device first, else
    "gloo". The group survives `torchrun --max-restarts` (`init_restartable_process_group`)
    and ends at exit (`close_process_group`, unless the script closed it first). A group the
    caller made itself is left as it is.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or \
            dist.is_initialized():
        return
    info = detect()
    if info.torch_device.type == "cuda":
        torch.cuda.set_device(info.torch_device)
    init_restartable_process_group(info.backend)
    atexit.register(close_process_group)  # ours: ended behind a barrier before teardown


def close_process_group() -> None:
    """End the default process group (and every subgroup) deterministically: a barrier, so
    that no rank tears its connections down while a peer still reads from them, then
    `destroy_process_group`, so that no gloo worker thread or pending work outlives the
    interpreter (at exit they abort the process: "terminate called without an active
    exception"). Nothing to do without a group. A barrier that fails because a peer is gone
    is let pass: the process ends either way, and its launcher reports the failure."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:  # a peer died (the failure torchrun restarts the job for)
            pass
        dist.destroy_process_group()
