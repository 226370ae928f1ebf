"""Data parallelism in gradient buckets, and ZeRO-1, on gloo processes vs one process.

As `check_plan` in test_pipeline_exec.py: each rank builds the same model (same seed),
runs the compiled step on its share of the global batch and compares with eager autograd
on the whole global batch (accumulated over the same chunks). Tolerances: loss 1e-5
relative; gradients 1e-4 relative (to the gradient's norm, floored at 1e-3 of the largest
one); parameters after 3 AdamW steps 1e-4 (floored alike). Under ZeRO-1 the gradient
checked is this rank's flat shard, mapped slice by slice onto the parameters it covers,
and the parameters are the model's after `step.sync_parameters()`.
"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models
import mxgraph as mx
from mxgraph.runtime.data_parallel.buckets import MiB, build_buckets
from mxgraph.runtime.param_layout import ParamLayout
from tests.distributed import run_ranks
from tests.helpers import drift_tol, rel_err
from tests.runtime.test_pipeline_exec import assert_like_reference, floored_err, local

LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-4, 1e-4


def shard_slices(step, bucket):
    """(param, ref slice of the flat param, slice of this rank's shard) per parameter
    that overlaps this rank's shard of `bucket`."""
    rank = step.mesh.coords[bucket.axis]
    start, end = rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel
    for name, param, offset in zip(bucket.names, bucket.params, bucket.offsets, strict=True):
        lo, hi = max(start, offset), min(end, offset + param.numel())
        if lo < hi:
            yield name, param, slice(lo - offset, hi - offset), slice(lo - start, hi - start)


def check_grads(step, ref_params, i):
    scale = max(p.grad.norm().item() for p in ref_params.values() if p.grad is not None)
    buckets = step.data_parallel.buckets
    tol = drift_tol(GRAD_TOL, i, step.plan.codegen_for("cpu") == "inductor")
    if not step.plan.zero1:
        assert_like_reference(((n, p.grad, ref_params[n].grad, p) for b in buckets
                               for n, p in zip(b.names, b.params, strict=True)),
                              step, scale, tol, f"step {i} grad")
        return
    for bucket in buckets:
        assert all(p.grad is None for p in bucket.params), "zero1 left a model .grad"
        covered = 0
        for name, param, in_param, in_shard in shard_slices(step, bucket):
            ref = local(ref_params[name].grad, param, step, param).reshape(-1)[in_param]
            err = floored_err(bucket.shard.grad[in_shard], ref, scale)
            assert err <= tol, f"step {i} {name}[{in_param}]: grad error {err:.2e}"
            covered += in_shard.stop - in_shard.start
        assert not bucket.shard.grad[covered:].any(), "padding has a gradient"


def check_data_parallel(rank, world, model_name, plan_kwargs, steps=3, batch_size=8,
                        seq_len=16, model_kwargs=None, min_buckets=1, expert_axis=False):
    torch.manual_seed(0)
    model = models.build_model(model_name, **(model_kwargs or {}))
    for name, param in model.named_parameters():
        if name.endswith("attn.wk.bias"):  # softmax ignores it: its gradient is rounding noise
            param.requires_grad_(False)
    reference = copy.deepcopy(model)
    plan = mx.Plan(**plan_kwargs)
    step = mx.compile(model, plan)
    if expert_axis:  # ep = 1: "edp" is "dp", so the numbers stay the same
        step.layouts.update({n: ParamLayout(ep=True) for n, _ in model.named_parameters()
                             if "expert" in n})
    dp, dp_rank = step.mesh.sizes["dp"], step.mesh.coords["dp"]
    g = torch.Generator().manual_seed(1)
    opt = ref_opt = None
    for i in range(steps):
        tokens = torch.randint(0, 256, (batch_size * dp, seq_len), generator=g)
        targets = torch.randint(0, 256, (batch_size * dp, seq_len), generator=g)
        mine = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
        loss = step(tokens[mine], targets[mine])
        if opt is None:  # eps=1e-6: see check_plan
            opt = torch.optim.AdamW(step.parameters(), lr=1e-2, eps=1e-6)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
            check_layout(step, min_buckets, expert_axis)
        reference.zero_grad()
        chunks = dp * plan.micro_batches
        ref_loss = sum(reference(x, y) / chunks for x, y in
                       zip(tokens.chunk(chunks), targets.chunk(chunks), strict=True))
        ref_loss.backward()
        assert rel_err(loss, ref_loss) <= LOSS_TOL, (i, loss.item(), ref_loss.item())
        check_grads(step, dict(reference.named_parameters()), i)
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    step.sync_parameters()
    check_parameters(step, dict(reference.named_parameters()), steps)


def check_layout(step, min_buckets, expert_axis):
    buckets = step.data_parallel.buckets
    assert len(buckets) >= min_buckets, f"{len(buckets)} buckets, expected >= {min_buckets}"
    assert any(b.axis.startswith("edp") for b in buckets) == expert_axis
    assert all(b.axis.endswith("_cp") == (step.mesh.sizes["cp"] > 1) for b in buckets)
    if step.plan.zero1:
        names = [n for n, _ in step.named_parameters()]
        assert names == [f"zero1.bucket{i}" for i in range(len(buckets))]


def check_parameters(step, ref_params, steps):
    buckets = step.data_parallel.buckets
    scale = max(p.norm().item() for p in ref_params.values())
    assert_like_reference(((n, p, ref_params[n], p) for b in buckets for n, p in zip(b.names, b.params, strict=True)),
                          step, scale, drift_tol(PARAM_TOL, steps, step.plan.codegen_for("cpu") == "inductor"),
                          f"after {steps} steps")
    for bucket in buckets:
        if step.plan.zero1:  # the shard and the synced parameters agree exactly
            for _, param, in_param, in_shard in shard_slices(step, bucket):
                assert torch.equal(bucket.shard.detach()[in_shard],
                                   param.detach().reshape(-1)[in_param])


# ---- multi-process: the compiled step vs one process --------------------------------
def test_dp2_small_buckets_llama():
    run_ranks(2, check_data_parallel, "llama-tiny", dict(dp=2, bucket_mb=0.25), 3, 8, 16,
              None, 8)


def test_dp2_zero1_llama():
    run_ranks(2, check_data_parallel, "llama-tiny", dict(zero1=True, bucket_mb=0.5), 3, 8,
              16, None, 4)


def test_dp2_zero1_moe_expert_buckets():
    run_ranks(2, check_data_parallel, "moe-tiny", dict(zero1=True, bucket_mb=0.25), 2, 4, 16,
              dict(n_layers=2), 4, True)


def test_tp2_dp2_zero1_llama():
    run_ranks(4, check_data_parallel, "llama-tiny", dict(tp=2, zero1=True, bucket_mb=0.25),
              2, 4)


def test_pp2_dp2_zero1_gpt_tied_embeddings():
    run_ranks(4, check_data_parallel, "gpt-tiny",
              dict(pp=2, schedule="zbh1", micro_batches=2, zero1=True, bucket_mb=0.25), 2, 4)


def test_cp2_dp2_zero1_gpt():
    """Gradients reduce-scattered over dp x cp at once (a quarter of each bucket per rank):
    the same collective averages over dp and sums the sequence halves. (cp2 with dp = 1, the
    all-reduce over the cp pair: tests/passes/test_spmd.py.)"""
    run_ranks(4, check_data_parallel, "gpt-tiny", dict(cp=2, zero1=True, bucket_mb=0.25), 2, 4)


@settings(max_examples=1, deadline=None)
@given(dim=st.sampled_from([32, 48]), heads=st.sampled_from([2, 4]),
       kv_ratio=st.sampled_from([1, 2]), layers=st.integers(1, 2),
       seq=st.integers(5, 16), bucket_mb=st.sampled_from([0.01, 0.05, 25.0]))
def test_drawn_llama_configs_dp2_zero1(dim, heads, kv_ratio, layers, seq, bucket_mb):
    config = dict(dim=dim, n_heads=heads, n_kv_heads=heads // kv_ratio, n_layers=layers,
                  ffn_dim=2 * dim)
    run_ranks(2, check_data_parallel, "llama-tiny", dict(zero1=True, bucket_mb=bucket_mb),
              2, 4, seq, config)


# ---- one process ----------------------------------------------------------------------
def test_bucket_layout():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in
              enumerate([10, 300, 20, 30, 7])]
    params.append(("frozen", torch.nn.Parameter(torch.zeros(5), requires_grad=False)))
    experts = {id(params[1][1]), id(params[3][1])}
    buckets = build_buckets(params, experts, bucket_bytes=30 * 4,
                            group_sizes={"dp": 4, "edp": 2})
    # reverse order, experts apart; a bucket is closed when the next parameter would
    # pass 30 elements, and listed then; the open ones follow
    layout = [(b.axis, b.names, b.offsets, b.numel, b.padded_numel) for b in buckets]
    assert layout == [
        ("edp", ["p3"], [0], 30, 30),            # p1 would pass the cap
        ("dp", ["p4", "p2"], [0, 7], 27, 28),    # padded to a multiple of the group size
        ("dp", ["p0"], [0], 10, 12),
        ("edp", ["p1"], [0], 300, 300),          # over the cap alone: a bucket of its own
    ]
    assert [b.shard_numel for b in buckets] == [15, 7, 3, 150]
    one = build_buckets(params, set(), bucket_bytes=25 * MiB, group_sizes={"dp": 1, "edp": 1})
    assert [b.names for b in one] == [["p4", "p3", "p2", "p1", "p0"]]


def test_zero1_on_one_device_matches_eager():
    """dp = 1: the shards are whole buckets; the same updates as plain AdamW."""
    check_data_parallel(0, 1, "llama-tiny", dict(zero1=True, bucket_mb=0.5), 2, 4, 16,
                        None, 4)


def test_zero1_parameters_need_a_compiled_step():
    step = mx.compile(models.build_model("llama-tiny"), mx.Plan(zero1=True))
    with pytest.raises(mx.PlanError, match=r"call step.prepare\(\*batch\)"):
        list(step.parameters())


@pytest.mark.parametrize("bucket_mb", [0, -1.0])
def test_bucket_mb_must_be_positive(bucket_mb):
    with pytest.raises(mx.PlanError, match="bucket_mb"):
        mx.Plan(bucket_mb=bucket_mb)
