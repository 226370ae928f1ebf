"""Copies between live tensors and snapshot slots: a save's copy in the background, and a
restore's copy into the live tensors.

A background save (`FlashCheckpointer.save(..., background=True)`) hands the copy into
its shared-memory slot to `BackgroundCopy`, a thread (tensor copies release the GIL), and
returns at once; the caller goes on with the next step's forward and backward, which only
read the saved tensors, and calls `FlashCheckpointer.wait_copied()` before the optimizer
changes them. The slot stays locked and marked "writing" until the copy is done, so a
crash meanwhile leaves the previous snapshot as the newest complete one. On a GPU the
device-to-host copies run on their own stream, after the work queued before the save.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch

from mxgraph.runtime.checkpoint.shm import ShmSlot, SnapshotMeta

logger = logging.getLogger("mxgraph.checkpoint")


class BackgroundCopy:
    """`slot.write(meta, tensors)` on a thread; the caller's lock on `slot` is released by
    the thread when the copy is done. `on_done()` runs after a successful copy."""

    def __init__(self, slot: ShmSlot, meta: SnapshotMeta, tensors: list[torch.Tensor], *,
                 persist: bool, on_done: Callable[[], None] | None = None):
        self.slot, self.meta, self.tensors, self.persist = slot, meta, tensors, persist
        self.on_done, self.error, self.nbytes = on_done, None, 0
        self.event = None
        if any(t.device.type == "cuda" for t in tensors):
            self.event = torch.cuda.Event()
            self.event.record()  # the copies wait for the work queued before the save
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mxgraph-snapshot-r{meta.rank}")
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.event is not None:
                stream = torch.cuda.Stream()
                stream.wait_event(self.event)
                with torch.cuda.stream(stream):
                    self.nbytes = self._write()
            else:
                self.nbytes = self._write()
            if self.on_done is not None:
                self.on_done()
        except Exception as error:  # noqa: BLE001 - reported by wait(), never kills training
            self.error = error
        finally:
            self.slot.unlock()

    def _write(self) -> int:
        return self.slot.write(self.meta, self.tensors, persist=self.persist,
                               owner_pid=os.getpid())

    def wait(self) -> float:
        """Block until the copy is done; returns the seconds waited. A failed copy is
        logged (the snapshot is lost, training goes on)."""
        t0 = time.perf_counter()
        self.thread.join()
        if self.error is not None:
            logger.error("flash checkpoint: background copy of step %d failed: %r",
                         self.meta.step, self.error)
        return time.perf_counter() - t0


def copy_into(target: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    """`src` copied into `target` when it fits (same shape and dtype), else a fresh clone."""
    if target is not None and target.shape == src.shape and target.dtype == src.dtype:
        with torch.no_grad():
            target.copy_(src)
        return target
    return src.clone()
