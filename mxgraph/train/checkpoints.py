"""The checkpoints of `mxgraph train`: resume, healthy snapshots, rollback.

A snapshot is taken only of a healthy state: after a step whose loss and gradient norm were
finite (the loop never saves after another), and whose parameters are finite on every rank
(checked here, before the copy). So `--keep` counts only good checkpoints, rotation never
deletes the last good one, and `--resume` (or a restart) never loads a broken model. Each
snapshot records its step's loss and gradient norm, and a resume says them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time

import torch.distributed as dist

from mxgraph.errors import UserError
from mxgraph.plan import Plan
from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.checkpoint.disk import saved_world_size
from mxgraph.runtime.checkpoint.flash import FlashCheckpointer
from mxgraph.runtime.checkpoint.state import apply_training_state, capture_training_state
from mxgraph.runtime.health import NonFiniteError, parameters_finite

log = logging.getLogger("mxgraph.train")


def run_id_for(checkpoint_dir: str) -> str:
    """torchrun's run id (stable across restarts), MXGRAPH_RUN_ID, or one derived from
    the checkpoint directory, so that a re-run of the same command finds its snapshots."""
    for key in ("MXGRAPH_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(key, "none") != "none":
            return os.environ[key]
    return "ckpt-" + hashlib.sha1(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:12]


def check_checkpoint_dir(path: str) -> None:
    """UserError unless `path` is (or can be made) a directory this process can write: a
    bad --checkpoint-dir fails at start, not at the first save."""
    check_writable_dir(path, "--checkpoint-dir")


def check_writable_dir(path: str, flag: str) -> None:
    """UserError naming `flag` unless `path` is (or can be made) a directory this process
    can write (a file is written there and removed)."""
    probe = os.path.join(path, f".mxgraph-write-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as error:
        raise UserError(f"{flag} {path} is not a writable directory "
                        f"({error.strerror or error}); choose a directory you can write") from None


class RunCheckpoints:
    """A run's flash checkpointer with the live state it saves and restores: the
    parameters this rank updates (`named`), the optimizer and the data position."""

    def __init__(self, checkpointer: FlashCheckpointer, plan: Plan, named: dict, optimizer,
                 batches):
        self.checkpointer, self.plan, self.named = checkpointer, plan, named
        self.optimizer, self.batches = optimizer, batches
        self.optimizer_state_saved = False
        """Whether the newest snapshot holds optimizer state (none before the first step)."""
        self.export_info: dict | None = None
        """This rank's `mxgraph.hf.export.export_info` (model spec, mesh, layouts), saved
        under "rank_local"/"export" with every snapshot (None: not saved)."""

    def save(self, step: int, health: dict, background: bool = True, persist: bool | None = None):
        """Snapshot the state after `step` updates, whose loss and gradient norm were
        `health` ({"loss", "grad_norm"}), unless a parameter is not finite on some rank
        (then nothing is saved and an error is logged; collective). Returns the
        checkpointer's SaveResult, or None when refused."""
        if not parameters_finite(self.named.values()):
            log.error("step %d: a parameter is not finite: no checkpoint of this state is "
                      "taken (the last good one is kept)", step)
            return None
        state = capture(self.plan, self.named, self.optimizer, self.batches.state_dict(),
                        self.plan.to_dict())
        state["health"] = dict(health)
        if self.export_info is not None:
            state["rank_local"]["export"] = self.export_info
        self.optimizer_state_saved = bool(self.optimizer.state)
        return self.checkpointer.save(step, state, background=background, persist=persist)

    def rollback(self, verdict) -> int:
        """Restore the newest snapshot (from memory when every rank holds it, else disk)
        into the parameters and optimizer, keeping the data position: the batches read
        since that snapshot are skipped. Returns its step. Collective."""
        optimizer = self.optimizer if self.optimizer_state_saved else None  # the snapshot's
        restored = self.checkpointer.restore(into=capture(self.plan, self.named, optimizer))
        if restored is None:
            raise NonFiniteError(f"{verdict.describe()}; no snapshot to roll back to")
        position = self.batches.state_dict()
        apply(restored.state, self.named, self.optimizer)
        self.batches.load_state_dict(position)
        info = self.checkpointer.restore_info
        log.warning("rolled back to step %d from %s (%.2f s); the %d batch(es) read since are "
                    "skipped", restored.step, info.source, info.seconds,
                    position["step"] - restored.state["rank_local"]["data_position"]["step"])
        return restored.step

    def last_good(self) -> str:
        """Where the last good checkpoint is, for a message: after `close`, the newest
        committed one on disk, as rank 0 (whose close waits for the saver's commit) sees
        it. Collective."""
        committed = [path for _, path in disk.list_steps(self.checkpointer.directory)
                     if disk.is_committed(path)]
        if self.checkpointer.distributed:
            box = [committed]
            dist.broadcast_object_list(box, src=0, group=self.checkpointer.group)
            committed = box[0]
        if not committed:
            return "no checkpoint was committed before it"
        return (f"the last good checkpoint, {committed[0]}, is intact (resume from it with "
                "--resume after a fix, a lower --lr say, or train with --on-nonfinite skip or "
                "rollback)")

    def resume(self, restart: int, started: float) -> int:
        return _resume(self.checkpointer, self.plan, self.named, self.optimizer, self.batches,
                       restart, started)


