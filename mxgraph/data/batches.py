"""Training data: built-in byte-level text, a user's text file, or a .npy of token ids.

Built in: the Python standard library's `.py` sources found on the running interpreter,
read in sorted path order as bytes (token ids 0..255) up to `max_bytes`. The split is
fixed: the last `val_fraction` of the bytes is validation, the rest training.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from mxgraph.data.loader import Loader
from mxgraph.errors import DataError

FORMATS = ("a text file whose bytes are the tokens, or a .npy file of a 1-D integer array "
           "of token ids")


def stdlib_bytes(max_bytes: int = 8_000_000) -> np.ndarray:
    """Bytes of the standard library's .py files (sorted by path) as uint8 token ids."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise DataError(f"no built-in text: no .py sources under {root}; pass --data FILE "
                        f"({FORMATS})")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def load_tokens(source: str | None, max_bytes: int = 8_000_000) -> np.ndarray:
    """Token ids from `source`: None = built-in, *.npy = ids, anything else = bytes."""
    if source is None:
        return stdlib_bytes(max_bytes)
    path = check_source(source)
    if path.suffix == ".npy":
        return _token_ids(path)
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


def check_source(source: str) -> Path:
    """The path of data file `source`; DataError naming the file and the accepted formats
    if it is missing or unreadable, or a .npy whose header is not 1-D integer ids (reads
    the header only: cheap enough to check before building a model)."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"data file {source} does not exist; --data takes {FORMATS}")
    if not path.is_file():
        raise DataError(f"data file {source} is not a file; --data takes {FORMATS}")
    if not os.access(path, os.R_OK):
        raise DataError(f"data file {source} is not readable (permissions); make it "
                        f"readable or pass another file")
    if path.suffix == ".npy":
        _token_ids(path, mmap_mode="r")
    return path


def _token_ids(path: Path, mmap_mode: str | None = None) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:  # numpy's words (pickle...) mislead
        raise DataError(f"{path}: not a NumPy .npy array; write the token ids with "
                        "numpy.save, or rename the file without .npy to read its bytes as text"
                        ) from error
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path}: expected a 1-D integer array of token ids, "
                        f"got shape {tokens.shape} dtype {tokens.dtype}")
    return tokens


class Batches(Loader):
    """Random windows of `seq_len + 1` tokens: inputs [B, S] and next-token targets [B, S].

    Deterministic given `seed`; `state_dict()` / `load_state_dict()` hold the position.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        if len(tokens) <= seq_len + 1:
            raise DataError(f"{len(tokens)} tokens are too few for seq_len={seq_len}: a batch "
                            f"needs seq_len + 2; use more data or a smaller --seq-len")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,),
                               generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        window = self.tokens[starts[:, None] + offsets]
        self.step += 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.generator.set_state(state["generator"])


def split(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Fixed split: the last `val_fraction` of the tokens is validation."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]
