"""Overlap on vs off (`Plan(overlap=True)`: async collectives reordered, buckets reduced
during the backward, ZeRO-1 gathers during the forward, pipeline receives posted ahead) on
gloo ranks: loss, gradients after the first step and parameters after two AdamW steps
bitwise equal (`torch.equal`, tests/overlap_checks.py); chunked TP GEMMs within the bound
of `CHUNKED`; on the presets and Hugging Face models, per layout. Each case
also checks that the overlap ran: functional starts and waits in the programs, buckets
started in the backward. One launch per world size. The pipeline transfers alone (p2p on
vs off) under 1f1b, zbh1 and dualpipev: tests/test_pipeline_p2p.py; GPT's Conv1D layout
here is Hugging Face GPT-2's."""
import functools

import pytest

from mxgraph.hf import TINY, build_hf_model
from tests.distributed import run_ranks
from tests.overlap_checks import compare

MOE = dict(expert_impl="grouped_mm", n_layers=2)
PP = dict(pp=2, micro_batches=4)


def hf(family):
    return functools.partial(build_hf_model, f"hf:{family}", TINY[family])


TWO_RANKS = [
    ("llama-tiny", dict(dp=2, micro_batches=2, bucket_mb=0.05), {}, 2),
    ("llama-tiny", dict(dp=2, zero1=True, bucket_mb=0.05), {}, 2),
    ("llama-tiny", dict(tp=2, sequence_parallel=True), {}, 1),
    ("llama-tiny", dict(cp=2), {}, 1),
    ("llama-tiny", dict(PP, schedule="dualpipev"), {}, 1),
    ("moe-tiny", dict(tp=2, sequence_parallel=True), MOE, 1),
    (hf("llama"), dict(tp=2, sequence_parallel=True), {}, 1),
    (hf("gpt2"), dict(dp=2, zero1=True, bucket_mb=0.05), {}, 2),
    (hf("mixtral"), dict(cp=2), {}, 1),
]
FOUR_RANKS = [
    ("llama-tiny", dict(tp=2, pp=2, micro_batches=4, sequence_parallel=True,
                        schedule="dualpipev"), {}, 1),
    (hf("qwen2_moe"), dict(tp=2, dp=2, zero1=True, bucket_mb=0.05), {}, 2),
]


CHUNKED = [("llama-tiny", 2), (hf("llama"), 4)]
"""Chunked TP GEMMs (`overlap.tp_chunks`) under tp2+SP: row blocks round differently, so
loss and gradients within 1e-5 relative, parameters after two AdamW steps within 1e-4."""


def _cases(rank, world, cases):
    for name, plan, model_kwargs, dp in cases:
        compare(rank, name, plan, True, model_kwargs=model_kwargs, dp=dp)
    if world == 2:  # copy-engine mode: the buckets' and gathers' transfers on a thread
        compare(rank, "llama-tiny", dict(dp=2, zero1=True, bucket_mb=0.05),
                {"copy_engine": True}, dp=2)
        for name, chunks in CHUNKED:
            compare(rank, name, dict(tp=2, sequence_parallel=True), {"tp_chunks": chunks},
                    tol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_is_bitwise_equal_to_overlap_off(world):
    run_ranks(world, _cases, TWO_RANKS if world == 2 else FOUR_RANKS)
