"""Hugging Face transformers models (tiny configs, random init: `mxgraph.hf.TINY`) under the
parallel layouts, each rank against the single-process model (`test_pipeline_exec.
check_plan`, README order: the optimizer on step.parameters() right after mx.compile):
loss 1e-5 relative, gradients 1e-4 after each step, parameters 1e-4 after 3 AdamW steps,
fp32. `strict_sharding=True` on every layout the sharding passes handle (no op may fall
back to a gather; under SP and CP the MoE families route their own tokens,
passes/sharding/token_local.py). One launch per world size runs every family's layouts: process
start-up and tracing dominate. Plain dp (buckets, no model structure involved) runs on
Llama; zero1 (dp=2 with sharded optimizer state) on every family. Expert parallelism of the MoE families:
tests/parallel/test_hf_expert_parallel.py."""
import functools

import pytest

from mxgraph.hf.models import TINY, build_hf_model
from tests.distributed import run_ranks
from tests.runtime.test_pipeline_exec import check_plan

STRICT = dict(strict_sharding=True)
DP = dict(dp=2, bucket_mb=0.05)
TWO_RANKS = [dict(tp=2, **STRICT), dict(tp=2, sequence_parallel=True, **STRICT),
             dict(zero1=True, bucket_mb=0.05), dict(cp=2, **STRICT), dict(pp=2, micro_batches=2)]
FOUR_RANKS = [dict(tp=2, dp=2, **STRICT), dict(cp=2, tp=2, sequence_parallel=True, **STRICT),
              dict(pp=2, tp=2, micro_batches=2, **STRICT),
              dict(pp=2, dp=2, zero1=True, micro_batches=2, bucket_mb=0.05)]


def builder(family: str):
    return functools.partial(build_hf_model, f"hf:{family}", TINY[family])


LR = {"llama": 1e-2, "gpt2": 1e-3, "mixtral": 1e-3, "qwen2_moe": 1e-3}
"""GPT-2 at 1e-3: its fused c_attn bias holds the key bias, whose gradient is zero in exact
arithmetic (softmax ignores it), so rounding noise, which AdamW scales to lr-sized steps
(check_plan freezes such a bias where it is a parameter of its own, `attn.wk.bias`). The
MoE families at 1e-3, as the presets' MoE tests: at 1e-2 AdamW turns rounding into another
top-k choice for some token."""
DENSE = ("llama", "gpt2")
CASES = {2: [(family, plan) for family in LR for plan in TWO_RANKS
             if family in DENSE or "pp" not in plan] + [("llama", DP)],
         4: [("llama", plan) for plan in FOUR_RANKS] + [("gpt2", FOUR_RANKS[2])] +
            [("mixtral", FOUR_RANKS[1]), ("mixtral", FOUR_RANKS[3]), ("qwen2_moe", FOUR_RANKS[1])]}
"""Per world size, (family, plan): every layout on Llama; GPT-2 (Conv1D, fused c_attn, tied
embeddings) and the MoE families on those where their structure meets the passes (pipeline
stages of MoE blocks: mixtral's pp x dp + zero1; tp x dp, pp x tp: Llama's)."""


def check_cases(rank, world, cases):
    for family, plan in cases:
        try:
            check_plan(rank, world, builder(family), plan, steps=3, batch_size=4, seq_len=16,
                       lr=LR[family])
        except AssertionError as error:
            raise AssertionError(f"{family} {plan}: {error}") from error


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_family_and_layout(world):
    run_ranks(world, check_cases, CASES[world])
