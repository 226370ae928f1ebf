"""Batches of packed documents: fixed-length sequences of a token file, shuffled per epoch.

The token stream (documents joined by their end-of-text tokens, `mxgraph.token_file`) is
cut into N = (len(tokens) - 1) // S sequences of S + 1 tokens (S = seq_len): sequence i is
tokens[i*S : (i+1)*S + 1], so neighbours share one token and every token after the first is
a target once per epoch. Inputs are a sequence's first S tokens, targets its last S.

Epoch e reads the N sequences in the order of a permutation seeded by (seed, e) (as
Megatron's and torchtitan's loaders: a sequential pass over a shuffled index). Each step
takes the next dp_size * batch_size of them, data-parallel rank r the r-th batch_size: ranks
read different sequences. The N mod (dp_size * batch_size) sequences left at an epoch's end
are skipped. The position (steps read, epoch, sequences read in it) is the state: the same
on every rank and independent of dp_size, so a run resumed on another number of ranks goes
on from the same place.
"""
from __future__ import annotations

import numpy as np
import torch

from mxgraph.data.loader import Loader
from mxgraph.errors import DataError


class PackedBatches(Loader):
    """Inputs [B, S] and next-token targets [B, S] (int64) for data-parallel rank `dp_rank`
    of `dp_size`; `state_dict()` / `load_state_dict()` hold the position."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_sequences = max(0, (len(tokens) - 1) // seq_len)
        if self.num_sequences < batch_size * dp_size:
            raise DataError(f"{len(tokens)} tokens make {self.num_sequences} sequences of "
                            f"seq_len + 1 = {seq_len + 1}, fewer than a step reads "
                            f"({dp_size} data-parallel rank(s) x batch size {batch_size}); use "
                            f"more data or a smaller --batch-size or --seq-len")
        self.step, self.epoch, self.offset = 0, 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The sequence indices of `epoch` in reading order."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed & 0xFFFF_FFFF_FFFF_FFFF, epoch])
            self._order = (epoch, rng.permutation(self.num_sequences))
        return self._order[1]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_step = self.batch_size * self.dp_size
        if self.offset + per_step > self.num_sequences:
            self.epoch, self.offset = self.epoch + 1, 0
        first = self.offset + self.dp_rank * self.batch_size
        indices = self.order(self.epoch)[first:first + self.batch_size]
        window = np.stack([self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
                           for i in indices.tolist()])
        self.offset += per_step
        self.step += 1
        batch = torch.from_numpy(window.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "offset": self.offset,
                "num_sequences": self.num_sequences, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """The position of `state`; DataError when it was read from other data (another
        kind of --data, another number of sequences, another seed)."""
        if "offset" not in state:
            raise DataError("the checkpoint's data position is of byte or .npy data, not of "
                            "tokenized documents; resume with the same --data and --tokenizer")
        if (state["num_sequences"], state["seed"]) != (self.num_sequences, self.seed):
            raise DataError(f"the checkpoint's data position is in {state['num_sequences']} "
                            f"sequences (seed {state['seed']}), this data makes "
                            f"{self.num_sequences} (seed {self.seed}); resume with the same "
                            f"--data, --tokenizer, --seq-len and --seed")
        self.step, self.epoch, self.offset = state["step"], state["epoch"], state["offset"]
