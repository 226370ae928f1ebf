"""Non-finite losses and gradients: caught inside the step, acted on by policy.

    guard = Guard("skip", max_skips=5)           # or Step.guard, or mxgraph train --on-nonfinite
    loss = step(tokens, targets)
    norm = step.clip_grad_norm_(1.0)             # the norm is all-reduced over every rank
    verdict = step.check_health(loss, norm, i)   # one host sync; raises NonFiniteError on "stop"
    if verdict.action == "update":
        opt.step()
    opt.zero_grad()

Detection costs no collective and one host sync: the global gradient norm that clipping
computes is already reduced over every rank, so a NaN or Inf anywhere is in every rank's norm,
and `check_health` reads it with the loss in the one `.tolist()` that replaces the loop's
`loss.item()`. Only when it fails does one more collective (`locate`) find, on every rank, the
gradients that are not finite and each rank's own loss before the data-parallel average.

Actions (`POLICIES`):
* "stop" (the default, as Megatron-LM's check halts): `NonFiniteError` before the update;
* "skip": no update (parameters and optimizer state untouched; the data moves on), and
  `NonFiniteError` after `max_skips` events in a row;
* "rollback": the caller restores its newest good snapshot and skips the batches since
  (`mxgraph train` does it from the flash checkpoint's memory, as PaLM did by hand); also
  `NonFiniteError` after `max_skips` events in a row, where the steps replayed after a
  rollback do not break the row until they pass the step that failed.

A loss spike (`spike_factor` > 0: a loss above that many times the median of the last
`spike_window` healthy losses) is an event too. Every event is logged with the step, the
ranks, the parameter and the action.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mxgraph.errors import UserError

log = logging.getLogger("mxgraph.health")

POLICIES = ("stop", "skip", "rollback")
"""What a run does at a non-finite loss or gradient (or a loss spike)."""

SPIKE_MIN_HISTORY = 10
"""Healthy losses the spike check needs before it judges (the median of fewer is noise)."""


class NonFiniteError(UserError):
    """The run stopped at a non-finite loss or gradient norm (or a loss spike): the message
    names the step, the ranks, the parameter and what to do."""


@dataclass(frozen=True)
class Verdict:
    """What one step's loss and gradient norm say, and what the policy does about it."""

    action: str
    """"update" (healthy), "skip" or "rollback"; "stop" raises instead of returning."""
    step: int
    """The optimizer step it was (updates applied before it)."""
    loss: float
    grad_norm: float
    problem: str = ""
    """Empty when healthy, else e.g. "the gradient norm is nan"."""
    where: str = ""
    """The ranks and parameters that held non-finite values (`locate`), if any."""

    def describe(self) -> str:
        return f"step {self.step + 1}: {self.problem}" + (f"; {self.where}" if self.where else "")


class Guard:
    """The non-finite policy of a run: `check` turns a step's loss and gradient norm into a
    `Verdict` (see the module docstring)."""

    def __init__(self, policy: str = "stop", *, max_skips: int = 10, spike_factor: float = 0.0,
                 spike_window: int = 100):
        if policy not in POLICIES:
            raise UserError(f"non-finite policy (--on-nonfinite) {policy!r} is not one of "
                            f"{', '.join(POLICIES)}")
        if max_skips < 1 or spike_window < 1 or spike_factor < 0:
            raise UserError("max_skips and spike_window must be 1 or more, spike_factor 0 "
                            f"(off) or more; got {max_skips}, {spike_window}, {spike_factor}")
        self.policy, self.max_skips = policy, max_skips
        self.spike_factor = spike_factor
        self.history: deque[float] = deque(maxlen=spike_window)
        """The last healthy losses (the spike check's median)."""
        self.in_a_row = 0
        """Events since a healthy step reached the step of the last one (a rollback that
        fails again on its way back counts on)."""
        self.failed_at = -1
        self.events: list[Verdict] = []

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
              locate: Callable[[], str] | None = None) -> Verdict:
        """`step`: the optimizer step about to be taken; `loss`, `grad_norm`: scalars, the
        same on every rank. One host sync; when not finite, `locate()` (collective: every
        rank gets the same verdict and calls it) says where."""
        loss_value, norm_value = torch.stack([loss.detach().float().reshape(()),
                                              grad_norm.detach().float().reshape(())]).tolist()
        problem = _problem(loss_value, norm_value)
        where = locate() if problem and locate is not None else ""
        if not problem and self.spike_factor and len(self.history) >= \
                min(SPIKE_MIN_HISTORY, self.history.maxlen):
            median = statistics.median(self.history)
            if loss_value > self.spike_factor * median:
                problem = (f"loss spike: {loss_value:.4g} is {loss_value / median:.1f}x the "
                           f"median {median:.4g} of the last {len(self.history)} steps")
        if not problem:
            self.history.append(loss_value)
            if step >= self.failed_at:
                self.in_a_row = 0
            return Verdict("update", step, loss_value, norm_value)
        self.in_a_row += 1
        self.failed_at = step
        action = "stop" if self.policy == "stop" or self.in_a_row > self.max_skips else self.policy
        verdict = Verdict(action, step, loss_value, norm_value, problem, where)
        self.events.append(verdict)
        if action == "stop":
            why = "stopped before the update" if self.policy == "stop" else \
                f"stopped: {self.in_a_row} events in a row (more than max_skips={self.max_skips})"
            raise NonFiniteError(f"{verdict.describe()}; {why}")
        log.warning("%s; %s", verdict.describe(),
                    "skipped: no update" if action == "skip" else "rolling back")
        return verdict


