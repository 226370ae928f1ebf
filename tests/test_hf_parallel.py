"""Hugging Face transformers models (tiny configs, random init: `mxgraph.hf.TINY`) under the
parallel layouts, each rank against the single-process model (`test_pipeline_exec.
check_plan`, README order: the optimizer on step.parameters() right after mx.compile):
loss 1e-5 relative, gradients 1e-4 after each step, parameters 1e-4 after 3 AdamW steps,
fp32. `strict_sharding=True` on every layout the sharding passes handle (no op may fall
back to a gather; under SP and CP the MoE families route their own tokens,
passes/sharding_local.py). Several layouts per launch: process start-up and tracing
dominate. Expert parallelism of the MoE families:
tests/test_hf_expert_parallel.py."""
import functools

import pytest

from mxgraph.hf import TINY, build_hf_model
from tests.distributed import run_ranks
from tests.test_pipeline_exec import check_plan

STRICT = dict(strict_sharding=True)
TWO_RANKS = [dict(tp=2, **STRICT), dict(tp=2, sequence_parallel=True, **STRICT),
             dict(dp=2, bucket_mb=0.05), dict(zero1=True, bucket_mb=0.05), dict(cp=2, **STRICT),
             dict(pp=2, micro_batches=2)]
FOUR_RANKS = [dict(tp=2, dp=2, **STRICT), dict(cp=2, tp=2, sequence_parallel=True, **STRICT),
              dict(pp=2, tp=2, micro_batches=2, **STRICT),
              dict(pp=2, dp=2, zero1=True, micro_batches=2, bucket_mb=0.05)]


def builder(family: str):
    return functools.partial(build_hf_model, f"hf:{family}", TINY[family])


def check_layouts(rank, world, family, layouts, lr):
    for plan in layouts:
        try:
            check_plan(rank, world, builder(family), plan, steps=3, batch_size=4, seq_len=16,
                       lr=lr)
        except AssertionError as error:
            raise AssertionError(f"{family} {plan}: {error}") from error


LR = {"llama": 1e-2, "gpt2": 1e-3}
"""GPT-2 at 1e-3: its fused c_attn bias holds the key bias, whose gradient is zero in exact
arithmetic (softmax ignores it), so rounding noise, which AdamW scales to lr-sized steps
(check_plan freezes such a bias where it is a parameter of its own, `attn.wk.bias`)."""


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dense_two_ranks(family):
    run_ranks(2, check_layouts, family, TWO_RANKS, LR[family])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dense_four_ranks(family):
    layouts = FOUR_RANKS if family == "llama" else FOUR_RANKS[2:3]  # GPT-2: pp x tp
    run_ranks(4, check_layouts, family, layouts, LR[family])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_two_ranks(family):
    # lr 1e-3, as the presets' MoE tests: at 1e-2 AdamW turns rounding into another top-k
    run_ranks(2, check_layouts, family, TWO_RANKS, 1e-3)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_four_ranks(family):
    layouts = FOUR_RANKS if family == "mixtral" else FOUR_RANKS[1:2]  # Qwen2: cp x tp + SP
    run_ranks(4, check_layouts, family, layouts, 1e-3)
