"""Hot-expert replication (`Plan.moe.hot_experts`), as torch.library custom ops: FasterMoE's
dynamic shadowing. Rank r of the "ep" group owns experts [r*E/ep, (r+1)*E/ep).

* `ep_hot_choose` (no backward: integers): an all-reduce of the per-expert counts [E]
  over the group; returns the k most-loaded experts when replication is on (ascending,
  -1 when off or unused) and their mask [E].
* `ep_hot_weights` (backward: `ep_hot_grads`): the chosen experts' weights [k, ...] of
  every expert parameter of a block on every rank, one broadcast per slot from its owner.
* `ep_hot_grads`: the replicas' gradients [k, ...] reduced (sum) to each slot's owner,
  one reduce per slot; the owner's expert hot[j] gets slot j's sum, the other ranks 0.

Replication is on while max/mean of the group's counts is at least `threshold`; once on
it stays on until the ratio falls below `HYSTERESIS` x threshold, so it does not flap.
Of the k most-loaded experts, only those with at least `min_rows` rows group-wide are
replicated (FasterMoE's cost rule, `ep_hot.min_rows`: the bytes of the rows kept off the
all-to-all must pay for the weights' broadcast and their gradients' reduction).
The state is per block (`key`), identical on every rank of the group (the counts are
all-reduced first, the rule is deterministic). A block run twice on the same counts (a
recomputed forward) gets the same answer without moving the state. Each decision is
recorded in `moe_stats.HOT`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mxgraph.runtime import moe_stats
from mxgraph.runtime.collectives.groups import KIND, process_group

HYSTERESIS = 0.9
"""Replication turns off below this fraction of `hot_threshold`."""


@dataclass
class _State:
    on: bool = False
    counts: torch.Tensor | None = None  # the last decision's counts and answer
    answer: tuple[torch.Tensor, torch.Tensor] | None = None


STATES: dict[tuple, _State] = {}
"""(group, block, k, threshold, min_rows) -> replication state (one per compiled setting,
so two steps of one process with other options do not share a decision)."""


def decide(counts: torch.Tensor, k: int, threshold: float, state: _State,
           min_rows: int = 0) -> list[int]:
    """The experts to replicate for these group-wide `counts` (ascending), updating
    `state.on` by the hysteresis rule; [] when replication is off. Of the k most-loaded
    experts only those with at least `min_rows` rows are replicated (the cost rule)."""
    total = float(counts.sum())
    ratio = float(counts.max()) * counts.numel() / total if total else 1.0
    state.on = ratio >= threshold if not state.on else ratio >= HYSTERESIS * threshold
    if not state.on:
        return []
    top = counts.topk(k)
    return sorted(e for e, n in zip(top.indices.tolist(), top.values.tolist(), strict=True) if n >= min_rows)


@torch.library.custom_op("mxgraph::ep_hot_choose", mutates_args=())
def ep_hot_choose(counts: torch.Tensor, k: int, threshold: float, min_rows: int,
                  group_name: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`counts` [E] int64: this rank's rows per expert. Returns (hot [k] int64, mask [E]
    bool): the replicated experts, ascending, -1 in unused slots; mask[e]: e is hot.
    `min_rows`: the group-wide rows an expert needs to be worth replicating (`decide`)."""
    total = counts.clone()
    dist.all_reduce(total, group=process_group(group_name))
    state = STATES.setdefault((group_name, key, k, threshold, min_rows), _State())
    if state.counts is not None and torch.equal(state.counts, total):
        return tuple(t.clone() for t in state.answer)
    chosen = decide(total, k, threshold, state, min_rows)
    hot = torch.full((k,), -1, dtype=torch.int64, device=counts.device)
    hot[:len(chosen)] = torch.tensor(chosen, dtype=torch.int64, device=counts.device)
    mask = torch.zeros(counts.shape[0], dtype=torch.bool, device=counts.device)
    mask[hot[:len(chosen)]] = True
    state.counts, state.answer = total, (hot, mask)
    moe_stats.HOT[key] = chosen
    return hot.clone(), mask.clone()


