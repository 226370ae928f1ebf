"""Token files: a data source's documents tokenized once, packed, memory-mapped.

The token file of (data, tokenizer, field) lies beside the data (beside a datasets
directory, not in it): `DATA.<key>.tokens.npy`, a 1-D .npy of uint16 ids (a tokenizer of
at most 65,536 tokens) or uint32. It holds every document's tokens as the tokenizer gives
them by default (`tokenizer(text)["input_ids"]`: special tokens such as a BOS included),
each document followed by the end-of-text token (the tokenizer's `eos_token`; not doubled
when the tokenizer already ends a document with it), in document order.

`key` hashes the format version, the tokenizer's files (their bytes), the data files' sizes
and modification times, and the field read: a changed data file or tokenizer makes a new
token file (the old one stays until deleted). `ensure_token_file` makes it at most once
per file system: the processes that want it take an exclusive lock on `DATA.<key>.lock`
in turn; the first makes it (into a temporary name, renamed when complete), the others
find it made.
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mxgraph.data.documents import check_documents, data_files, progress_total, read_documents
from mxgraph.errors import DataError, UserError
from mxgraph.hf.files import HF_INSTALL_HINT, TOKENIZER_MARKERS, is_tokenizer_file

log = logging.getLogger("mxgraph.data")

FORMAT_VERSION = 1
"""Part of every key: raise it when the packing changes, so old token files are not read."""


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds a saved tokenizer (tokenizer.json or tokenizer_config.json)."""
    path = Path(directory)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_MARKERS)


def default_tokenizer(model_spec: str) -> str | None:
    """The tokenizer `--model model_spec` brings: the model directory itself when it holds
    tokenizer files (`has_tokenizer`), else None."""
    return model_spec if has_tokenizer(model_spec) else None


def load_tokenizer(directory: str):
    """`transformers.AutoTokenizer` of the local `directory` (nothing is downloaded).
    UserError for a missing transformers, a path that is no tokenizer directory, a tokenizer
    transformers cannot load, or one without an end-of-text token."""
    if not has_tokenizer(directory):
        what = "does not exist" if not os.path.exists(directory) else \
            "holds no tokenizer.json or tokenizer_config.json"
        raise UserError(f"--tokenizer {directory} {what}; pass the directory a tokenizer was "
                        f"saved to (tokenizer.save_pretrained(DIR), e.g. a model's directory)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"--tokenizer needs the transformers package: {HF_INSTALL_HINT}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"--tokenizer {directory}: transformers cannot load it ({detail})") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"--tokenizer {directory} has no end-of-text token (eos_token), which "
                        f"packing puts between documents; set one: tokenizer.eos_token = "
                        f"'...'; tokenizer.save_pretrained(DIR) (or \"eos_token\" in its "
                        f"tokenizer_config.json)")
    return tokenizer


def check_vocab(tokenizer, directory: str, vocab_size: int, model: str) -> None:
    """UserError when the tokenizer has more tokens than the model's embedding rows."""
    if len(tokenizer) > vocab_size:
        raise UserError(f"--tokenizer {directory} has {len(tokenizer)} tokens but {model}'s "
                        f"embedding has vocab_size={vocab_size}; pick the tokenizer made for "
                        f"this model, or a model with a vocabulary of at least {len(tokenizer)} "
                        f"(--model-config vocab_size={len(tokenizer)})")


def token_dtype(tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32)


