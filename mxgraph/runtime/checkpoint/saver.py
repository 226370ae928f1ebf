"""Per-node saver: persists shared-memory snapshots to disk and outlives the workers.

Started by local rank 0 as a detached process (`python -m mxgraph.runtime.checkpoint.saver ...`,
its own session, so torchrun's kill of the worker process group spares it). It talks to
the workers only through the slot files in /dev/shm (headers + flock) and the checkpoint
folder: no socket, no port. It holds an exclusive flock on `<prefix>saver.lock` for its
whole life, which is how workers tell whether it is alive.

What it does, polling every few milliseconds:
- a complete slot whose rank asked for it (`persist_req`) is written to disk (DCP part);
- a complete slot whose owner process died without closing is flushed to disk too
  (crash safety: the newest snapshot survives the worker);
- when every part of a step is on disk, the committer (the saver that sees rank 0) merges
  and commits it, then prunes to the newest `keep`;
- when every rank has closed (or every owner is dead for `linger_s`), it unlinks all of the
  run's segments and exits.

The same loop runs as a thread inside a worker when `saver="thread"` (no crash safety).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import subprocess
import sys
import threading
import time

from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.checkpoint.shm import COMPLETE, SHM_DIR, ShmSlot, list_segments, segment_prefix, unlink_segments

logger = logging.getLogger("mxgraph.checkpoint")


def lock_path(run_id: str, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{segment_prefix(run_id)}saver.lock")


def saver_pid(run_id: str, shm_dir: str = SHM_DIR) -> int | None:
    """Pid of the live saver of this run on this node, or None."""
    path = lock_path(run_id, shm_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: alive
            raw = os.pread(fd, 32, 0).decode().strip()
            return int(raw) if raw.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not reaped yet


def start_saver(*, run_id: str, directory: str, keep: int, fsync: bool, linger_s: float,
                shm_dir: str = SHM_DIR, log_path: str | None = None) -> subprocess.Popen:
    """Launch the node's saver, detached from the caller's session."""
    cmd = [sys.executable, "-m", "mxgraph.runtime.checkpoint.saver", "--run-id", run_id,
           "--directory", directory, "--keep", str(keep), "--linger-s", str(linger_s),
           "--shm-dir", shm_dir] + ([] if fsync else ["--no-fsync"])
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                            start_new_session=True, close_fds=True)


class SaverLoop:
    """The persist/flush/commit/cleanup loop; `ranks=None` manages every rank it finds."""

    def __init__(self, *, run_id: str, directory: str, keep: int, ranks: set[int] | None = None,
                 shm_dir: str = SHM_DIR, fsync: bool = True, poll_s: float = 0.01,
                 linger_s: float = 120.0, owns_segments: bool = True):
        self.run_id, self.directory, self.keep = run_id, directory, keep
        self.ranks, self.shm_dir, self.fsync = ranks, shm_dir, fsync
        self.poll_s, self.linger_s, self.owns_segments = poll_s, linger_s, owns_segments
        self.slots: dict[tuple[int, int], ShmSlot] = {}
        self.to_commit: set[str] = set()
        self.idle_since = time.monotonic()
        self.stop = threading.Event()
        self.wake = threading.Event()  # set by an in-process writer: no need to wait a poll
        self._next_discover = 0.0
        self.committer = False  # sees rank 0: commits and prunes for the whole job
        self._alive: dict[int, tuple[float, bool]] = {}  # pid -> (checked at, alive)
        self._re = re.compile(re.escape(segment_prefix(run_id)) + r"r(\d+)-s(\d+)$")
        self.persist_seconds = 0.0  # total, for benchmarks

    def _pid_alive(self, pid: int) -> bool:
        """pid_alive, cached for 0.2 s (it reads /proc, and is asked every poll)."""
        now = time.monotonic()
        at, alive = self._alive.get(pid, (-1.0, False))
        if now - at > 0.2:
            alive = pid_alive(pid)
            self._alive[pid] = (now, alive)
        return alive

    def discover(self) -> None:
        now = time.monotonic()
        if now < self._next_discover:
            return
        self._next_discover = now + (0.5 if self.slots else 0.05)
        for path in list_segments(self.run_id, self.shm_dir):
            m = self._re.search(os.path.basename(path))
            if not m:
                continue
            key = (int(m.group(1)), int(m.group(2)))
            if key in self.slots or (self.ranks is not None and key[0] not in self.ranks):
                continue
            try:
                self.slots[key] = ShmSlot(path, create=False)
                self.committer |= key[0] == 0
            except (FileNotFoundError, ValueError):
                pass  # being created right now: next poll

    def persist(self, slot: ShmSlot) -> bool:
        if not slot.try_lock(shared=True):
            return False  # the writer is copying into it
        try:
            meta, _ = slot.read_meta()
            if meta is None:
                return False
            seq = slot.get("seq")
            t0 = time.monotonic()
            try:
                views = slot.tensor_views(meta)
                disk.persist_rank(self.directory, meta, views, fsync=self.fsync)
                del views
                status = 0
            except Exception:  # noqa: BLE001 - report and go on; never retry forever
                logger.exception("saver: persisting rank %d step %d failed", meta.rank, meta.step)
                status = 1
            self.persist_seconds += time.monotonic() - t0
            slot.set(persisted_seq=seq, persist_status=status)
            if status == 0:
                self.to_commit.add(disk.step_dir(self.directory, meta.step))
            return True
        finally:
            slot.unlock()

    def commit_ready(self) -> None:
        """Commit every step whose parts are all on disk (one pass; the rest wait)."""
        if not self.committer:
            self.to_commit.clear()  # the saver that sees rank 0 commits
            return
        for path in sorted(self.to_commit):
            if path not in self.to_commit:
                continue  # dropped by a newer commit in this pass
            try:
                if disk.try_commit(path, fsync=self.fsync):
                    self.to_commit.discard(path)
                    logger.info("saver: committed %s", path)
                    for p in disk.prune(self.directory, self.keep):
                        logger.info("saver: removed old checkpoint %s", p)
                    # parts of older steps that never completed will not commit any more
                    self.to_commit = {q for q in self.to_commit if q > path}
            except Exception:  # noqa: BLE001
                logger.exception("saver: commit of %s failed", path)
                self.to_commit.discard(path)

    def poll_once(self) -> bool:
        """One pass; False when the run is over and the loop should end."""
        self.discover()
        busy = False
        ranks: dict[int, list[dict]] = {}
        for (rank, _), slot in list(self.slots.items()):
            try:
                slot.refresh()
                h = {k: slot.get(k) for k in ("state", "seq", "persist_req", "persisted_seq",
                                              "owner_pid", "closed")}
            except (FileNotFoundError, OSError, ValueError):
                continue
            ranks.setdefault(rank, []).append(h)
            if h["state"] != COMPLETE or h["seq"] <= h["persisted_seq"]:
                continue
            orphaned = not h["closed"] and self.owns_segments and \
                not self._pid_alive(h["owner_pid"])
            if h["persist_req"] or orphaned:
                if orphaned and not h["persist_req"]:
                    logger.warning("saver: rank %d (pid %d) died; flushing its snapshot of "
                                   "seq %d to disk", rank, h["owner_pid"], h["seq"])
                busy |= self.persist(slot)
        if self.to_commit:
            self.commit_ready()  # steps still missing parts stay queued; they do not block exit
        if busy:
            self.idle_since = time.monotonic()
        if not ranks:
            return time.monotonic() - self.idle_since < self.linger_s
        all_closed = all(all(h["closed"] for h in hs) for hs in ranks.values())
        all_gone = all(all(h["closed"] or not self._pid_alive(h["owner_pid"]) for h in hs)
                       for hs in ranks.values())
        if all_closed and not busy:
            self.commit_ready()
            return False
        if all_gone and not busy and time.monotonic() - self.idle_since > self.linger_s:
            logger.warning("saver: no live worker for %.0f s; cleaning up", self.linger_s)
            return False
        return True

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.poll_once():
                break
            self.wake.wait(self.poll_s)
            self.wake.clear()
        self.close()

    def close(self) -> None:
        for slot in self.slots.values():
            slot.close()
        self.slots.clear()
        if self.owns_segments:
            unlink_segments(self.run_id, self.shm_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="mxgraph flash-checkpoint saver (one per node)")
    p.add_argument("--run-id", required=True)
    p.add_argument("--directory", required=True)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--linger-s", type=float, default=120.0)
    p.add_argument("--shm-dir", default=SHM_DIR)
    p.add_argument("--no-fsync", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s saver[%(process)d] %(message)s")
    fd = os.open(lock_path(args.run_id, args.shm_dir), os.O_RDWR | os.O_CREAT, 0o600)
    for _ in range(100):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:  # a live saver, or a worker probing for one (shared lock)
            raw = os.pread(fd, 32, 0).decode().strip()
            if raw.isdigit() and pid_alive(int(raw)):
                os.close(fd)
                return 0  # another saver of this run is alive on this node
            time.sleep(0.01)
    else:
        os.close(fd)
        return 1
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    loop = SaverLoop(run_id=args.run_id, directory=args.directory, keep=args.keep,
                     shm_dir=args.shm_dir, fsync=not args.no_fsync, linger_s=args.linger_s)
    try:
        loop.run()
    finally:
        unlink_segments(args.run_id, args.shm_dir)  # the lock file too
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
