"""`Step.clip_grad_norm_` vs `torch.nn.utils.clip_grad_norm_` on the single-process model.

Every rank's returned norm must equal the eager model's whole-gradient norm (1e-5 relative),
and its clipped gradients the eager clipped gradients (its local part, 1e-4 as in
tests/runtime/test_pipeline_exec.py). The layouts cover each kind of copy the norm must count once:
TP-replicated parameters, a tied weight on two pipeline stages, ZeRO-1 shards, expert shards.
"""
import copy

import torch

import models
import mxgraph as mx
from tests.distributed import run_ranks
from tests.helpers import batch, rel_err
from tests.runtime.test_data_parallel import shard_slices
from tests.runtime.test_pipeline_exec import GRAD_TOL, assert_like_reference, largest_norm, local

MAX_NORM = 0.05  # below every case's norm, so the gradients are scaled


def _eager_clipped(reference, tokens, targets, chunks: int) -> float:
    loss = sum(reference(x, y) / chunks for x, y in zip(tokens.chunk(chunks), targets.chunk(chunks), strict=True))
    loss.backward()
    return torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()


def check_clip(rank, world, model_name, plan_kwargs, model_kwargs=None):
    torch.manual_seed(0)
    model = models.build_model(model_name, **(model_kwargs or {}))
    reference = copy.deepcopy(model)
    step = mx.compile(model, mx.Plan(**plan_kwargs))
    dp, dp_rank = step.mesh.sizes["dp"], step.mesh.coords["dp"]
    tokens, targets = batch(vocab=model.config.vocab_size, batch_size=4 * dp, seq_len=16)
    mine = slice(dp_rank * 4, (dp_rank + 1) * 4)
    step(tokens[mine], targets[mine])
    norm = step.clip_grad_norm_(MAX_NORM)
    expected = _eager_clipped(reference, tokens, targets, dp * step.plan.micro_batches)
    assert rel_err(norm, torch.tensor(expected)) <= 1e-5, (norm.item(), expected)
    assert norm.item() > MAX_NORM
    ref_params, scale = dict(reference.named_parameters()), largest_norm(reference, "grad")
    if not step.plan.zero1:
        assert_like_reference(((n, p.grad, ref_params[n].grad, p) for n, p in step.model_parameters()),
                              step, scale, GRAD_TOL, "clipped grad")
        return
    for bucket in step.data_parallel.buckets:
        for name, param, in_param, in_shard in shard_slices(step, bucket):
            ref = local(ref_params[name].grad, param, step, param).reshape(-1)[in_param]
            assert rel_err(bucket.shard.grad[in_shard], ref) <= GRAD_TOL, name


def check_cases(rank, world, cases):
    for args in cases:
        check_clip(rank, world, *args)


def test_one_device_equals_torch():
    check_clip(0, 1, "llama-tiny", {})


def test_tp_pp_zero1_layouts():
    run_ranks(4, check_cases, [("gpt-tiny", dict(tp=2, pp=2, micro_batches=2), dict(n_layers=2)),  # tied wte
                               ("llama-tiny", dict(tp=2, zero1=True, bucket_mb=0.25), dict(n_layers=2))])


def test_expert_shards():
    run_ranks(2, check_cases, [("moe-tiny", dict(ep=2), dict(n_layers=2, expert_impl="grouped_mm"))])
