"""Training state for the flash checkpoint: what to capture, how to put it back.

`capture_training_state` returns references (the checkpointer copies them); everything
under "rank_local" (RNG states, data position) is per rank, the rest is the same on every
data-parallel rank and is stored once on disk.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import torch.distributed as dist

from mxgraph.runtime.checkpoint.shm import Shard


def init_restartable_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """`dist.init_process_group` that survives `torchrun --max-restarts`.

    torch 2.13's torchrun keeps one store across restarts, so a restarted gloo group reads
    the dead attempt's addresses ("Connection refused" in connectFullMesh); a store prefix
    per attempt (TORCHELASTIC_RESTART_COUNT) keeps attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"/mxgraph/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, **kwargs)


def capture_rng() -> dict:
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        rng["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def apply_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _named_tensors(model_or_params: Any) -> dict[str, torch.Tensor]:
    if isinstance(model_or_params, torch.nn.Module):
        return model_or_params.state_dict()
    if isinstance(model_or_params, dict):
        return dict(model_or_params)
    return {str(i): p for i, p in enumerate(model_or_params)}


def capture_training_state(model_or_params: Any, optimizer: Any = None, scheduler: Any = None,
                           data_position: Any = None, plan_dict: dict | None = None) -> dict:
    """The state to pass to `FlashCheckpointer.save` (references, not copies).

    model_or_params: an nn.Module (its state_dict), a dict name -> tensor, or a list of
    this rank's parameter shards. Tensors outside "rank_local" are taken to be the same on
    every data-parallel rank and are stored once on disk.
    """
    return {
        "model": _named_tensors(model_or_params),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "plan": plan_dict,
        "rank_local": {"data_position": data_position, "rng": capture_rng()},
    }


def apply_training_state(state: dict, model_or_params: Any, optimizer: Any = None,
                         scheduler: Any = None, *, restore_rng: bool = True) -> Any:
    """Load `state` into the live objects; returns the data position."""
    if isinstance(model_or_params, torch.nn.Module):
        model_or_params.load_state_dict(state["model"])
    else:
        targets = _named_tensors(model_or_params)
        with torch.no_grad():
            for name, t in state["model"].items():
                dst = targets[name].local if isinstance(targets[name], Shard) else targets[name]
                dst.copy_(t.local if isinstance(t, Shard) else t)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        apply_rng(state["rank_local"]["rng"])
    return state["rank_local"]["data_position"]
