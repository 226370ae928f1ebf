"""Capacity-padded experts (`Plan.moe.capacity_factor`, passes/moe/capacity.py) against
eager references.

* A capacity large enough that nothing drops gives the dropless result: loss within 1e-6
  relative, gradients 1e-5 (the padded GEMMs have other shapes, so rounding may differ).
* With drops, the reference is the eager model computing the same drops: mxgraph's own
  `capacity_factor` (models/moe.py: earliest rows first, i.e. drop_policy "position"),
  or for "probs" that function keeping the highest routing weights instead (`_probs`).
  Loss 1e-5, gradients 1e-4 (`tests/runtime/test_pipeline_exec.py`'s tolerances).
* Every expert's padded input has exactly C = ceil(N / E * c) rows (per EP rank: ep * C).
* ep=2 on gloo against the eager model per data-parallel chunk (capacity counts each
  rank's own rows), with parameters after AdamW steps (capacity with tp x ep and the
  a2a overlap: tests/parallel/test_moe_combos.py; the loop form under ep: the a2a overlap case).
"""
import copy
import math

import pytest
import torch

import models
import models.moe as moe_model
import mxgraph as mx
from mxgraph.errors import PlanError
from mxgraph.ir import is_backward
from tests.distributed import run_ranks
from tests.helpers import rel_err
from tests.runtime.test_pipeline_exec import check_plan

aten = torch.ops.aten
_POSITION = moe_model.dispatch_capacity  # the model's own capacity: earliest rows first


def _probs(x_TD, weights_TK, expert_ids_TK, experts, capacity_factor):
    """models.moe.dispatch_capacity keeping, per expert, the C rows of highest weight."""
    T, K = expert_ids_TK.shape
    E = experts.n_experts
    C = max(1, math.ceil(T * K / E * capacity_factor))
    flat_ids, flat_w = expert_ids_TK.reshape(-1), weights_TK.reshape(-1)
    by_weight = flat_w.argsort(descending=True, stable=True)
    order = by_weight[flat_ids[by_weight].argsort(stable=True)]
    counts = torch.bincount(flat_ids, minlength=E)
    start = counts.cumsum(0) - counts
    place = torch.empty_like(flat_ids)
    place[order] = torch.arange(T * K) - start[flat_ids[order]]
    kept = place < C
    slot = torch.where(kept, flat_ids * C + place, torch.full_like(place, E * C))
    token_of_row = torch.arange(T * K) // K
    buf = x_TD.new_zeros(E * C + 1, x_TD.shape[1]).index_add(0, slot, x_TD[token_of_row])
    y = experts.batched(buf[:E * C].view(E, C, -1)).reshape(E * C, -1)
    y = torch.cat([y, y.new_zeros(1, y.shape[1])])[slot]
    return torch.zeros_like(x_TD).index_add(0, token_of_row, y * (flat_w * kept)[:, None])


def _with_capacity(factor, policy):
    def adjust(reference):
        for block in reference.moe_blocks():
            block.cfg.capacity_factor = factor
        moe_model.dispatch_capacity = _probs if policy == "probs" else _POSITION
    return adjust


def _build(impl="grouped_mm", **kwargs):
    torch.manual_seed(0)
    return models.build_model("moe-tiny", n_layers=2, expert_impl=impl, aux_loss_coef=0.0,
                              **kwargs)


def _one_step(model, plan, adjust=None):
    reference = copy.deepcopy(model)
    if adjust is not None:
        adjust(reference)
    step = mx.compile(model, plan)
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    loss = step(tokens, targets)
    ref_loss = reference(tokens, targets)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    grad_err = max(rel_err(p.grad, ref[n].grad) for n, p in step.named_parameters()
                   if p.grad is not None)
    return step, rel_err(loss, ref_loss), grad_err


def _hf(family, experts=None):
    pytest.importorskip("transformers")
    from mxgraph.hf.models import TINY, build_hf_model
    torch.manual_seed(0)
    return build_hf_model(f"hf:{family}", TINY[family] | (
        {"experts_implementation": experts} if experts else {}))


@pytest.mark.parametrize("make,batched", [
    (lambda: _build("grouped_mm"), True), (lambda: _build("loop"), False),
    (lambda: _hf("mixtral"), True), (lambda: _hf("mixtral", "batched_mm"), True),
    (lambda: _hf("qwen2_moe"), False)],
    ids=["grouped-bmm", "loop", "hf-mixtral-bmm", "hf-batched_mm-bmm", "hf-qwen2"])
def test_nothing_dropped_is_dropless(make, batched):
    plan = mx.Plan(moe=mx.MoEOptions(capacity_factor=8.0, batched_gemm=batched))
    step, loss_err, grad_err = _one_step(make(), plan)
    assert loss_err <= 1e-6 and grad_err <= 1e-5, (loss_err, grad_err)
    dropped = step.moe_stats()["dropped"]
    assert dropped and all(v == 0.0 for v in dropped.values()), dropped


def _from_param(node, hops=3):
    """Whether `node` is a stacked [E, ...] input of the joint graph (the expert weights),
    through up to `hops` views."""
    while hops and node.op != "placeholder":
        node, hops = node.args[0], hops - 1
    return node.op == "placeholder" and node.meta["val"].ndim == 3


