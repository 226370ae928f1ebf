"""The MoE options on 4 gloo ranks, alone at ep=4 and combined with tp, pp, a recompute
level and each other, against eager autograd on the global batch
(`check_plan`, tests/runtime/test_pipeline_exec.py: loss 1e-5, gradients 1e-4, parameters after
2 AdamW steps 1e-4). Capacity rows compare with the eager model computing the same drops
(tests/passes/test_moe_capacity.py's reference); hot experts are forced on (hot_threshold=1.0,
hot_min_rows=0).
One set of processes runs every case (start-up and tracing dominate).
"""
from tests.distributed import run_ranks
from tests.passes.test_moe_capacity import _build, _with_capacity
from tests.runtime.test_pipeline_exec import check_plan

CAPACITY = dict(capacity_factor=1.0)
HOT = dict(hot_experts=1, hot_threshold=1.0, hot_min_rows=0)
# (name, plan fields, capacity factor of the reference or None); lr 1e-3 under tp (see
# tests/parallel/test_expert_parallel.py)
CASES = [("ep4 hot", dict(ep=4, moe=HOT), None),
         ("tp2 x ep2, capacity bmm + a2a overlap", dict(tp=2, ep=2, overlap=True, moe=dict(
             CAPACITY, batched_gemm=True, a2a_overlap=True)), 1.0),
         ("pp2 x ep2, moe_full recompute, hot", dict(pp=2, ep=2, recompute="moe_full",
                                                     moe=HOT), None)]

def _every_case(rank, world):
    for name, plan_kwargs, factor in CASES:
        try:
            check_plan(rank, world, _build, plan_kwargs, steps=2, lr=1e-3,
                       adjust_reference=_with_capacity(factor, "probs") if factor else None)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


def test_moe_options_on_four_ranks():
    run_ranks(4, _every_case)
