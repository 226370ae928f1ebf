"""Overlap on vs off, in one set of gloo processes: the loss and the gradients after the
first step, and the parameters after two AdamW steps, compared with `torch.equal` (the
reorder pass, async collectives, bucket timing and pipeline transfers claim bitwise
equality), or within `tol` relative for chunked TP GEMMs (parameters: 10 * tol)."""
from __future__ import annotations

import copy

import torch

import models
import mxgraph as mx
from tests.helpers import batch, rel_err


def run_plan(model, plan: mx.Plan, tokens, targets, steps: int = 2):
    """(losses, gradients after step 1 by name, parameters after `steps` AdamW steps);
    asserts that what the plan overlaps did run asynchronously."""
    step = mx.compile(model, plan, example=(tokens, targets))  # README order: the optimizer
    opt = torch.optim.AdamW(step.parameters(), lr=1e-2)       # right after mx.compile
    losses, grads = [], {}
    for i in range(steps):
        losses.append(step(tokens, targets))
        if i == 0:  # the model's parameters' gradients, or under zero1 the shards'
            grads = {n: p.grad.clone() for n, p in step.named_parameters()
                     if p.grad is not None}
        opt.step()
        opt.zero_grad()
    step.sync_parameters()
    if plan.overlap is not None:
        _check_overlapped(step, plan)
    return losses, grads, {n: p.detach().clone() for n, p in step.model_parameters()}


def _check_overlapped(step, plan: mx.Plan) -> None:
    """The in-graph collectives are functional starts and waits, and some data-parallel
    bucket started during the backward."""
    sources = "".join(program.source for executor in step.executors()
                      for rt in executor.stages.values() for _, program in rt.programs.all())
    if plan.tp > 1 or plan.cp > 1:
        assert "_c10d_functional.wait_tensor" in sources, "no asynchronous collective"
        assert "mxgraph.tp_all_reduce" not in sources and "sp_all_gather" not in sources
    if plan.overlap.tp_chunks > 1:  # the chunks' outputs are stacked back in rank order
        assert "torch.ops.aten.stack" in sources, "no TP GEMM was chunked"
    if plan.schedule == "dualpipev" and plan.tp > 1:  # F&B pairs hand over at TP waits
        assert sum(executor.handovers for executor in step.executors()) > 0
    if plan.overlap.copy_engine:
        assert step.data_parallel.lane.submitted > 0, "no transfer ran on the copy-engine lane"
    if step.mesh.sizes["dp_cp"] > 1 and plan.overlap.dp_buckets:
        overlaps = list(step.bucket_overlaps.values())
        assert overlaps and all(o.early for o in overlaps), "no bucket started in the backward"


def compare(rank, name, plan_kwargs, overlap=True, model_kwargs=None, tol=None, dp=1):
    """Run `plan_kwargs` with overlap None and with `overlap` on copies of one model
    (`name`: a preset, or a function building the model) and the same data (per
    data-parallel rank: `dp`); assert equality (or relative error within `tol`)."""
    torch.manual_seed(0)
    base = name() if callable(name) else models.build_model(name, **(model_kwargs or {}))
    config = base.config if hasattr(base, "config") else None
    vocab = getattr(config, "vocab_size", 256) if config is not None else 256
    inner = plan_kwargs.get("tp", 1) * plan_kwargs.get("cp", 1)  # the mesh's inner axes
    tokens, targets = batch(vocab=vocab, batch_size=4, seq_len=16, seed=rank // inner % dp)
    results = []
    for option in (None, overlap):
        plan = mx.Plan(**plan_kwargs, overlap=option)
        results.append(run_plan(copy.deepcopy(base), plan, tokens, targets))
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = results
    label = f"{name} {plan_kwargs} overlap={overlap}"
    assert grads_a.keys() == grads_b.keys(), label
    for a, b in zip(loss_a, loss_b, strict=True):
        _same(a, b, tol, f"{label}: loss")
    for key in grads_a:
        _same(grads_a[key], grads_b[key], tol, f"{label}: grad {key}")
    for key in params_a:  # AdamW (lr 1e-2) turns rounding-level gradient differences
        # into steps of up to lr: parameters get ten times the bound
        _same(params_a[key], params_b[key], tol and 10 * tol, f"{label}: param {key}")


def _same(a, b, tol, what):
    if tol is None:
        assert torch.equal(a, b), f"{what} differs by {rel_err(a, b):.2e} (bitwise expected)"
    else:
        assert rel_err(a, b) <= tol, f"{what}: {rel_err(a, b):.2e} > {tol}"