@ep_hot_choose.register_fake
def _(counts, k, threshold, min_rows, group_name, key):
    return counts.new_empty(k, dtype=torch.int64), counts.new_empty(counts.shape[0],
                                                                    dtype=torch.bool)


def _owned(hot: torch.Tensor, local: int, rank: int) -> list[tuple[int, int]]:
    """(slot j, local expert) for the hot experts this rank owns."""
    return [(j, e - rank * local) for j, e in enumerate(hot.tolist())
            if e >= 0 and e // local == rank]


def _pack(tensors: list[torch.Tensor], index: int) -> torch.Tensor:
    return torch.cat([t[index].reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, into: list[torch.Tensor], index: int) -> None:
    start = 0
    for t in into:
        n = t[index].numel()
        t[index] = flat[start:start + n].view_as(t[index])
        start += n


def _slots(hot: torch.Tensor, local: int, group):
    """(slot, expert, owner's global rank) of every used slot."""
    return [(j, e, dist.get_global_rank(group, e // local)) for j, e in enumerate(hot.tolist())
            if e >= 0]


@torch.library.custom_op("mxgraph::ep_hot_weights", mutates_args=())
def ep_hot_weights(weights: list[torch.Tensor], hot: torch.Tensor,
                   group_name: str) -> list[torch.Tensor]:
    """`weights`: each [E/ep, ...], this rank's experts of one parameter (any view keeping
    dim 0); `hot` [k] from `ep_hot_choose`. Returns per weight [k, ...]: slot j holds
    expert hot[j]'s weight (zeros for an unused slot). One broadcast per used slot carries
    all the weights of that expert."""
    group = process_group(group_name)
    local, rank = weights[0].shape[0], dist.get_rank(group)
    outs = [w.new_zeros(hot.shape[0], *w.shape[1:]) for w in weights]
    for slot, expert, owner in _slots(hot, local, group):
        flat = _pack(weights, expert - rank * local) if expert // local == rank else \
            weights[0].new_empty(sum(w[0].numel() for w in weights))
        dist.broadcast(flat, src=owner, group=group)
        _unpack(flat, outs, slot)
    return outs


@ep_hot_weights.register_fake
def _(weights, hot, group_name):
    return [w.new_empty(hot.shape[0], *w.shape[1:]) for w in weights]


@torch.library.custom_op("mxgraph::ep_hot_grads", mutates_args=())
def ep_hot_grads(grads: list[torch.Tensor], hot: torch.Tensor, local: int,
                 group_name: str) -> list[torch.Tensor]:
    """The backward of `ep_hot_weights`: per weight, `grads` [k, ...] of this rank's
    replicas -> [local, ...]: the group's sum of slot j's gradients at the owner's expert
    hot[j] (one reduce per used slot for all the weights)."""
    group = process_group(group_name)
    rank = dist.get_rank(group)
    outs = [g.new_zeros(local, *g.shape[1:]) for g in grads]
    for slot, expert, owner in _slots(hot, local, group):
        flat = _pack(grads, slot).contiguous()
        dist.reduce(flat, dst=owner, group=group)
        if expert // local == rank:
            _unpack(flat, outs, expert - rank * local)
    return outs


@ep_hot_grads.register_fake
def _(grads, hot, local, group_name):
    return [g.new_empty(local, *g.shape[1:]) for g in grads]


def _keep(ctx, inputs, output):
    weights, hot, group_name = inputs
    ctx.save_for_backward(hot)
    ctx.local, ctx.group_name = weights[0].shape[0], group_name
    ctx.shapes = [(hot.shape[0], *w.shape[1:]) for w in weights]


def _backward(ctx, grads):
    (hot,) = ctx.saved_tensors
    grads = [g if g is not None else hot.new_zeros(shape, dtype=torch.float32)
             for g, shape in zip(grads, ctx.shapes, strict=True)]
    return ep_hot_grads(list(grads), hot, ctx.local, ctx.group_name), None, None


ep_hot_weights.register_autograd(_backward, setup_context=_keep)

KIND.update({"ep_hot_choose": "all_reduce", "ep_hot_weights": "broadcast",
             "ep_hot_grads": "reduce"})

__all__ = ["HYSTERESIS", "STATES", "decide", "ep_hot_choose", "ep_hot_weights"]