def tokenizer_hash(directory: str, tokenizer) -> str:
    """sha256 of the tokenizer's files (names and bytes), in name order: those of
    `mxgraph.hf.files.TOKENIZER_FILES` in `directory`, and the tokenizer class's own
    vocabulary files."""
    names = {path.name for path in Path(directory).iterdir() if is_tokenizer_file(path.name)}
    names |= set(getattr(tokenizer, "vocab_files_names", {}).values())
    digest = hashlib.sha256()
    for name in sorted(names):
        path = Path(directory, name)
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def token_file_path(data: str, tokenizer_dir: str, tokenizer, field: str) -> Path:
    """Where the token file of `data` by this tokenizer (and `field`) lies."""
    digest = hashlib.sha256(f"v{FORMAT_VERSION}\0{tokenizer_hash(tokenizer_dir, tokenizer)}"
                            f"\0{field}".encode())
    for file in data_files(data):
        stat = file.stat()
        digest.update(f"\0{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    base = Path(data)  # a directory's trailing "/" goes
    return base.with_name(f"{base.name}.{digest.hexdigest()[:16]}.tokens.npy")


def open_tokens(path: Path) -> np.ndarray:
    """The token file's ids, memory-mapped read-only."""
    return np.load(path, mmap_mode="r", allow_pickle=False)


def ensure_token_file(data: str, tokenizer_dir: str, field: str = "text", *,
                      progress: bool = True, tokenizer=None) -> Path:
    """The token file of `data` (`check_documents` kinds) by the tokenizer in
    `tokenizer_dir`, made if missing (under the lock, so once however many processes ask).
    DataError for bad data, UserError for a bad tokenizer or an unwritable place."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    kind = check_documents(data, field)
    path = token_file_path(data, tokenizer_dir, tokenizer, field)
    if path.is_file():
        return path
    lock = path.with_name(path.name[:-len(".tokens.npy")] + ".lock")
    try:
        handle = open(lock, "a")
    except OSError as error:
        raise UserError(f"cannot write the token file beside {data} ({error.strerror}); copy "
                        f"the data to a directory you can write") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when closed, also by a killed process
        try:
            if not path.is_file():
                write_token_file(path, data, kind, field, tokenizer, progress=progress)
        finally:  # a process waiting on it then finds the token file (or makes it)
            lock.unlink(missing_ok=True)
    return path


def write_token_file(path: Path, data: str, kind: str, field: str, tokenizer, *,
                     progress: bool = True) -> tuple[int, int]:
    """Tokenize `data`'s documents in batches into the token file `path` (tqdm bar over
    bytes or rows); returns (documents, tokens)."""
    dtype, eos = token_dtype(tokenizer), tokenizer.eos_token_id
    raw = path.with_name(f"{path.name}.{os.getpid()}.part")
    done = path.with_name(f"{path.name}.{os.getpid()}.tmp.npy")
    started, num_documents, num_tokens = time.perf_counter(), 0, 0
    unit = "B" if kind in ("txt", "jsonl") else "row"
    try:
        with open(raw, "wb") as out, tqdm(total=progress_total(data, kind), unit=unit,
                                          unit_scale=True, disable=not progress,
                                          desc=f"tokenizing {Path(data).name}") as bar:
            for texts, advance in read_documents(data, kind, field):
                ids = pack(tokenizer(texts, return_attention_mask=False, verbose=False)
                           ["input_ids"], eos, dtype) if texts else np.zeros(0, dtype)
                out.write(ids.tobytes())
                num_documents += len(texts)
                num_tokens += len(ids)
                bar.update(advance)
        if num_documents == 0:
            raise DataError(f"data {data} holds no documents; give it some text")
        tokens = np.lib.format.open_memmap(done, mode="w+", dtype=dtype, shape=(num_tokens,))
        chunk = 1 << 24
        for start in range(0, num_tokens, chunk):
            count = min(chunk, num_tokens - start)
            tokens[start:start + count] = np.fromfile(raw, dtype=dtype, count=count,
                                                      offset=start * dtype.itemsize)
        tokens.flush()
        del tokens
        os.replace(done, path)
    except OSError as error:  # reading the data was checked; writing beside it was not
        raise UserError(f"cannot make the token file {path} ({error.strerror or error}: "
                        f"{error.filename}); the data's directory must be writable, with free "
                        f"space (copy the data elsewhere if not)") from None
    finally:
        for leftover in (raw, done):
            leftover.unlink(missing_ok=True)
    log.info("tokenized %s: %d documents, %d tokens in %.1f s -> %s", data, num_documents,
             num_tokens, time.perf_counter() - started, path)
    return num_documents, num_tokens


def pack(documents: list[list[int]], eos: int, dtype: np.dtype) -> np.ndarray:
    """The documents' ids one after the other, each followed by `eos` (unless it already
    ends with it), as `dtype`."""
    pieces = []
    for ids in documents:
        pieces.append(ids)
        if not ids or ids[-1] != eos:
            pieces.append([eos])
    flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64,
                       count=sum(map(len, pieces)))
    if len(flat) and int(flat.max()) > np.iinfo(dtype).max:
        raise DataError(f"token id {int(flat.max())} does not fit {dtype}: the tokenizer's "
                        f"ids exceed its size; save the tokenizer again")
    return flat.astype(dtype)
