"""On-disk layout of flash checkpoints: `torch.distributed.checkpoint` (DCP) format.

    <dir>/step_000000120/
        rank_0/__0_0.distcp  rank_0/.metadata  rank_0/manifest.json   (one per saving rank)
        rank_1/...
        mxgraph.json                                                  (step, world size)
        .metadata                                                     (global; renamed last)

Each rank's part is written on its own (`dcp.save(no_dist=True)`) from the shared-memory
snapshot, then `manifest.json` (crc32 and size of each file) is renamed into place. When
every rank's manifest exists, the committer merges the parts' metadata into one global
DCP `.metadata` (tensors replicated across ranks are kept once) and renames it into place:
that rename is the commit. `dcp.load(state, checkpoint_id=<step dir>)` then reads it at
any world size.

Keys are '/'-joined state paths; rank-local entries live under `__rank<r>__/` and each
rank's skeleton (the state with tensors replaced by `TensorRef`) is the BytesIO entry
`__rank<r>__/__snapshot__`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
import warnings
import zlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from mxgraph.runtime.checkpoint.copies import copy_into
from mxgraph.runtime.checkpoint.shm import Shard, ShardRef, SnapshotMeta, TensorRef, unflatten_state

logger = logging.getLogger("mxgraph.checkpoint")

METADATA = ".metadata"
MANIFEST = "manifest.json"
INFO = "mxgraph.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:09d}")


def snapshot_key(rank: int) -> str:
    return f"__rank{rank}__/__snapshot__"


def list_steps(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every step folder, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = [(int(m.group(1)), os.path.join(directory, n)) for n in names
           if (m := _STEP_RE.match(n)) and os.path.isdir(os.path.join(directory, n))]
    return sorted(out, reverse=True)


def is_committed(path: str) -> bool:
    return os.path.exists(os.path.join(path, METADATA))


def file_crc32(path: str, chunk: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _write_atomic(path: str, data: bytes, fsync: bool) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():  # "torch.distributed is disabled..." on every no_dist call
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


def collect_refs(skeleton: Any) -> list[TensorRef]:
    """Every TensorRef (and ShardRef) in a skeleton, in order."""
    refs: list[TensorRef] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, TensorRef):
            refs.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(skeleton)
    return refs


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def persist_rank(directory: str, meta: SnapshotMeta, tensors: dict[str, torch.Tensor], *,
                 fsync: bool = True) -> str:
    """Write one rank's part of step `meta.step`; returns its folder.

    Idempotent for the same incarnation. A part of the same step left by another
    incarnation (a lost attempt, before a restart) is replaced, and the step is un-committed
    first, so a committed checkpoint never mixes parts of two attempts.
    """
    sdir = step_dir(directory, meta.step)
    part = os.path.join(sdir, f"rank_{meta.rank}")
    old = _read_json(os.path.join(part, MANIFEST))
    if old is not None and old.get("incarnation") == meta.incarnation:
        return part
    if is_committed(sdir):
        info = _read_json(os.path.join(sdir, INFO)) or {}
        if info.get("incarnation") == meta.incarnation:
            return part
        logger.warning("replacing checkpoint %s of an earlier attempt", sdir)
        os.unlink(os.path.join(sdir, METADATA))
    if os.path.isdir(part):
        shutil.rmtree(part)  # half-written, or from another incarnation
    os.makedirs(part)
    record = {"step": meta.step, "rank": meta.rank, "world_size": meta.world_size,
              "skeleton": meta.skeleton}
    flat: dict[str, Any] = dict(tensors)
    flat[snapshot_key(meta.rank)] = io.BytesIO(pickle.dumps(record, pickle.HIGHEST_PROTOCOL))
    _quiet(dcp.save, flat, storage_writer=FileSystemWriter(part, sync_files=fsync), no_dist=True)
    files = {name: {"crc32": file_crc32(os.path.join(part, name)),
                    "size": os.path.getsize(os.path.join(part, name))}
             for name in sorted(os.listdir(part)) if not name.endswith(".tmp")}
    shards = {r.key: {"global_shape": list(r.global_shape), "offsets": list(r.offsets)}
              for r in collect_refs(meta.skeleton) if isinstance(r, ShardRef)}
    manifest = {"step": meta.step, "rank": meta.rank, "world_size": meta.world_size,
                "incarnation": meta.incarnation, "shards": shards, "files": files}
    _write_atomic(os.path.join(part, MANIFEST), json.dumps(manifest).encode(), fsync)
    return part


def read_manifests(path: str) -> dict[int, dict]:
    out = {}
    for name in os.listdir(path):
        mpath = os.path.join(path, name, MANIFEST)
        if name.startswith("rank_") and os.path.exists(mpath):
            with open(mpath) as f:
                m = json.load(f)
            out[m["rank"]] = m
    return out


def try_commit(path: str, *, fsync: bool = True) -> bool:
    """Merge the ranks' parts into a global DCP checkpoint if all are there. Idempotent."""
    if is_committed(path):
        return True
    manifests = read_manifests(path)
    if not manifests:
        return False
    world_size = next(iter(manifests.values()))["world_size"]
    if sorted(manifests) != list(range(world_size)):
        return False
    if len({m.get("incarnation") for m in manifests.values()}) != 1:
        return False  # some parts are from a lost attempt; wait for them to be replaced
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    owner: dict[str, int] = {}  # replicated tensors and objects: the first rank's copy
    chunk_owner: dict[tuple[str, tuple[int, ...]], int] = {}  # shards: first rank per chunk
    for rank in range(world_size):
        md = FileSystemReader(os.path.join(path, f"rank_{rank}")).read_metadata()
        shards = manifests[rank].get("shards", {})
        for fqn, smd in md.state_dict_metadata.items():
            if fqn in shards:
                _merge_chunk(merged, chunk_owner, fqn, smd, shards[fqn], rank)
            elif fqn in merged.state_dict_metadata:
                old = merged.state_dict_metadata[fqn]
                if isinstance(smd, TensorStorageMetadata) and old.size != smd.size:
                    raise ValueError(f"{path}: '{fqn}' has size {tuple(smd.size)} on rank "
                                     f"{rank} but {tuple(old.size)} on rank {owner[fqn]}")
                continue
            else:
                merged.state_dict_metadata[fqn] = smd
                owner[fqn] = rank
            if isinstance(md.planner_data, dict) and fqn in md.planner_data:
                merged.planner_data.setdefault(fqn, md.planner_data[fqn])
        for index, info in md.storage_data.items():
            if index.fqn in shards:
                offsets = tuple(shards[index.fqn]["offsets"])
                if chunk_owner.get((index.fqn, offsets)) != rank:
                    continue
                index = MetadataIndex(index.fqn, torch.Size(offsets), index.index)
            elif owner.get(index.fqn) != rank:
                continue
            info.relative_path = f"rank_{rank}/{info.relative_path}"
            merged.storage_data[index] = info
    info = {"step": manifests[0]["step"], "world_size": world_size, "format": "mxgraph-dcp-1",
            "incarnation": manifests[0].get("incarnation")}
    _write_atomic(os.path.join(path, INFO), json.dumps(info).encode(), fsync)
    _write_atomic(os.path.join(path, METADATA), pickle.dumps(merged), fsync)  # the commit
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return True


