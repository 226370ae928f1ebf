"""Point-to-point transfers of one pipeline step, posted ahead (`Plan.overlap.p2p`).

`P2PQueue` owns one rank's transfers for one `PipelineExecutor.step` with `p2p_ahead`:
receives are posted (`irecv` into buffers allocated on the mesh's device) before the
action that consumes them, so the RECV action only waits on a buffer already in flight;
the tensors of one SEND go out in one `batch_isend_irecv` call, together with the
receives due right after it. Which receive is posted when is `post_points`:

- at most `RECV_AHEAD` receives of each kind (RECV_F, RECV_B) are in flight (posted, not
  yet taken): the first ones are posted at the start of the step, each later one as soon
  as the one `RECV_AHEAD` earlier of its kind is taken;
- on a backend that runs a rank's transfers in the order they are issued (nccl, mccl: one
  stream per communicator, so a posted receive holds back every later send), a receive is
  also posted no earlier than after the last send listed before it, and receives in list
  order. gloo (the CPU) matches a message on (source, tag) whatever the order of posting.

Deadlock freedom: `schedules/validate.py` runs each rank's list with sends that never
block and receives that block at their RECV action until the matching send has run. Here
posting an `irecv` never blocks (gloo queues it per (peer, slot) and notifies the peer; on
nccl it is enqueued), the only blocking waits stay at the RECV actions and at the end of
the step (sends), so every wait the validator allows still completes; on an in-order
backend no transfer is issued before one listed earlier than it, which is the validator's
order. Tags are unique per (kind, sending stage, micro-batch) within a step and the tensors
of one action share one tag: gloo keeps the receives of one (peer, slot) in a FIFO queue,
so they match the sends in order. Numerics: the same bytes land in the same buffers, so a
step is bitwise-equal with and without posting ahead.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mxgraph.schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action

RECV_AHEAD = 2
"""Receives of each kind in flight at once (buffers of RECV_AHEAD micro-batches per kind)."""


@dataclass(frozen=True)
class RecvSpec:
    """What one receive action reads: from which rank, under which tag, into what shapes."""

    peer: int
    tag: int
    metas: list  # tensors (fake or real): shape and dtype of each buffer


Op = tuple  # ("send" | "recv", tensor, peer, tag)


def batch_issue(ops: list[Op]) -> list:
    """`ops` in one `torch.distributed.batch_isend_irecv` call; its works."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, tag=tag)
        for kind, tensor, peer, tag in ops])


def post_points(actions: list[Action], *, in_issue_order: bool,
                window: int = RECV_AHEAD) -> dict[int, int]:
    """For each receive in `actions` (by index), the index of the action before which it is
    posted (0: at the start of the step); never after the receive itself. See the module
    docstring for the rule."""
    points: dict[int, int] = {}
    taken_by_kind: dict[str, list[int]] = {RECV_F: [], RECV_B: []}
    last_send, previous = -1, 0
    for i, action in enumerate(actions):
        if action.kind in (SEND_F, SEND_B):
            last_send = i
        elif action.kind in (RECV_F, RECV_B):
            same = taken_by_kind[action.kind]
            point = same[-window] + 1 if len(same) >= window else 0
            if in_issue_order:
                point = previous = max(point, last_send + 1, previous)
            points[i] = point
            same.append(i)
    return points


class P2PQueue:
    """One step's transfers on one rank: `post_due(action)` before each action,
    `take(action)` at a receive, `send(action, ...)` at a send (the caller waits on the
    works it returns, at the end of the step). `issue` is `batch_issue` (a stand-in in unit
    tests)."""

    def __init__(self, actions: list[Action], recv_spec: Callable[[Action], RecvSpec], *,
                 device: torch.device, in_issue_order: bool, window: int = RECV_AHEAD,
                 issue: Callable[[list[Op]], list] = batch_issue):
        self.actions = actions
        self.index = {action: i for i, action in enumerate(actions)}
        self.recv_spec, self.device, self.issue = recv_spec, device, issue
        self.due: dict[int, list[int]] = {}
        """Action index -> indices of the receives posted right before it."""
        for r, point in post_points(actions, in_issue_order=in_issue_order,
                                    window=window).items():
            self.due.setdefault(point, []).append(r)
        self.posted: dict[int, tuple[list[torch.Tensor], list]] = {}
        """Receive index -> (its buffers, the works to wait on before reading them)."""

    def _recv_ops(self, receives: list[int]) -> list[tuple[int, Op]]:
        ops = []
        for r in receives:
            if r in self.posted:
                continue
            spec = self.recv_spec(self.actions[r])
            self.posted[r] = ([torch.empty(m.shape, dtype=m.dtype, device=self.device)
                               for m in spec.metas], [])
            ops += [(r, ("recv", buf, spec.peer, spec.tag)) for buf in self.posted[r][0]]
        return ops

    def _run(self, sends: list[Op], recvs: list[tuple[int, Op]]) -> list:
        """Issue `sends` then `recvs` in one batch; file the receives' works, return the
        sends' works."""
        ops = sends + [op for _, op in recvs]
        if not ops:
            return []
        works = list(self.issue(ops))
        if len(works) == len(ops):  # gloo: one work per op
            recv_works, send_works = [[w] for w in works[len(sends):]], works[:len(sends)]
        else:  # a coalescing backend (nccl): the batch's works stand for each op
            recv_works, send_works = [works] * len(recvs), works if sends else []
        for (r, _), work in zip(recvs, recv_works, strict=True):
            self.posted[r][1].extend(work)
        return send_works

    def post_due(self, action: Action) -> None:
        """Post the receives due before `action` (not already posted with a send)."""
        self._run([], self._recv_ops(self.due.get(self.index[action], [])))

    def take(self, action: Action) -> list[torch.Tensor]:
        """Wait for the receive `action` (posted by now) and hand over its buffers."""
        buffers, works = self.posted.pop(self.index[action])
        for work in works:
            work.wait()
        return buffers

    def send(self, action: Action, peer: int, tag: int, tensors: list[torch.Tensor]) -> list:
        """Send `tensors` to `peer` in one batch with the receives due right after it; the
        sends' works."""
        sends = [("send", t.contiguous(), peer, tag) for t in tensors]
        return self._run(sends, self._recv_ops(self.due.get(self.index[action] + 1, [])))
