"""Hot-expert replication (`Plan.moe.hot_experts`, passes/sharding/ep_hot.py,
runtime/collectives/ep_hot.py) against eager references.

* Forced replication (hot_threshold=1.0: every step is "uneven enough"; hot_min_rows=0:
  no cost rule) on ep=2 (ep=4: tests/parallel/test_moe_combos.py): `check_plan`
  (tests/runtime/test_pipeline_exec.py) against eager autograd on the global batch: loss 1e-5,
  gradients 1e-4, parameters after 2 AdamW steps 1e-4. Replicas compute their rows with
  the owner's weights, and their weight gradients are summed back to the owner
  in another order than the owner alone would (fp32 rounding: the stated 1e-4 bound).
* Replication on vs off directly: losses within 1e-6 relative, gradients 1e-5.
* The switch: `decide` turns replication on at max/mean >= threshold and off only below
  0.9 x threshold (hysteresis); every step records its choice in Step.moe_stats()["hot"].
"""
import functools

import pytest
import torch

import models
import mxgraph as mx
from mxgraph.runtime.collectives.ep_hot import _State, decide
from tests.distributed import run_ranks
from tests.helpers import rel_err
from tests.runtime.test_pipeline_exec import check_plan


def _build(impl="grouped_mm"):
    torch.manual_seed(0)
    return models.build_model("moe-tiny", n_layers=2, expert_impl=impl, aux_loss_coef=0.0)


def _hf(family, experts=None):
    from mxgraph.hf.models import TINY, build_hf_model
    torch.manual_seed(0)
    return build_hf_model(f"hf:{family}", TINY[family] | (
        {"experts_implementation": experts} if experts else {}))


def _on_vs_off(rank, world, make, plan_kwargs):
    """Replication forced on vs off on the same batch: loss, gradients, and the record."""
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 256, (4, 16), generator=g) for _ in range(2))
    results = []
    for hot in (0, 1):
        step = mx.compile(make(), mx.Plan(**plan_kwargs, moe=dict(hot_experts=hot,
                                                                  hot_threshold=1.0, hot_min_rows=0)))
        loss = step(tokens[rank::world], targets[rank::world])
        results.append((loss, {n: p.grad for n, p in step.named_parameters()},
                        step.moe_stats()["hot"]))
    (off, off_grads, off_hot), (on, on_grads, on_hot) = results
    assert off_hot == {} and on_hot and all(len(v) == 1 for v in on_hot.values()), on_hot
    assert rel_err(on, off) <= 1e-6, (on.item(), off.item())
    for name, grad in on_grads.items():
        assert rel_err(grad, off_grads[name]) <= 1e-5, name


def _every_case(rank, world, cases):
    for kind, make, plan_kwargs in cases:
        try:
            if kind == "eager":
                check_plan(rank, world, make, dict(plan_kwargs, moe=dict(
                    hot_experts=1, hot_threshold=1.0, hot_min_rows=0)), steps=2)
            else:
                _on_vs_off(rank, world, make, plan_kwargs)
        except AssertionError as error:
            raise AssertionError(f"{kind} {plan_kwargs}: {error}") from error


def test_ep2_hot_experts():
    pytest.importorskip("transformers")
    run_ranks(2, _every_case, [("eager", _build, dict(ep=2)),
                               ("on-off", functools.partial(_hf, "mixtral", "batched_mm"), dict(ep=2)),
                               ("on-off", functools.partial(_hf, "qwen2_moe"), dict(ep=2))])


def test_hysteresis():
    """On at max/mean >= 1.5, kept on down to 0.9 x 1.5 = 1.35, off below, on again."""
    state = _State()
    even = torch.tensor([10, 10, 10, 10])
    skewed = torch.tensor([25, 5, 5, 5])      # max/mean 2.5
    mild = torch.tensor([14, 9, 9, 8])        # 1.4: between 1.35 and 1.5
    steps = [even, skewed, mild, mild, even, mild, skewed]
    picks = [decide(counts, 1, 1.5, state) for counts in steps]
    assert picks == [[], [0], [0], [0], [], [], [0]]
    assert decide(torch.tensor([1, 30, 2, 27]), 2, 1.0, _State()) == [1, 3]  # ascending
    # the cost rule: of the two hottest only those with >= min_rows rows
    assert decide(torch.tensor([1, 30, 2, 27]), 2, 1.0, _State(), min_rows=28) == [1]


def test_cost_rule():
    """moe-tiny's experts (3 x 64 x 128 fp32 = 96 KiB) vs rows of 128 fp32 (512 B): at
    ep=2 a row off the all-to-all saves 4 x 1/2 x 512 B, a replica costs 2 x 96 KiB."""
    from mxgraph.passes.sharding.ep_hot import cost_rule
    from tests.parallel.test_moe_blocks import _find
    _, blocks = _find(_build())
    assert cost_rule(blocks[0], blocks[0].rows, 2) == 2 * 3 * 64 * 128 * 4 // (4 * 512 // 2)


def test_hot_experts_must_leave_one_local_expert():
    from mxgraph.errors import PlanError
    from mxgraph.passes.sharding.ep_hot import check_hot
    from mxgraph.passes.sharding.moe_blocks import ExpertBlock
    sharder = type("S", (), {"hot": 2, "ep": 4})()
    block = ExpertBlock("grouped", 8, [], gemms=[torch.fx.Graph().placeholder("x")])
    with pytest.raises(PlanError, match=r"less than the experts per EP rank .*0\.\.1"):
        check_hot(sharder, block)
