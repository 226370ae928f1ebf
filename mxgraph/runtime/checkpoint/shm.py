"""Snapshot slots in host shared memory (`/dev/shm`) for the flash checkpoint.

A slot is one file `/dev/shm/mxgraph-<run>-r<rank>-s<i>` mapped into memory:

    [0, 4096)            header: fixed 8-byte fields (see `_FIELDS`)
    [4096, meta_end)     pickled `SnapshotMeta` (skeleton of the state + tensor specs)
    [data_off, ...)      tensor bytes, each 64-byte aligned

Protocol (writer = the training rank, reader = the saver or a restarting rank):
- the writer holds `flock(LOCK_EX)` on the slot file while it writes; it sets
  `state = WRITING` before touching any byte and `state = COMPLETE` after the last one,
  so a rank killed mid-copy leaves a slot that is never loaded;
- the reader takes the same lock before it reads tensor bytes, so the writer skips a slot
  that is being persisted instead of tearing it;
- the reader only ever writes `persisted_seq` / `persist_status`; the writer never does,
  so their field writes cannot clobber each other (each field is an aligned 8-byte word).

Files are plain tmpfs files (not `multiprocessing.shared_memory`, whose resource tracker
would unlink them when the writer dies: the saver must outlive it).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import pickle
import re
import struct
import zlib
from typing import Any

import torch

SHM_DIR = "/dev/shm"
HEADER_SIZE = 4096
ALIGN = 64
MAGIC = b"MXGCKPT1"
VERSION = 1

EMPTY, WRITING, COMPLETE = 0, 1, 2

# Every field is one aligned 8-byte word: single stores are atomic on the platforms we run.
_FIELDS = [
    ("magic", "8s"), ("version", "q"), ("state", "q"), ("seq", "q"), ("step", "q"),
    ("persist_req", "q"), ("closed", "q"), ("owner_pid", "q"), ("persisted_seq", "q"),
    ("persist_status", "q"), ("meta_off", "q"), ("meta_len", "q"), ("meta_crc", "q"),
    ("data_off", "q"), ("data_len", "q"), ("rank", "q"), ("world_size", "q"),
    ("wall_time", "d"),
]
_OFFSET = {name: (8 * i, "<" + fmt) for i, (name, fmt) in enumerate(_FIELDS)}


def segment_prefix(run_id: str) -> str:
    """File-name prefix shared by every segment of one run (used for cleanup and discovery)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return f"mxgraph-{safe}-"


