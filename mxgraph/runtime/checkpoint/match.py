"""Does a checkpoint fit the run that resumes from it? Checked before anything is loaded.

A restore with a template (`FlashCheckpointer.restore(into=state)`) compares every tensor
the template holds with what the snapshot saved under the same key: its shape and dtype.
The first difference stops the restore with a `CheckpointMismatchError` that names the
tensor and both shapes, so that a checkpoint of another model or plan is never loaded
partially. Rank-local keys (`__rank<r>__/...`) are compared without the rank prefix, since
a rank may restore another rank's part at a new world size.

Saved tensors the template lacks are fine where the template cannot know them yet (the
optimizer's moments before its first step), but not under a model's parameters.
"""
from __future__ import annotations

import re

import torch

from mxgraph.errors import UserError

_RANK = re.compile(r"^__rank\d+__/")
_MODEL_PARTS = ("model/", "rank_local/sharded/model/")


class CheckpointMismatchError(UserError):
    """A checkpoint holds tensors of another model or plan than the run resuming from it."""


Signature = dict[str, tuple[tuple[int, ...], torch.dtype] | None]
"""key -> (shape, dtype); None for a shard saved on disk (its whole shape is not a piece's)."""


def _plain(key: str) -> str:
    return _RANK.sub("", key, count=1)


def signature_of(tensors: dict[str, torch.Tensor]) -> Signature:
    """key -> (shape, dtype) of a flattened state's tensors (keys without rank prefix)."""
    return normalized({k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})


def normalized(signature: Signature) -> Signature:
    """The same signature with rank-local keys stripped of their `__rank<r>__/` prefix."""
    return {_plain(k): v for k, v in signature.items()}


def _shape(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def first_mismatch(saved: Signature, wanted: Signature) -> str | None:
    """A sentence naming the first tensor that differs (None when the snapshot fits):
    a template tensor with another shape or dtype than saved, a template tensor the
    snapshot lacks, or a saved model parameter the template lacks."""
    for key in sorted(wanted):
        if key not in saved:
            return f"{key} ({_shape(*wanted[key])} here) is not in the checkpoint"
        if saved[key] is not None and saved[key] != wanted[key]:  # None: a shard, any piece
            return (f"{key} is {_shape(*saved[key])} in the checkpoint but "
                    f"{_shape(*wanted[key])} here")
    for key in sorted(saved):
        if key not in wanted and key.startswith(_MODEL_PARTS):
            shape = "a shard" if saved[key] is None else _shape(*saved[key])
            return f"the checkpoint has {key} ({shape}), which this run has not"
    return None


def mismatch_error(what: str, reason: str) -> CheckpointMismatchError:
    """The error for snapshot `what` (a path or "the in-memory snapshot of step N")."""
    return CheckpointMismatchError(
        f"{what} does not fit this model and plan: {reason}; it was saved by another model "
        f"or plan. Resume it with the model and plan that wrote it, or start afresh with "
        f"another --checkpoint-dir (or without --resume)")
