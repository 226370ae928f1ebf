"""Flash checkpoint: save to host shared memory in the step, persist to disk behind it.

    ckpt = FlashCheckpointer(dir, run_id=default_run_id(), rank=rank, world_size=world,
                             keep=2, persist_every=100)
    r = ckpt.restore(into=capture_training_state(model, opt, sched))
    start = apply_training_state(r.state, model, opt, sched) if r else 0  # data position
    for step in range(start, num_steps):
        ...  # train one step
        ckpt.save(step + 1, capture_training_state(model, opt, sched, step + 1, plan_dict))
    ckpt.close()

Under `torchrun --max-restarts`, create the process group with
`init_restartable_process_group` (see checkpoint/state.py for why).

`save` blocks only for the copy into a reused /dev/shm slot (see checkpoint/shm.py); the node's saver
process (checkpoint/saver.py) writes the slot to disk in DCP format (checkpoint/disk.py) and commits
it. Two slots per rank: the newest complete snapshot is never overwritten, so a rank killed
mid-copy still leaves one. On restart every rank offers the steps it holds in memory; the
newest step held by all is restored from memory, else the newest committed disk checkpoint
whose checksums pass (skipped ones are logged with their path and reason).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import subprocess
import threading
import time
import uuid
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.checkpoint import saver as saver_mod
from mxgraph.runtime.checkpoint.copies import BackgroundCopy, copy_into
from mxgraph.runtime.checkpoint.match import first_mismatch, mismatch_error, normalized, signature_of
from mxgraph.runtime.checkpoint.shm import (
    COMPLETE,
    EMPTY,
    HEADER_SIZE,
    SHM_DIR,
    Shard,
    ShmSlot,
    SnapshotMeta,
    close_departed_ranks,
    flatten_state,
    layout,
    list_segments,
    newest_common_step,
    slot_path,
    unflatten_state,
)
from mxgraph.runtime.checkpoint.state import (
    apply_rng,
    apply_training_state,
    capture_rng,
    capture_training_state,
    init_restartable_process_group,
)

logger = logging.getLogger("mxgraph.checkpoint")

__all__ = ["FlashCheckpointer", "RestoreInfo", "Restored", "SaveResult", "Shard", "apply_rng",
           "apply_training_state", "capture_rng", "capture_training_state", "default_run_id",
           "init_restartable_process_group"]


@dataclasses.dataclass(frozen=True)
class SaveResult:
    status: str  # "copied" | "skipped" (no free slot: older snapshots still persisting) | "failed"
    step: int
    blocking_s: float  # time save() held the caller
    nbytes: int = 0
    persist: bool = False  # a disk write was requested for this snapshot
    reason: str = ""


class Restored(NamedTuple):
    step: int
    state: Any
    source: str  # "memory" | "disk"


@dataclasses.dataclass
class RestoreInfo:
    source: str | None = None
    step: int | None = None
    path: str | None = None  # the slot file or the step folder loaded
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, reason)
    resharded: bool = False  # saved at another world size; rank-local state is borrowed
    seconds: float = 0.0


def default_run_id() -> str:
    """torchrun's run id (stable across --max-restarts), else MXGRAPH_RUN_ID."""
    run_id = os.environ.get("MXGRAPH_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        raise ValueError("no run id: pass run_id=..., set MXGRAPH_RUN_ID or torchrun --rdzv-id")
    return run_id


class FlashCheckpointer:
    """In-memory snapshots every save, disk checkpoints every `persist_every` steps.

    A memory-only save finding no free slot (both hold snapshots still being written to
    disk) is skipped at once; a save that asks for a disk write waits up to
    `persist_wait_s` for one first, so that every rank persists the same steps.

    saver: "process" (crash-safe: a detached per-node saver, started by local rank 0),
    "thread" (a persister thread in this process), or "none" (memory only).
    Construction, `restore` and `close` are collective over `group` when world_size > 1.
    """

    def __init__(self, directory: str, *, run_id: str, rank: int = 0, world_size: int = 1,
                 keep: int = 2, local_rank: int | None = None, group: Any = None,
                 num_slots: int = 2, persist_every: int = 1, saver: str = "process",
                 persist_wait_s: float = 60.0, fsync: bool = True, linger_s: float = 120.0,
                 shm_dir: str = SHM_DIR):
        if saver not in ("process", "thread", "none"):
            raise ValueError(f"saver must be 'process', 'thread' or 'none', not {saver!r}")
        self.directory, self.run_id = os.path.abspath(directory), run_id
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None \
            else local_rank
        self.group, self.persist_every, self.saver = group, persist_every, saver
        self.fsync, self.linger_s, self.shm_dir = fsync, linger_s, shm_dir
        self.persist_wait_s = persist_wait_s
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.restore_info = RestoreInfo()
        self._closed = False
        self._saver_proc = None  # the saver this process started, if any
        self._copy: BackgroundCopy | None = None  # a background save's copy in flight
        self._last_saver_check = time.monotonic()
        os.makedirs(self.directory, exist_ok=True)

        if saver == "process" and self.local_rank == 0:
            self._ensure_saver()
        # One id per (re)start, agreed by all ranks: a step re-saved after a restart replaces
        # the parts the lost attempt wrote instead of mixing with them.
        box = [uuid.uuid4().hex[:12]]
        if self.distributed:
            dist.barrier(group=group)  # every rank opens its slots once the saver is started
            dist.broadcast_object_list(box, src=0, group=group)
        self.incarnation = box[0]
        self.slots = [ShmSlot(slot_path(run_id, rank, i, shm_dir), create=True)
                      for i in range(num_slots)]
        for s in self.slots:
            s.set(owner_pid=os.getpid(), closed=0)
        self.seq = max(s.get("seq") for s in self.slots) + 1

        self._loop = self._thread = None
        if saver == "thread":
            self._loop = saver_mod.SaverLoop(run_id=run_id, directory=self.directory, keep=keep,
                                             ranks={rank}, shm_dir=shm_dir, fsync=fsync,
                                             owns_segments=False, poll_s=0.5)
            self._thread = threading.Thread(target=self._loop.run, daemon=True,
                                            name=f"mxgraph-persist-r{rank}")
            self._thread.start()
        if saver != "process":
            atexit.register(self._unlink_own)

    @classmethod
    def from_env(cls, directory: str, **kwargs: Any) -> "FlashCheckpointer":
        """Rank, world size, local rank and run id from torchrun's environment."""
        if "run_id" not in kwargs:
            kwargs["run_id"] = default_run_id()
        kwargs.setdefault("rank", int(os.environ.get("RANK", "0")))
        kwargs.setdefault("world_size", int(os.environ.get("WORLD_SIZE", "1")))
        kwargs.setdefault("local_rank", int(os.environ.get("LOCAL_RANK", kwargs["rank"])))
        return cls(directory, **kwargs)

    # -- saver process ------------------------------------------------------------------
    def _ensure_saver(self) -> None:
        """Start the node's saver unless one runs. A new saver adopts the snapshots a dead
        one left in shared memory: they are intact (a slot counts only once its writer
        marked it complete), so a restart can still restore them from memory."""
        if saver_mod.saver_pid(self.run_id, self.shm_dir) is not None:
            return
        stale = [p for p in list_segments(self.run_id, self.shm_dir) if not p.endswith(".lock")]
        if stale:
            logger.warning("flash checkpoint: the saver of run %s is gone; a new one adopts the "
                           "%d shared-memory slot(s) it left", self.run_id, len(stale))
        log = os.path.join(self.directory, f"saver-{os.uname().nodename}.log")
        self._saver_proc = saver_mod.start_saver(
            run_id=self.run_id, directory=self.directory, keep=self.keep, fsync=self.fsync,
            linger_s=self.linger_s, shm_dir=self.shm_dir, log_path=log)

    def _check_saver(self) -> None:
        """Local rank 0 (the one that starts it) restarts the node's saver if it died; a
        saver it started that is still importing (no lock yet) counts as alive."""
        now = time.monotonic()
        if self.saver != "process" or self.local_rank != 0 or \
                now - self._last_saver_check < 5.0:
            return
        self._last_saver_check = now
        starting = self._saver_proc is not None and self._saver_proc.poll() is None
        if not starting and saver_mod.saver_pid(self.run_id, self.shm_dir) is None:
            logger.warning("flash checkpoint: the node's saver is gone; restarting it")
            self._ensure_saver()

    # -- save ---------------------------------------------------------------------------
    def _pending_persist(self, s: ShmSlot) -> bool:
        return s.get("state") == COMPLETE and bool(s.get("persist_req")) and \
            s.get("persisted_seq") < s.get("seq")

    def _newest(self) -> ShmSlot | None:
        done = [s for s in self.slots if s.get("state") == COMPLETE]
        return max(done, key=lambda s: s.get("seq")) if done else None

    def reserve(self, state: dict) -> float:
        """Allocate and fault in every slot for a state like `state` (before training starts,
        so that the first save is not the slow one). Returns the seconds it took."""
        t0 = time.perf_counter()
        _, tensors = flatten_state(state, self.rank)
        specs = layout(tensors)
        nbytes = specs[-1].offset + specs[-1].nbytes if specs else 0
        for s in self.slots:
            s.try_lock(blocking=True)
            try:  # metadata size is not known yet: leave 1 MiB for it
                s.reserve(HEADER_SIZE + (1 << 20) + nbytes)
            finally:
                s.unlock()
        return time.perf_counter() - t0

    def _free_slot(self) -> ShmSlot | None:
        """A slot to write, locked: never the newest snapshot, never one awaiting disk."""
        newest = self._newest()
        for s in sorted(self.slots, key=lambda s: (s.get("state") == COMPLETE, s.get("seq"))):
            if (s is newest and len(self.slots) > 1) or self._pending_persist(s):
                continue
            if s.try_lock():
                return s
        return None

    def save(self, step: int, state: dict, *, persist: bool | None = None,
             background: bool = False) -> SaveResult:
        """Copy `state` into shared memory; returns once the copy is done, or with
        `background=True` once it has started (status "copying"): then call
        `wait_copied()` before changing any tensor of `state` (the optimizer step)."""
        t0 = time.perf_counter()
        self.wait_copied()
        if persist is None:
            persist = step % self.persist_every == 0
        persist = persist and self.saver != "none"
        self._check_saver()
        deadline = t0 + (self.persist_wait_s if persist else 0.0)
        while (slot := self._free_slot()) is None and time.perf_counter() < deadline:
            time.sleep(0.002)
        if slot is None:
            return SaveResult("skipped", step, time.perf_counter() - t0, persist=persist,
                              reason="every free slot is still being persisted")
        try:
            skeleton, tensors = flatten_state(state, self.rank)
            meta = SnapshotMeta(step, self.seq, self.rank, self.world_size, skeleton,
                                layout(tensors), self.incarnation)
            self.seq += 1
            wake = self._loop.wake.set if persist and self._loop is not None else None
            if background:  # the copy's thread unlocks the slot
                self._copy, slot = BackgroundCopy(slot, meta, [t for _, t in tensors],
                                                  persist=persist, on_done=wake), None
                return SaveResult("copying", step, time.perf_counter() - t0,
                                  sum(s.nbytes for s in meta.specs), persist)
            nbytes = slot.write(meta, [t for _, t in tensors], persist=persist,
                                owner_pid=os.getpid())
            if wake is not None:
                wake()  # the persister thread sleeps otherwise (GIL)
            return SaveResult("copied", step, time.perf_counter() - t0, nbytes, persist)
        except Exception as e:  # noqa: BLE001 - a failed snapshot must not kill training
            logger.exception("flash checkpoint: save of step %d failed", step)
            return SaveResult("failed", step, time.perf_counter() - t0, reason=repr(e))
        finally:
            if slot is not None:
                slot.unlock()

    def wait_copied(self) -> float:
        """Block until a background save's copy is done (nothing to do without one);
        returns the seconds waited."""
        copy, self._copy = self._copy, None
        return copy.wait() if copy is not None else 0.0

    # -- restore ------------------------------------------------------------------------
    def _memory_steps(self) -> list[tuple[int, int, ShmSlot]]:
        out = []
        for s in self.slots:
            meta, _ = s.read_meta()
            # at another world size the ranks' parts differ: only disk reshards them
            if meta is not None and meta.rank == self.rank and meta.world_size == self.world_size:
                out.append((meta.step, meta.seq, s))
        return sorted(out, key=lambda x: (x[0], x[1]), reverse=True)

    def _agree_all(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)], device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _device(self) -> torch.device:
        if self.distributed and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _common_memory_step(self, mine: list[tuple[int, int, ShmSlot]]) -> int:
        steps = sorted({m[0] for m in mine}, reverse=True)
        row = torch.full((len(self.slots),), -1, dtype=torch.int64)
        row[:len(steps)] = torch.tensor(steps[:len(self.slots)], dtype=torch.int64)
        if not self.distributed:
            return int(row.max())
        rows = [torch.empty_like(row, device=self._device()) for _ in range(self.world_size)]
        dist.all_gather(rows, row.to(self._device()), group=self.group)
        return newest_common_step([r.cpu().tolist() for r in rows])

    def _targets(self, into: dict | None) -> dict[str, torch.Tensor]:
        if into is None:
            return {}
        return dict(flatten_state(into, self.rank)[1])

    def _read_memory(self, slot: ShmSlot, targets: dict[str, torch.Tensor]) \
            -> tuple[int, Any] | None:
        slot.try_lock(shared=True, blocking=True)  # waits for a flush by the saver
        try:
            meta, reason = slot.read_meta()
            if meta is None:
                logger.warning("flash checkpoint: memory snapshot %s unusable: %s", slot.path,
                               reason)
                return None
            views = slot.tensor_views(meta)
            tensors = {k: copy_into(targets.get(k), v) for k, v in views.items()}
            del views
            return meta.step, unflatten_state(meta.skeleton, tensors)
        finally:
            slot.unlock()

    def restore(self, into: dict | None = None) -> Restored | None:
        """Newest state every rank can restore: memory if all hold it, else disk.

        into: optionally a state of the same structure whose tensors (same key, shape and
        dtype) receive the data in place, e.g. `capture_training_state(model, opt, ...)`:
        the live parameters are filled directly (and on a GPU straight from shared memory),
        without allocating a host copy of the state first.
        """
        self.wait_copied()
        t0 = time.perf_counter()
        targets = self._targets(into)
        info = self.restore_info = RestoreInfo()
        mine = self._memory_steps()
        common = self._common_memory_step(mine)
        got = None
        if common >= 0:
            slot = next(s for step, _, s in mine if step == common)
            meta, _ = slot.read_meta()
            self._check_fits(f"the in-memory snapshot of step {common}", targets, None if meta is None
                             else {s.key: (tuple(s.shape), s.dtype) for s in meta.specs})
            got = self._read_memory(slot, targets)
            if self._agree_all(got is not None):
                info.source, info.path = "memory", slot.path
            else:
                got = None
        if got is None:
            got = self._restore_disk(info, targets)
        if got is None:
            info.seconds = time.perf_counter() - t0
            return None
        step, state = got
        info.step, info.seconds = step, time.perf_counter() - t0
        self._invalidate_after(step)
        logger.debug("flash checkpoint: rank %d restored step %d from %s (%s) in %.3f s",
                    self.rank, step, info.source, info.path, info.seconds)
        return Restored(step, state, info.source)

    def _restore_disk(self, info: RestoreInfo, targets: dict[str, torch.Tensor]) \
            -> tuple[int, Any] | None:
        candidates = disk.list_steps(self.directory)
        if self.distributed:  # everyone walks rank 0's view of the folder
            box = [candidates]
            dist.broadcast_object_list(box, src=0, group=self.group)
            candidates = box[0]
        for step, path in candidates:
            reason = None
            if not disk.is_committed(path):
                reason = disk.verify(path)
            else:
                try:
                    saved = disk.saved_world_size(path)
                    share = [r for r in range(saved) if r % self.world_size == self.rank]
                    reason = disk.verify(path, ranks=share)
                except Exception as e:  # noqa: BLE001
                    reason = f"unreadable: {e!r}"
            bad = next((r for r in self._every_rank(reason) if r), None)
            if bad:
                logger.warning("flash checkpoint: skipping checkpoint %s: %s", path, bad)
                info.skipped.append((path, bad))
                continue
            saved = disk.saved_world_size(path)
            if targets:
                self._check_fits(f"checkpoint {path}", targets,
                                 disk.saved_signature(path, source_rank=self.rank % saved))
            info.source, info.path = "disk", path
            info.resharded = saved != self.world_size
            return step, disk.load(path, source_rank=self.rank % saved, targets=targets,
                                   same_layout=not info.resharded)
        if info.skipped:
            logger.warning("flash checkpoint: no usable checkpoint in %s", self.directory)
        return None

    def _every_rank(self, value: Any) -> list[Any]:
        """Every rank's `value`, by rank (collective; [value] alone on one process)."""
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def _check_fits(self, what: str, targets: dict[str, torch.Tensor], saved: dict | None) -> None:
        """CheckpointMismatchError on every rank when the snapshot `saved` (key -> (shape,
        dtype); None: unreadable, left to the reader) does not fit some rank's `targets`.
        Collective, so that no rank loads while another stops."""
        reason = None
        if targets and saved is not None:
            reason = first_mismatch(normalized(saved), signature_of(targets))
        bad = next(((r, text) for r, text in enumerate(self._every_rank(reason)) if text), None)
        if bad is not None:
            raise mismatch_error(what, f"rank {bad[0]}: {bad[1]}" if self.distributed else bad[1])

    def _invalidate_after(self, step: int) -> None:
        """Forget snapshots newer than the restored step (they belong to a lost future)."""
        for s in self.slots:
            if s.get("state") == COMPLETE and s.get("step") > step:
                s.try_lock(blocking=True)
                try:
                    s.set(state=EMPTY)
                finally:
                    s.unlock()

    # -- close --------------------------------------------------------------------------
    def wait_persisted(self, timeout_s: float = 300.0) -> bool:
        """Block until this rank's requested disk writes are done."""
        deadline = time.monotonic() + timeout_s
        while any(self._pending_persist(s) for s in self.slots):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, *, timeout_s: float = 300.0) -> None:
        """Finish pending disk writes, commit, release the segments. Collective."""
        if self._closed:
            return
        self._closed = True
        self.wait_copied()
        if self.saver != "none" and not self.wait_persisted(timeout_s):
            logger.warning("flash checkpoint: rank %d: persist still pending at close", self.rank)
        if self.distributed:
            dist.barrier(group=self.group)  # every rank's part is on disk
        if self._loop is not None:
            self._loop.stop.set()
            self._loop.wake.set()
            self._thread.join()
            if self.rank == 0:  # every part is on disk now: one pass commits them
                self._loop.commit_ready()
        if self.distributed and self.saver == "thread":
            dist.barrier(group=self.group)  # rank 0 committed
        for s in self.slots:
            s.set(closed=1)
        if self.local_rank == 0:
            close_departed_ranks(self.run_id, self.world_size, self.shm_dir)
        if self.saver == "process":
            if self.local_rank == 0:  # the saver commits, cleans up and exits
                deadline = time.monotonic() + timeout_s
                if self._saver_proc is not None:  # ours: it may not hold its lock yet
                    try:
                        self._saver_proc.wait(timeout_s)
                    except subprocess.TimeoutExpired:
                        logger.warning("flash checkpoint: the saver did not exit in %.0f s",
                                       timeout_s)
                while saver_mod.saver_pid(self.run_id, self.shm_dir) is not None and \
                        time.monotonic() < deadline:
                    time.sleep(0.01)
        for s in self.slots:
            s.close()
        if self.saver != "process":
            self._unlink_own()

    def _unlink_own(self) -> None:
        for i in range(len(getattr(self, "slots", []))):
            try:
                os.unlink(slot_path(self.run_id, self.rank, i, self.shm_dir))
            except FileNotFoundError:
                pass