def _merge_chunk(merged: Metadata, chunk_owner: dict, fqn: str, smd: TensorStorageMetadata,
                 shard: dict, rank: int) -> None:
    """Add rank's piece of a sharded tensor as a chunk of the global tensor."""
    offsets = tuple(shard["offsets"])
    if (fqn, offsets) in chunk_owner:
        return  # the same piece saved by another rank (e.g. replicated across DP)
    chunk_owner[(fqn, offsets)] = rank
    glob = merged.state_dict_metadata.get(fqn)
    if glob is None:
        glob = merged.state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=smd.properties, size=torch.Size(shard["global_shape"]), chunks=[])
    glob.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets),
                                            sizes=smd.chunks[0].sizes))


def prune(directory: str, keep: int) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep`, and uncommitted folders older
    than the newest committed one. Nothing newer than the newest commit is touched."""
    removed = []
    steps = list_steps(directory)
    committed = [(s, p) for s, p in steps if is_committed(p)]
    if not committed:
        return removed
    newest_step = committed[0][0]
    doomed = [p for _, p in committed[max(keep, 1):]]
    doomed += [p for s, p in steps if s < newest_step and not is_committed(p)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def verify(path: str, *, ranks: list[int] | None = None) -> str | None:
    """None when the checkpoint at `path` is committed and intact, else the reason.

    `ranks` limits the checksum pass to those saving ranks' files (so that restoring
    ranks can share the reading); None checks every file.
    """
    if not is_committed(path):
        return "incomplete: no .metadata (never committed)"
    try:
        with open(os.path.join(path, INFO)) as f:
            world_size = json.load(f)["world_size"]
        FileSystemReader(path).read_metadata()
        manifests = read_manifests(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file means a bad checkpoint
        return f"unreadable metadata: {e!r}"
    if sorted(manifests) != list(range(world_size)):
        return f"manifests for ranks {sorted(manifests)}, expected {world_size}"
    for rank in range(world_size) if ranks is None else ranks:
        for name, rec in manifests[rank]["files"].items():
            fpath = os.path.join(path, f"rank_{rank}", name)
            if not os.path.exists(fpath):
                return f"missing file {fpath}"
            if os.path.getsize(fpath) != rec["size"]:
                return f"size mismatch in {fpath}"
            if file_crc32(fpath) != rec["crc32"]:
                return f"checksum mismatch in {fpath}"
    return None


def saved_world_size(path: str) -> int:
    with open(os.path.join(path, INFO)) as f:
        return json.load(f)["world_size"]


def load(path: str, *, source_rank: int, same_layout: bool = True,
         targets: dict[str, torch.Tensor] | None = None) -> Any:
    """Load saving rank `source_rank`'s state (its skeleton, every tensor it refers to).

    targets: key -> tensor to load into in place when shape and dtype match (else a new
    CPU tensor is made). Rank-local keys of `source_rank` are read under this process's
    names, so a template captured on any rank fits. Sharded tensors are read whole; with
    `same_layout` each `Shard` gets back the saving rank's piece, else the whole tensor.
    """
    record, md = _record(path, source_rank)
    refs = collect_refs(record["skeleton"])
    targets = targets or {}
    local = f"__rank{source_rank}__/"
    tensors: dict[str, Any] = {}
    for ref in refs:
        k = ref.key
        smd = md.state_dict_metadata[k]
        size, dtype = tuple(smd.size), smd.properties.dtype
        t = targets.get(k)
        if t is None and k.startswith(local):  # rank-local entry saved by another rank
            t = next((v for name, v in targets.items()
                      if name.endswith("__/" + k[len(local):]) and name.startswith("__rank")),
                     None)
        ok = t is not None and tuple(t.shape) == size and t.dtype == dtype
        tensors[k] = t if ok else torch.empty(size, dtype=dtype)
    if tensors:
        _quiet(dcp.load, dict(tensors), checkpoint_id=path, no_dist=True)
    for ref in refs:
        if isinstance(ref, ShardRef):
            tensors[ref.key] = _shard_of(tensors[ref.key], ref, md, targets.get(ref.key),
                                         same_layout)
    return unflatten_state(record["skeleton"], tensors)


def _record(path: str, source_rank: int) -> tuple[dict, Metadata]:
    """Saving rank `source_rank`'s record (its skeleton) and the checkpoint's metadata."""
    key = snapshot_key(source_rank)
    template: dict[str, Any] = {key: io.BytesIO()}
    _quiet(dcp.load, template, checkpoint_id=path, no_dist=True)
    buf = template[key]
    buf.seek(0)
    return pickle.loads(buf.read()), FileSystemReader(path).read_metadata()


def saved_signature(path: str, *, source_rank: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """key -> (shape, dtype) of what saving rank `source_rank` refers to, read from the
    metadata only (no tensor is loaded). A shard's entry is None: its saved shape is the
    global tensor's, not a rank's piece."""
    record, md = _record(path, source_rank)
    out = {}
    for ref in collect_refs(record["skeleton"]):
        smd = md.state_dict_metadata[ref.key]
        out[ref.key] = None if isinstance(ref, ShardRef) else (tuple(smd.size), smd.properties.dtype)
    return out


def _shard_of(whole: torch.Tensor, ref: ShardRef, md: Metadata, target: torch.Tensor | None,
              same_layout: bool) -> Shard:
    if not same_layout:
        return Shard(whole, ref.global_shape, tuple(0 for _ in ref.global_shape))
    sizes = next(c.sizes for c in md.state_dict_metadata[ref.key].chunks
                 if tuple(c.offsets) == ref.offsets)
    piece = whole
    for dim, (off, n) in enumerate(zip(ref.offsets, sizes, strict=True)):
        piece = piece.narrow(dim, off, n)
    return Shard(copy_into(target, piece), ref.global_shape, ref.offsets)
