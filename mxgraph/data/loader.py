"""The loader protocol every training-data reader follows (`Batches`, `PackedBatches`).

A loader hands out this rank's batches, `(inputs, targets)` int64 [batch, seq], one per
`next()`; its position is a plain dict (`state_dict` / `load_state_dict`) that a checkpoint
keeps, so a resumed run reads on from the same place. `peek` is derived from those three.
"""
from __future__ import annotations

import torch


class Loader:
    """Base of the loaders: `next`, `state_dict` and `load_state_dict` are theirs; `peek`
    is shared."""

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of the right shape, without advancing the position."""
        state = self.state_dict()
        batch = self.next()
        self.load_state_dict(state)
        return batch
