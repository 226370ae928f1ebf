"""Overlap on vs off (`Plan(overlap=True)`: async collectives reordered, buckets reduced
during the backward, ZeRO-1 gathers during the forward, pipeline receives posted ahead) on
gloo ranks: loss, gradients after the first step and parameters after two AdamW steps
bitwise equal (`torch.equal`, tests/overlap_checks.py); chunked TP GEMMs within the bound
of `CHUNKED`; on the presets and Hugging Face models, per layout. Each case
also checks that the overlap ran: functional starts and waits in the programs, buckets
started in the backward, F&B pairs handing over at waits, transfers on the copy-engine
lane. One launch per world size; the cases cover each part once (suite time): the pipeline
transfers alone (p2p on vs off) under 1f1b, zbh1 and dualpipev are
tests/runtime/test_pipeline_p2p.py's, MoE is Qwen2-MoE's tp x dp, GPT is Hugging Face GPT-2."""
import functools

import pytest

from mxgraph.hf.models import TINY, build_hf_model
from tests.distributed import run_ranks
from tests.overlap_checks import compare


def hf(family):
    return functools.partial(build_hf_model, f"hf:{family}", TINY[family])


TWO_RANKS = [
    ("llama-tiny", dict(dp=2, micro_batches=2, bucket_mb=0.05), True, 2),
    # ZeRO-1 through the copy-engine lane: reduce-scatters and gathers on a worker thread
    ("llama-tiny", dict(dp=2, zero1=True, bucket_mb=0.05), {"copy_engine": True}, 2),
    ("llama-tiny", dict(tp=2, sequence_parallel=True), True, 1),
    ("llama-tiny", dict(cp=2), True, 1),
    (hf("llama"), dict(tp=2, sequence_parallel=True), True, 1),
    (hf("gpt2"), dict(dp=2, zero1=True, bucket_mb=0.05), True, 2),  # tied embeddings
]
FOUR_RANKS = [
    ("llama-tiny", dict(tp=2, pp=2, micro_batches=4, sequence_parallel=True,
                        schedule="dualpipev"), True, 1),
    (hf("qwen2_moe"), dict(tp=2, dp=2, zero1=True, bucket_mb=0.05), True, 2),
]
CHUNKED = [(hf("llama"), 4)]
"""Chunked TP GEMMs (`overlap.tp_chunks`) under tp2+SP: row blocks round differently, so
loss and gradients within 1e-5 relative, parameters after two AdamW steps within 1e-4."""


def _cases(rank, world, cases):
    for name, plan, overlap, dp in cases:
        compare(rank, name, plan, overlap, dp=dp)
    if world == 2:
        for name, chunks in CHUNKED:
            compare(rank, name, dict(tp=2, sequence_parallel=True), {"tp_chunks": chunks},
                    tol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_overlap_is_bitwise_equal_to_overlap_off(world):
    run_ranks(world, _cases, TWO_RANKS if world == 2 else FOUR_RANKS)
