"""What the MoE blocks of a compiled step decided in its last run, per block (the module
path of its experts): the fraction of (token, choice) rows capacity dropped, and the
experts replicated as hot.

The ops record as they run and return fresh tensors, so the graph keeps them; reading a
record is the only host sync (`last()`, after the step). A recomputed block records again,
with the same values. With several micro-batches the record is the last micro-batch's.
"""
from __future__ import annotations

import torch

DROPPED: dict[str, torch.Tensor] = {}
"""block -> fraction of its rows dropped by capacity (a 0-dim float tensor)."""
HOT: dict[str, list[int]] = {}
"""block -> the experts replicated in the last run ([] = replication off)."""


@torch.library.custom_op("mxgraph::moe_capacity_slots", mutates_args=())
def moe_capacity_slots(slots: torch.Tensor, dropped: int, block: str) -> torch.Tensor:
    """`slots` [N] int64: each row's place in the padded buffer, `dropped` for a dropped
    row. Records the dropped fraction of `block`; returns a copy of `slots`."""
    DROPPED[block] = (slots == dropped).float().mean().detach()
    return slots.clone()


@moe_capacity_slots.register_fake
def _(slots, dropped, block):
    return torch.empty_like(slots)


def last() -> dict[str, dict]:
    """{"dropped": {block: fraction}, "hot": {block: [experts]}} of the last run."""
    return {"dropped": {k: float(v) for k, v in DROPPED.items()},
            "hot": {k: list(v) for k, v in HOT.items()}}


def clear() -> None:
    DROPPED.clear()
    HOT.clear()


__all__ = ["DROPPED", "HOT", "clear", "last", "moe_capacity_slots"]
