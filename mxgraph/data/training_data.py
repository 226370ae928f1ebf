"""What `--data`, `--tokenizer` and `--data-field` make of a run's data.

- no --data: the built-in text, its bytes the tokens (`mxgraph.data.batches`); --tokenizer is then
  an error (there is nothing to tokenize).
- a `.npy`: token ids as they are (a tokenizer, the model directory's say, is not used).
- with a tokenizer (--tokenizer DIR, else the model directory's own, `default_tokenizer`):
  documents (`mxgraph.data.documents`: .txt, .jsonl, .parquet, a save_to_disk directory),
  tokenized once into a token file beside the data (`mxgraph.data.token_file`) and packed into
  sequences (`mxgraph.data.packed.PackedBatches`).
- without one: a .jsonl, .parquet or datasets directory is an error (nothing to tokenize
  with); any other file is read as today, its bytes the tokens (random windows,
  `mxgraph.data.batches.Batches`).

Validation is the last 5% of the tokens in every case (`mxgraph.data.batches.split`): for
documents, the last ones in file order (the cut may fall inside one).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mxgraph.data.batches import Batches, check_source, load_tokens, split
from mxgraph.data.documents import check_documents, document_kind
from mxgraph.data.packed import PackedBatches
from mxgraph.data.token_file import check_vocab, default_tokenizer, ensure_token_file, load_tokenizer, open_tokens
from mxgraph.errors import DataError, UserError


@dataclass
class TrainingData:
    """A run's tokens and the loader that reads them."""

    tokens: np.ndarray
    """Every token id (memory-mapped for a token file)."""
    packed: bool
    """Packed documents (`PackedBatches`), else random windows (`Batches`)."""

    def batches(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                dp_rank: int = 0, dp_size: int = 1) -> Batches | PackedBatches:
        """The loader of data-parallel rank `dp_rank` over `tokens` (a split of `self.tokens`):
        packed, ranks read different sequences of one shuffled order; random windows, each
        rank its own seed (seed + dp_rank)."""
        if self.packed:
            return PackedBatches(tokens, batch_size, seq_len, seed, dp_rank, dp_size)
        return Batches(tokens, batch_size, seq_len, seed=seed + dp_rank)


def resolve_tokenizer(tokenizer: str | None, model: str) -> str | None:
    """--tokenizer, else the tokenizer of the model directory (`default_tokenizer`), else None."""
    return tokenizer or default_tokenizer(model)


def check_training_data(data: str | None, tokenizer: str | None, field: str, model: str,
                        vocab_size: Callable[[], int], batch_size: int, seq_len: int, *,
                        prepare: bool = False, progress: bool = True) -> TrainingData | None:
    """Check `--data`/`--tokenizer`/`--data-field` against each other and the model:
    `vocab_size()` gives the model's vocabulary from its config (no model built), checked
    against a tokenizer's. Only what needs no full read of the data is checked, unless
    `prepare`: then the token file is made if missing (`ensure_token_file`; every document
    read), must give both splits a batch of `batch_size` sequences of `seq_len` + 1, and is
    returned (memory-mapped); else None. UserError (DataError) on bad input, naming the fix."""
    tokenizer_dir = resolve_tokenizer(tokenizer, model)
    if data is None or data.endswith(".npy"):
        if tokenizer:  # asked for, but never used: say so rather than ignore it
            what = "the built-in text is read as bytes" if data is None else \
                f"{data} holds token ids already"
            raise UserError(f"--tokenizer {tokenizer} has nothing to tokenize: {what}; pass "
                            f"--data FILE of documents (.txt, .jsonl, .parquet or a datasets "
                            f"directory), or drop --tokenizer")
        tokenizer_dir = None
    if tokenizer_dir is None:
        if data is not None and os.path.exists(data) and document_kind(data) not in (None, "txt"):
            raise DataError(f"--data {data} holds documents to tokenize: pass --tokenizer DIR "
                            f"(the directory of the model's tokenizer)")
        if data is not None:
            check_source(data)
        return None
    loaded = load_tokenizer(tokenizer_dir)
    check_vocab(loaded, tokenizer_dir, vocab_size(), model)
    check_documents(data, field)
    if not prepare:
        return None
    tokens = open_tokens(ensure_token_file(data, tokenizer_dir, field, progress=progress,
                                           tokenizer=loaded))
    for name, part in zip(("training", "validation"), split(tokens), strict=True):
        if (len(part) - 1) // seq_len < batch_size:
            raise DataError(f"{data} makes {len(tokens)} tokens: its {name} split ({len(part)} "
                            f"tokens) holds fewer than a batch of {batch_size} sequences of "
                            f"{seq_len} + 1; use more data or a smaller --batch-size or --seq-len")
    return TrainingData(tokens, packed=True)


def training_data(data: str | None, tokenizer: str | None, field: str, model: str,
                  vocab_size: Callable[[], int], batch_size: int, seq_len: int, *,
                  progress: bool = True) -> TrainingData:
    """The run's data: `check_training_data`'s token file of documents (made if missing),
    else the built-in text, a file's bytes or a .npy's ids (`mxgraph.data.batches.load_tokens`)."""
    packed = check_training_data(data, tokenizer, field, model, vocab_size, batch_size,
                                 seq_len, prepare=True, progress=progress)
    return packed if packed is not None else TrainingData(load_tokens(data), packed=False)