def slot_path(run_id: str, rank: int, slot: int, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{segment_prefix(run_id)}r{rank}-s{slot}")


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Placeholder left in the skeleton where a tensor was."""

    key: str


@dataclasses.dataclass(frozen=True)
class ShardRef(TensorRef):
    """Placeholder for a `Shard`: where this rank's piece sits in the global tensor."""

    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()


@dataclasses.dataclass
class Shard:
    """This rank's piece of a tensor sharded across ranks (TP, ZeRO...).

    On disk the pieces of all ranks form one global tensor (a DCP chunk each), so a
    checkpoint loads at another sharding: restoring at the saving layout gives each rank its
    own piece back; at another world size `local` is the whole global tensor (offsets 0)
    and the trainer slices what it now owns.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int


@dataclasses.dataclass
class SnapshotMeta:
    step: int
    seq: int
    rank: int
    world_size: int
    skeleton: Any  # the state with every tensor replaced by a TensorRef (ShardRef)
    specs: list[TensorSpec]
    incarnation: str = ""  # same on every rank of one (re)start: parts of a step must match


def flatten_state(state: Any, rank: int) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Split `state` into a picklable skeleton and a list of (key, tensor).

    Keys are '/'-joined paths. Everything under a top-level "rank_local" entry is
    per-rank (RNG states, data position) and gets the prefix `__rank<r>__/`, so that
    ranks' copies stay apart in a global checkpoint; other tensors are taken to be
    replicated across ranks and are stored once, except `Shard`s, whose pieces are stored
    as chunks of one global tensor.
    """
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append((path, obj.detach()))
            return TensorRef(path)
        if isinstance(obj, Shard):
            tensors.append((path, obj.local.detach()))
            return ShardRef(path, tuple(obj.global_shape), tuple(obj.offsets))
        if isinstance(obj, dict):
            return type(obj)((k, walk(v, f"{path}/{k}")) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(walk(v, f"{path}/{i}") for i, v in enumerate(obj))
        return obj

    skeleton = {}
    for k, v in state.items():
        prefix = f"__rank{rank}__/{k}" if k == "rank_local" else str(k)
        skeleton[k] = walk(v, prefix)
    return skeleton, tensors


def unflatten_state(skeleton: Any, tensors: dict[str, Any]) -> Any:
    def walk(obj: Any) -> Any:
        if isinstance(obj, ShardRef):
            t = tensors[obj.key]
            return t if isinstance(t, Shard) else Shard(t, obj.global_shape, obj.offsets)
        if isinstance(obj, TensorRef):
            return tensors[obj.key]
        if isinstance(obj, dict):
            return type(obj)((k, walk(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(skeleton)


class ShmSlot:
    """One mapped slot file. Not thread-safe: one owner per object."""

    def __init__(self, path: str, *, create: bool):
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o600)
        self.mm: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None  # uint8 view of the whole mapping
        self._pinned_ptr = 0
        self.locked = False
        size = os.fstat(self.fd).st_size
        if size < HEADER_SIZE:
            if not create:
                os.close(self.fd)
                raise FileNotFoundError(f"{path}: not an initialised slot")
            self._resize(HEADER_SIZE)
            self.set(magic=MAGIC, version=VERSION, state=EMPTY)
        else:
            self._map(size)

    # -- mapping -----------------------------------------------------------------------
    def _map(self, size: int, *, populate: bool = False) -> None:
        self._unmap()
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self.mm = mmap.mmap(self.fd, size, flags=flags)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)

    def _unmap(self) -> None:
        if self._pinned_ptr:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = 0
        # Drop references rather than mm.close(): tensors made by torch.frombuffer keep the
        # mmap object alive, so the pages stay mapped until the last view is gone.
        self.buf = None
        self.mm = None

    def _resize(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        os.posix_fallocate(self.fd, 0, size)  # ENOSPC now rather than SIGBUS mid-copy
        self._map(size, populate=True)  # the writer touches every page anyway: fault them now

    @property
    def size(self) -> int:
        return len(self.mm) if self.mm is not None else 0

    def refresh(self) -> None:
        """Remap if another process grew the file."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self._map(size)

    def pin(self) -> None:
        """Page-lock the mapping so device-to-host copies run at full speed (GPU only)."""
        if self._pinned_ptr or not torch.cuda.is_available():
            return
        ptr = self.buf.data_ptr()
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0))
            self._pinned_ptr = ptr
        except RuntimeError:  # still correct, only slower (pageable copies)
            pass

    # -- header --------------------------------------------------------------------------
    def get(self, name: str) -> Any:
        off, fmt = _OFFSET[name]
        return struct.unpack_from(fmt, self.mm, off)[0]

    def set(self, **fields: Any) -> None:
        for name, value in fields.items():
            off, fmt = _OFFSET[name]
            struct.pack_into(fmt, self.mm, off, value)

    def header(self) -> dict[str, Any]:
        return {name: self.get(name) for name, _ in _FIELDS}

    # -- lock ----------------------------------------------------------------------------
    def try_lock(self, *, shared: bool = False, blocking: bool = False) -> bool:
        """Writers take the lock exclusive, readers shared; False when it is taken."""
        op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(self.fd, op)
        except BlockingIOError:
            return False
        self.locked = True
        return True

    def unlock(self) -> None:
        if self.locked:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.locked = False

    def close(self) -> None:
        self.unlock()
        self._unmap()
        os.close(self.fd)

    # -- snapshots -----------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Grow the file to hold `nbytes` (plus 1/16 slack), keeping its contents."""
        if nbytes > self.size:
            self._resize(_align(nbytes + nbytes // 16, 1 << 20))

    def write(self, meta: SnapshotMeta, tensors: list[torch.Tensor], *, persist: bool,
              owner_pid: int) -> int:
        """Copy a snapshot in (caller holds the lock). Returns the bytes copied."""
        meta_bytes = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        data_off = _align(HEADER_SIZE + len(meta_bytes), 4096)
        data_len = meta.specs[-1].offset + meta.specs[-1].nbytes if meta.specs else 0
        self.set(state=WRITING)
        self.reserve(data_off + data_len)
        on_device = any(t.device.type != "cpu" for t in tensors)
        if on_device:
            self.pin()
        self.mm[HEADER_SIZE:HEADER_SIZE + len(meta_bytes)] = meta_bytes
        for spec, t in zip(meta.specs, tensors, strict=True):
            if spec.nbytes == 0:
                continue
            start = data_off + spec.offset
            dst = self.buf[start:start + spec.nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=on_device)
        if on_device:
            torch.cuda.synchronize()
        self.set(seq=meta.seq, step=meta.step, persist_req=int(persist), owner_pid=owner_pid,
                 meta_off=HEADER_SIZE, meta_len=len(meta_bytes),
                 meta_crc=zlib.crc32(meta_bytes), data_off=data_off, data_len=data_len,
                 rank=meta.rank, world_size=meta.world_size)
        self.set(state=COMPLETE)  # last: the snapshot exists only from here on
        return data_len

    def read_meta(self) -> tuple[SnapshotMeta | None, str]:
        """The snapshot's metadata if the slot holds a complete one, else (None, reason)."""
        self.refresh()
        h = self.header()
        if h["magic"] != MAGIC or h["version"] != VERSION:
            return None, "bad magic"
        if h["state"] != COMPLETE:
            return None, {EMPTY: "empty", WRITING: "half-written (writing flag set)"}.get(
                h["state"], f"state {h['state']}")
        end = h["meta_off"] + h["meta_len"]
        if end > self.size or h["data_off"] + h["data_len"] > self.size:
            return None, "truncated"
        raw = bytes(self.mm[h["meta_off"]:end])
        if zlib.crc32(raw) != h["meta_crc"]:
            return None, "metadata checksum mismatch"
        meta = pickle.loads(raw)
        if meta.seq != h["seq"] or meta.step != h["step"]:
            return None, "header and metadata disagree"
        return meta, "ok"

    def tensor_views(self, meta: SnapshotMeta) -> dict[str, torch.Tensor]:
        """Zero-copy views of the snapshot's tensors (valid while the slot stays mapped).

        Each view gets a storage of exactly its own bytes (torch.frombuffer with an offset),
        not a slice of one big storage: DCP clones any tensor whose storage is larger than
        itself, which would copy the whole snapshot once more on every persist.
        """
        data_off = self.get("data_off")
        out = {}
        for spec in meta.specs:
            numel = spec.nbytes // spec.dtype.itemsize if spec.nbytes else 0
            if numel == 0:
                out[spec.key] = torch.empty(spec.shape, dtype=spec.dtype)
                continue
            flat = torch.frombuffer(self.mm, dtype=spec.dtype, count=numel,
                                    offset=data_off + spec.offset)
            out[spec.key] = flat.view(spec.shape)
        return out


def layout(tensors: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    specs, off = [], 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(key, t.dtype, tuple(t.shape), off, nbytes))
        off = _align(off + nbytes)
    return specs


def list_segments(run_id: str, shm_dir: str = SHM_DIR) -> list[str]:
    prefix = segment_prefix(run_id)
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(shm_dir, n) for n in names if n.startswith(prefix))


def unlink_segments(run_id: str, shm_dir: str = SHM_DIR) -> int:
    """Remove every file of the run from shm_dir (slots, lock). Returns how many."""
    n = 0
    for path in list_segments(run_id, shm_dir):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def close_departed_ranks(run_id: str, world_size: int, shm_dir: str = SHM_DIR) -> None:
    """Mark closed this node's slots of ranks beyond `world_size` (a job that went on with
    fewer processes after a restart): nobody will close them, and the saver would keep the
    run's memory for its linger time waiting for them."""
    for path in list_segments(run_id, shm_dir):
        match = re.search(r"-r(\d+)-s\d+$", path)
        if match is None or int(match.group(1)) < world_size:
            continue
        try:
            slot = ShmSlot(path, create=False)
        except OSError:  # gone meanwhile
            continue
        slot.set(closed=1)
        slot.close()


def newest_common_step(rows: list[list[int]]) -> int:
    """The newest step every rank holds (rows: each rank's steps, -1 = empty), or -1.

    A rank killed between the gradient all_reduce and its save is one snapshot behind the
    others; with two slots per rank the step before is still held by everyone.
    """
    common = set.intersection(*[{s for s in row if s >= 0} for row in rows])
    return max(common) if common else -1
