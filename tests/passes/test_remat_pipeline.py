"""Remat and offload inside a pipeline (pp=2 on gloo): per-stage policies apply to each
stage's joint graph and leave the loss and every owned gradient bitwise equal."""
import torch

import models
import mxgraph as mx
from mxgraph.memory_saved import node_bytes
from tests.distributed import run_ranks


def _step_results(plan_kwargs, tokens, targets):
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=2)
    step = mx.compile(model, mx.Plan(pp=2, micro_batches=2, **plan_kwargs))
    loss = step(tokens, targets)
    grads = {n: p.grad.clone() for n, p in step.named_parameters() if p.grad is not None}
    executor = step.executors()[0]
    kept = {}  # stage -> bytes the F program hands to B/W (what the stage keeps)
    for stage, rt in executor.stages.items():
        programs = rt.programs
        sent = set(programs.forward_outputs)
        kept[stage] = sum(node_bytes(n) for n in programs.forward.outputs if n not in sent)
    return loss, grads, kept, step


def check_stage_policies(rank, world):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 16), generator=g)
    targets = torch.randint(0, 256, (4, 16), generator=g)
    # the baseline recomputes nothing (under Inductor codegen auto remat would)
    loss, grads, base_kept, base = _step_results({"disable_passes": ["auto_remat"]}, tokens, targets)
    for kwargs in (dict(recompute="norm,act", recompute_stages={0: "full"}),
                   dict(recompute_stages={1: "full"}, offload="stage0:all")):
        other_loss, other_grads, kept, step = _step_results(kwargs, tokens, targets)
        for stage in kept:  # each stage keeps less (offload: device bytes move to host)
            assert kept[stage] < base_kept[stage] or (
                stage == 0 and "offload" in kwargs), (rank, stage, kwargs, kept, base_kept)
        assert torch.equal(loss, other_loss), (rank, kwargs)
        assert grads.keys() == other_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], other_grads[name]), (rank, kwargs, name)
        records = {r["pass"] for ctx in step.contexts for r in ctx.records}
        assert "remat" in records


def test_pp2_stage_policies_bitwise():
    run_ranks(2, check_stage_policies)