def _expert_inputs(step):
    """Rows of every forward expert GEMM's input (a GEMM reading [E, ...] weights)."""
    rows = []
    for executor in step.executors():
        for stage in executor.stages.values():
            for node in stage.joint.gm.graph.nodes:
                if is_backward(node) or node.target not in (
                        aten.bmm.default, torch.ops.mxgraph.grouped_mm.default):
                    continue
                x, weight = node.args[:2]
                if _from_param(weight):
                    shape = x.meta["val"].shape
                    rows.append(shape[0] * shape[1] if len(shape) == 3 else shape[0])
    return rows


@pytest.mark.parametrize("factor,policy,batched", [
    (1.0, "position", False), (1.25, "probs", True), (1.0, "probs", False)])
def test_drops_match_eager_capacity(factor, policy, batched, monkeypatch):
    monkeypatch.setattr(moe_model, "dispatch_capacity", _POSITION)
    plan = mx.Plan(moe=mx.MoEOptions(capacity_factor=factor, drop_policy=policy,
                                     batched_gemm=batched))
    step, loss_err, grad_err = _one_step(_build(), plan, _with_capacity(factor, policy))
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)
    dropped = step.moe_stats()["dropped"]
    assert list(dropped) == ["layers.1.mlp"] and 0 < dropped["layers.1.mlp"] < 1, dropped
    # 2 x 16 tokens, top-2, 8 experts: C = ceil(64 / 8 * factor) rows per expert
    capacity = math.ceil(64 / 8 * factor)
    assert _expert_inputs(step) and set(_expert_inputs(step)) == {8 * capacity}


def _check_ep(rank, world, plan_kwargs, factor, policy, impl):
    check_plan(rank, world, _build, plan_kwargs, steps=2, model_kwargs=dict(impl=impl),
               adjust_reference=_with_capacity(factor, policy) if factor < 8 else None)


def _every_ep_case(rank, world, cases):
    for plan_kwargs, factor, policy, impl in cases:
        plan_kwargs = dict(plan_kwargs, moe=dict(plan_kwargs.get("moe", {}),
                                                 capacity_factor=factor, drop_policy=policy))
        try:
            _check_ep(rank, world, plan_kwargs, factor, policy, impl)
        except AssertionError as error:
            raise AssertionError(f"{plan_kwargs}, {impl}: {error}") from error


def _a2a_on_vs_off(rank, world, impl):
    """moe.a2a_overlap on capacity-padded experts: two chunks along C, each with its own
    all-to-alls (4 per MoE layer each way), loss bitwise equal to off, gradients 1e-6
    (the chunks' GEMMs are half as tall: other rounding)."""
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 256, (4, 16), generator=g) for _ in range(2))
    results = []
    for a2a in (False, True):
        step = mx.compile(_build(impl), mx.Plan(ep=2, overlap=True, moe=dict(
            capacity_factor=1.0, batched_gemm=impl != "loop", a2a_overlap=a2a)))
        loss = step(tokens[rank::world], targets[rank::world])
        results.append((loss, {n: p.grad for n, p in step.named_parameters()}))
    starts = [n for executor in step.executors() for stage in executor.stages.values()
              for n in stage.joint.gm.graph.nodes
              if n.target is torch.ops._c10d_functional.all_to_all_single.default]
    assert len(starts) == 8, len(starts)  # 1 MoE layer: 2 chunks x 2 ways x (F, B)
    (off, off_grads), (on, on_grads) = results
    assert torch.equal(on, off), (on.item(), off.item())
    for name, grad in on_grads.items():
        assert rel_err(grad, off_grads[name]) <= 1e-6, name


def _ep2(rank, world):
    _every_ep_case(rank, world, [(dict(ep=2), 1.0, "position", "grouped_mm"),
                                 (dict(ep=2, moe=dict(batched_gemm=True)), 1.25, "probs",
                                  "grouped_mm")])
    for impl in ("grouped_mm", "loop"):
        _a2a_on_vs_off(rank, world, impl)


@pytest.mark.slow
def test_ep2_capacity():
    run_ranks(2, _ep2)


@pytest.mark.parametrize("moe,plan,message", [
    (dict(capacity_factor=0.0), {}, "must be a number > 0"),
    (dict(capacity_factor=-1), {}, "must be a number > 0"),
    (dict(batched_gemm=True), {}, "needs moe.capacity_factor"),
    (dict(drop_policy="random", capacity_factor=1.0), {}, "choose from probs, position"),
    (dict(a2a_overlap=True), dict(overlap=True), "ep=1 has none"),
    (dict(a2a_overlap=True), dict(ep=2), "needs overlap=True"),
    (dict(hot_experts=1), {}, "ep=1 has none"),
    (dict(hot_experts=-1), dict(ep=2), "integer >= 0"),
    (dict(hot_threshold=0.5, hot_experts=1), dict(ep=2), "must be >= 1")])
def test_impossible_settings(moe, plan, message):
    with pytest.raises(PlanError, match=message):
        mx.Plan(moe=moe, **plan)


def test_refusals_name_the_block():
    with pytest.raises(PlanError, match="already capacity-padded by the model"):
        mx.compile(_build(capacity_factor=1.5), mx.Plan(moe=dict(capacity_factor=1.0))).prepare(
            torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(PlanError, match="batched_gemm is not built for a loop"):
        mx.compile(_build("loop"), mx.Plan(moe=dict(capacity_factor=1.0, batched_gemm=True))
                   ).prepare(torch.zeros(2, 16, dtype=torch.long),
                             torch.zeros(2, 16, dtype=torch.long))