def _problem(loss: float, grad_norm: float) -> str:
    if not math.isfinite(loss):
        return f"the loss is {loss} (gradient norm {grad_norm:.4g})"
    if not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm} (loss {loss:.4g})"
    return ""


def locate(pieces: Iterable[tuple[str, torch.Tensor]], local_loss: torch.Tensor | None) -> str:
    """Where the non-finite values are, from every rank (one all_gather_object over the
    world when distributed; every rank must call it): the ranks whose own loss (before the
    data-parallel average) is not finite, and per rank its non-finite gradients, named by
    the one the backward reached first (the last in the model's parameter order).
    `pieces`: (parameter name, this rank's gradient or a part of it), in that order."""
    bad = [name for name, grad in pieces if not bool(torch.isfinite(grad).all())]
    loss_ok = local_loss is None or bool(torch.isfinite(local_loss).all())
    mine = (loss_ok, len(bad), bad[-1] if bad else "")
    world = dist.get_world_size() if dist.is_initialized() else 1
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    parts = []
    losses = [r for r, (ok, _, _) in enumerate(every) if not ok]
    if losses:
        parts.append(f"the forward's own loss was not finite on rank(s) {_ranks(losses)}")
    by_name: dict[str, list[int]] = {}
    for r, (_, count, name) in enumerate(every):
        if count:
            by_name.setdefault(f"{count} parameter(s) with a non-finite gradient, the first "
                               f"the backward reached: {name}", []).append(r)
    for what, ranks in by_name.items():
        parts.append(f"rank(s) {_ranks(ranks)}: {what}")
    if by_name and world > 1:
        parts.append("a data-parallel reduction spreads a gradient to every rank of its group")
    return "; ".join(parts) or "no rank holds a non-finite gradient (the loss alone)"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def parameters_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of `tensors` is finite on every rank (one all-reduce when
    distributed; every rank must call it): checked before a snapshot, so that none of a
    broken model is ever saved."""
    flags = [torch.isfinite(t.detach()).all() for t in tensors]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        ok = ok.to(torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)


class Drill:
    """Test hooks, nothing users see (environment variables read by `mxgraph train`):

    MXGRAPH_DRILL_NAN="BATCH[@RANK],...": after the backward of the step that reads batch
    BATCH (0-based position in the data stream), write NaN into the first element of the
    first gradient of RANK (default 0);
    MXGRAPH_DRILL_DROP="BATCH,...": read those batches and train on none of them (the
    reference run of a skipped or rolled-back one)."""

    def __init__(self, nan: dict[int, int], drop: set[int]):
        self.nan, self.drop = nan, drop

    @classmethod
    def from_env(cls) -> Drill:
        nan = {}
        for item in filter(None, os.environ.get("MXGRAPH_DRILL_NAN", "").split(",")):
            batch, _, rank = item.partition("@")
            nan[int(batch)] = int(rank or 0)
        drop = {int(b) for b in filter(None, os.environ.get("MXGRAPH_DRILL_DROP", "").split(","))}
        return cls(nan, drop)

    def inject(self, batch: int, pieces: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """`pieces()`: this rank's (name, gradient), listed only when the drill writes."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.nan.get(batch, -1) != rank:
            return
        name, grad = next(iter(pieces()))
        grad.view(-1)[0] = float("nan")
        log.debug("drill: NaN written into %s's gradient on rank %d", name, rank)
