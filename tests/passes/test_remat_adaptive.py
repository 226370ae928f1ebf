"""MoE adaptive recompute: the switch happens exactly above the threshold; both variants
give bitwise the same loss and gradients."""
import logging

import pytest
import torch

import models
import mxgraph as mx
from mxgraph.plan import MoEOptions
from mxgraph.runtime.adaptive import count_tokens_per_rank, tokens_per_rank, variant_plans
from mxgraph.step_adaptive import AdaptiveMoEStep
from tests.helpers import batch

TOKENS = 2 * 16  # batch x sequence
TOPK = 2


def skewed_model():
    torch.manual_seed(0)
    model = models.build_model("moe-tiny", n_layers=2, expert_impl="grouped_mm")  # traces fast
    for block in model.moe_blocks():  # experts 0 and 1 (EP rank 0 of 4) win every token
        block.router.expert_bias.zero_()
        block.router.expert_bias[:2] = 100.0
    return model


def test_tokens_per_rank_counts_contiguous_expert_groups():
    counts = [torch.tensor([5, 1, 0, 2, 3, 3, 0, 2]), torch.tensor([1] * 8)]
    assert tokens_per_rank(counts, 4).tolist() == [[6, 2, 6, 2], [2, 2, 2, 2]]
    assert tokens_per_rank(counts, 1).tolist() == [[16], [8]]
    with pytest.raises(ValueError, match="ep=3"):
        tokens_per_rank(counts, 3)


def test_skewed_router_counts():
    model = skewed_model()
    tokens, _ = batch(seq_len=16)
    per_rank = count_tokens_per_rank(model, tokens, ep=4)
    assert per_rank.tolist() == [[TOKENS * TOPK, 0, 0, 0]]
    assert count_tokens_per_rank(model, tokens, ep=1).tolist() == [[TOKENS * TOPK]]


def test_variant_plans():
    fast, slow = variant_plans(mx.Plan(recompute="norm,moe_light",
                                       moe=MoEOptions(adaptive_recompute_threshold=5)))
    assert (fast.recompute, slow.recompute) == ("norm", "norm,moe_light")
    assert fast.moe.adaptive_recompute_threshold is None
    assert variant_plans(mx.Plan(moe={"adaptive_recompute_threshold": 5}))[1].recompute == \
        "moe_full"


def test_switch_exactly_at_threshold_and_same_numerics(caplog):
    peak = TOKENS * TOPK
    args = batch(seq_len=16)
    results = {}
    for threshold, expected in ((peak, "fast"), (peak - 1, "recompute")):
        model = skewed_model()
        step = AdaptiveMoEStep(model, mx.Plan(moe=MoEOptions(
            adaptive_recompute_threshold=threshold)), ep=4)
        with caplog.at_level(logging.INFO, logger="mxgraph.adaptive"):
            loss = step(*args)
        decision = step.decisions[-1]
        assert decision["variant"] == expected and decision["max_tokens"] == peak
        assert expected in caplog.text and f"threshold {threshold}" in caplog.text
        assert all(len(s.executors()) == 1 for s in step.variants.values())  # both ahead
        results[expected] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.grad is not None})
    (loss_a, grads_a), (loss_b, grads_b) = results["fast"], results["recompute"]
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_compile_returns_the_adaptive_step():
    step = mx.compile(skewed_model(), mx.Plan(moe={"adaptive_recompute_threshold": 10}))
    assert isinstance(step, AdaptiveMoEStep) and step.ep == 1