def _resume(checkpointer: FlashCheckpointer, plan: Plan, named: dict, optimizer, batches,
            restart: int, started: float) -> int:
    """Restore the newest snapshot (memory if every rank holds it, else disk) into the
    live parameters, optimizer and data position; returns the step to start at (0 when
    there is nothing to resume). Rank 0 logs where it came from and, after a restart
    (`restart` = torchrun's restart count), how long the failure cost."""
    restored = checkpointer.restore(into=capture(plan, named, optimizer))
    info = checkpointer.restore_info
    rank = checkpointer.rank
    prefix = f"restart {restart} (at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}): " \
        if restart else ""
    if restored is None:
        if rank == 0:
            log.warning("%snothing to resume in %s (no snapshot in memory, no committed "
                        "checkpoint on disk): starting at step 0 (start-up with compile %.1f s)",
                        prefix, checkpointer.directory, time.perf_counter() - started)
        return 0
    batches.load_state_dict(apply(restored.state, named, optimizer))
    if rank != 0:
        return restored.step
    where = "memory (every rank held it)" if info.source == "memory" else f"disk ({info.path})"
    message = f"{prefix}resumed at step {restored.step} from {where}: restore " \
        f"{info.seconds:.2f} s, start-up with compile {time.perf_counter() - started:.1f} s"
    if restart:  # the failed attempt's steps after the snapshot are redone
        lost = time.time() - restored.state.get("saved_at", time.time())
        message += f"; {lost:.1f} s of training lost to the failure (since that snapshot)"
    health = restored.state.get("health")
    if health:
        message += f"; that step's loss {health['loss']:.4f}, gradient norm {health['grad_norm']:.4g}"
    log.warning(message)
    if info.resharded:
        log.warning("the job runs on %d process(es) now, the checkpoint was saved on %d: data "
                    "parallelism is %d now (each step trains --batch-size sequences per "
                    "data-parallel rank)", checkpointer.world_size,
                    saved_world_size(info.path), plan.resolve_dp(checkpointer.world_size))
    return restored.step


def capture(plan: Plan, named: dict, optimizer, data_position=None,
            plan_dict: dict | None = None) -> dict:
    """`capture_training_state`; when ranks hold different parameters (zero1 shards, tp/ep
    shards, pp stages) the parameters and the optimizer state go under "rank_local" (kept
    per rank on disk, instead of once for all ranks)."""
    state = capture_training_state(named, optimizer, None, data_position, plan_dict)
    state["saved_at"] = time.time()  # wall clock: a restart tells how much time it lost
    if plan.zero1 or plan.tp > 1 or plan.pp > 1 or plan.ep > 1:
        state["rank_local"]["sharded"] = {"model": state.pop("model"),
                                          "optimizer": state.pop("optimizer")}
    return state


def apply(state: dict, named: dict, optimizer):
    """`apply_training_state` for a state from `capture`; returns the data position."""
    if "sharded" in state["rank_local"]:
        state = {**state, **state["rank_local"]["sharded"]}
    return apply_training_state(state, named, optimizer)


