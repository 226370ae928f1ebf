"""Receives posted ahead and batched sends (runtime/pipeline/p2p.py, `Plan.overlap.p2p`).

Unit tests of which receives are posted when, on the schedules' own action lists, without
torch.distributed; then pp=2 on gloo processes: loss and gradients with p2p ahead on (gloo's
any-order rule, and the in-issue-order rule that nccl gets, which batches a send with the
receives after it) are bitwise-equal to p2p off, for 1F1B, ZB-H1 and DualPipeV.
"""
import copy

import pytest
import torch

import models
import mxgraph as mx
from mxgraph.runtime.pipeline.p2p import RECV_AHEAD, P2PQueue, RecvSpec, post_points
from mxgraph.schedules import RECV_B, RECV_F, SEND_B, SEND_F, build_schedule, parse_action
from tests.distributed import run_ranks

RECVS, SENDS = (RECV_F, RECV_B), (SEND_F, SEND_B)


def _rank_lists():
    for name, pp, m, vpp in [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                             ("zbh1", 4, 8, 1), ("interleaved", 2, 4, 2),
                             ("dualpipev", 2, 4, 1), ("dualpipev", 4, 8, 1)]:
        sched = build_schedule(name, pp, m, vpp if vpp > 1 else None)
        for rank, actions in sched.actions.items():
            yield f"{name} pp={pp} rank {rank}", actions


def test_post_points_1f1b_rank0():
    actions = build_schedule("1f1b", 2, 4).actions[0]
    assert " ".join(map(str, actions)) == ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0F2 0SEND_F2 "
                                           "0RECV_B1 0BW1 0F3 0SEND_F3 0RECV_B2 0BW2 0RECV_B3 0BW3")
    # gloo: the first two at the start, each later one once the one two earlier is taken
    assert post_points(actions, in_issue_order=False, window=2) == {4: 0, 8: 0, 12: 5, 14: 9}
    # in issue order: right after the last send before it (so in that send's batch)
    assert post_points(actions, in_issue_order=True, window=2) == {4: 4, 8: 8, 12: 12, 14: 12}
    assert post_points(actions, in_issue_order=False, window=1) == {4: 0, 8: 5, 12: 9, 14: 13}


@pytest.mark.parametrize("in_issue_order", [False, True])
def test_post_points_every_schedule(in_issue_order):
    for where, actions in _rank_lists():
        points = post_points(actions, in_issue_order=in_issue_order)
        assert sorted(points) == [i for i, a in enumerate(actions) if a.kind in RECVS], where
        for i in range(len(actions)):
            for kind in RECVS:  # posted and not yet taken when `actions[i]` starts
                live = [r for r, p in points.items() if p <= i and r >= i
                        and actions[r].kind == kind]
                assert len(live) <= RECV_AHEAD, (where, i, live)
        for r, p in points.items():
            assert p <= r, where
            if in_issue_order:  # no send listed before a receive is issued after it
                assert not any(actions[s].kind in SENDS for s in range(p, r)), (where, r, p)
                assert all(points[q] <= p for q in points if q < r), (where, r)


class _Work:
    def __init__(self, log, op):
        self.log, self.op = log, op

    def wait(self):
        self.log.append(("wait", self.op[0], self.op[3]))


def _drive(text: str, in_issue_order: bool):
    """Run P2PQueue over a hand-written action list with a recording stand-in for
    batch_isend_irecv; the log of batches and waits, and the buffers taken."""
    actions = [parse_action(t) for t in text.split()]
    log, taken = [], {}

    def issue(ops):
        log.append(("batch", [(kind, tag) for kind, _, _, tag in ops]))
        return [_Work(log, op) for op in ops]

    def spec(action):
        return RecvSpec(peer=1, tag=100 + action.microbatch, metas=[torch.empty(2, 3)] * 2)

    queue = P2PQueue(actions, spec, device=torch.device("cpu"),
                     in_issue_order=in_issue_order, window=1, issue=issue)
    for action in actions:
        queue.post_due(action)
        log.append(("do", str(action)))
        if action.kind in SENDS:
            for work in queue.send(action, 1, action.microbatch, [torch.ones(2)] * 2):
                work.wait()
        elif action.kind in RECVS:
            taken[str(action)] = queue.take(action)
    assert not queue.posted
    return log, taken


def test_queue_posts_ahead_and_batches():
    text = "0F0 0SEND_F0 0RECV_B0 0BW0 0F1 0SEND_F1 0RECV_B1 0BW1"
    log, taken = _drive(text, in_issue_order=False)
    assert log[:2] == [("batch", [("recv", 100), ("recv", 100)]), ("do", "0F0")]
    # the next receive is posted as soon as the one before is taken, before the BW
    i = log.index(("do", "0RECV_B0"))
    assert log[i + 1:i + 5] == [("wait", "recv", 100), ("wait", "recv", 100),
                                ("batch", [("recv", 101), ("recv", 101)]), ("do", "0BW0")]
    assert ("batch", [("send", 0), ("send", 0)]) in log  # one batch per send
    assert [b.shape for b in taken["0RECV_B1"]] == [torch.Size([2, 3])] * 2
    log, _ = _drive(text, in_issue_order=True)  # the send and the receive after it: one batch
    assert ("batch", [("send", 1), ("send", 1), ("recv", 101), ("recv", 101)]) in log
    assert log.index(("batch", [("send", 1), ("send", 1), ("recv", 101), ("recv", 101)])) > \
        log.index(("do", "0SEND_F1"))


P2P_ONLY = {"p2p": True, "reorder": False, "dp_buckets": False}


def _on_vs_off(rank, world, schedules, micro_batches=4, model_kwargs=None):
    """pp=world: each schedule's step with p2p off, then on (both rules), same batch."""
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 256, (8, 16), generator=g) for _ in range(2))
    for schedule in schedules:
        torch.manual_seed(0)
        model = models.build_model("llama-tiny", **(model_kwargs or {}))
        results = {}
        for overlap in (None, P2P_ONLY):
            plan = mx.Plan(pp=world, schedule=schedule, micro_batches=micro_batches,
                           overlap=overlap)
            step = mx.compile(copy.deepcopy(model), plan)
            executor = step.compiled(tokens, targets)
            assert executor.p2p_ahead == (overlap is not None)
            for in_issue_order in ([False] if overlap is None else [False, True]):
                executor.p2p_in_issue_order = in_issue_order
                loss = step(tokens, targets)
                grads = {n: p.grad for n, p in step.named_parameters()}
                for _, p in step.named_parameters():
                    p.grad = None
                results[(overlap is not None, in_issue_order)] = (loss, grads)
            if schedule == "dualpipev":  # forward-only (F&B pairs split): one schedule
                results[(overlap is not None, "eval")] = (step.eval_loss(tokens, targets), {})
        ref_loss, ref_grads = results.pop((False, False))
        assert any(g is not None for g in ref_grads.values())
        if schedule == "dualpipev":
            assert torch.equal(results.pop((True, "eval"))[0], results.pop((False, "eval"))[0])
        for key, (loss, grads) in results.items():
            assert torch.equal(loss, ref_loss), (schedule, key, loss, ref_loss)
            assert grads.keys() == ref_grads.keys(), (schedule, key)
            for name, grad in grads.items():
                ref = ref_grads[name]
                assert (grad is None) == (ref is None), (schedule, key, name)
                assert grad is None or torch.equal(grad, ref), (schedule, key, name)


def test_pp2_p2p_ahead_bitwise_equal():
    # one set of 2 processes for the three schedules (suite time)
    run_ranks(2, _on_vs_off, ["1f1b", "zbh1", "dualpipev"])
