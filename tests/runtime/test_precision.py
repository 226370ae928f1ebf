"""bf16-mixed training (runtime/precision.py) against a hand-written reference, and what each
precision holds against the memory estimate.

The reference of an AdamW step: the bf16 gradients of the same compiled graph (a step of a
bf16 twin under `Plan()`, pure bf16: bitwise the gradients the mixed step's programs
produce), averaged in fp32 over the data-parallel halves, clipped by their fp32 norm, then
`torch.optim.AdamW` on an fp32 copy of the weights, cast back to bf16. Tolerance on the
masters: 1e-6 relative (fp32; in fact equal: the same operations in the same order, but
for the fp64 sum of the norm over ZeRO-1's shards); the bf16 parameters must equal the
masters rounded (torch.equal).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import models
import mxgraph as mx
from benchmarks.bench_precision import state_bytes
from mxgraph import memory_plan
from mxgraph.errors import PlanError, UserError
from mxgraph.memory_plan import LayerActivations, estimate_memory
from mxgraph.runtime.checkpoint.flash import FlashCheckpointer
from mxgraph.train.checkpoints import apply, capture
from mxgraph.train.precision import plan_with_precision
from tests.distributed import run_ranks
from tests.helpers import batch, rel_err

ADAMW = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
STEPS = 3
TOL = 1e-6


SIZES = dict(n_layers=1, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=128)
"""llama-tiny (the library's defaults) with its sizes shrunk."""


def tiny_model():
    torch.manual_seed(0)
    return models.build_model("llama-tiny", **SIZES)


class Reference:
    """fp32 masters updated by torch's AdamW from the bf16 gradients of a pure-bf16 step."""

    def __init__(self, model):
        self.model = copy.deepcopy(model)
        models.common.cast_params_(self.model, torch.bfloat16)
        self.step = mx.compile(self.model, mx.Plan())
        self.masters = {n: p.detach().float().clone().requires_grad_()
                        for n, p in self.model.named_parameters()}
        self.optimizer = torch.optim.AdamW(self.masters.values(), **ADAMW)

    def update(self, halves) -> None:
        """One step on the mean of `halves`' gradients (each half: one dp rank's batch)."""
        grads = {}
        for half in halves:
            self.step(*half)
            for name, param in self.model.named_parameters():
                grads[name] = grads.get(name, 0) + param.grad.float()
                param.grad = None
        for name, master in self.masters.items():
            master.grad = grads[name] / len(halves)
        clip_(list(self.masters.values()), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(self.masters[name])


def clip_(params, max_norm: float) -> None:
    """`torch.nn.utils.clip_grad_norm_` with the squares summed in fp64 (as mxgraph sums them:
    torch's fp32 sum differs in the last bit, and a last-bit change of a master can round its
    bf16 parameter the other way, which later steps amplify)."""
    norm = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
                        for p in params]).sum().sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale.to(p.grad.dtype))


def batches(seed: int, halves: int):
    return [batch(seq_len=16, seed=10 * seed + h) for h in range(halves)]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_bf16_mixed_adamw_steps_equal_the_fp32_master_reference(micro_batches):
    """With 2 micro-batches the reference averages each one's bf16 gradients in fp32 (what
    fp32 accumulation gives; a bf16 sum would round after each add)."""
    model = tiny_model()
    reference = Reference(model)
    plan = mx.Plan(precision="bf16-mixed", micro_batches=micro_batches)
    step = mx.compile(model, plan, example=batch(seq_len=16))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    optimizer = torch.optim.AdamW(step.parameters(), **ADAMW)
    eager = copy.deepcopy(reference.model)
    for i in range(STEPS):
        args, = batches(i, 1)
        halves = [tuple(t.chunk(micro_batches)[m] for t in args) for m in range(micro_batches)]
        if i == 0:  # the loss is fp32, the bf16 model's (bf16 tolerance: other kernels)
            loss = step(*args)
            assert loss.dtype == torch.float32
            assert rel_err(loss, eager(*args).detach()) < 1e-2
        else:
            step(*args)
        assert all(p.grad is None for p in model.parameters())
        assert all(p.grad.dtype == torch.float32 for p in step.parameters())
        step.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        reference.update(halves)
        for name, master in step.named_parameters():
            assert master.dtype == torch.float32
            assert rel_err(master, reference.masters[name]) <= TOL, (i, name)
    step.sync_parameters()
    masters = dict(step.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, masters[name].to(torch.bfloat16)), name


def _dp2(rank, world, path, example):
    """dp2 bf16-mixed steps with and without ZeRO-1; rank 0 saves the masters (the fp32
    shards gathered and unflattened under zero1) and the bf16 parameters."""
    saved = {}
    for zero1 in (True, False):
        model = tiny_model()
        plan = mx.Plan(dp=2, zero1=zero1, precision="bf16-mixed")
        step = mx.compile(model, plan, example=example)
        optimizer = torch.optim.AdamW(step.parameters(), **ADAMW)
        for i in range(STEPS):
            step(*batches(i, 2)[rank])
            step.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
        step.sync_parameters()
        masters = {} if zero1 else {n: p.detach().clone() for n, p in step.named_parameters()}
        for bucket in step.data_parallel.buckets if zero1 else ():
            assert bucket.shard.dtype == torch.float32
            flat = bucket.shard.new_empty(bucket.padded_numel)
            torch.distributed.all_gather_into_tensor(flat, bucket.shard.detach())
            for name, (_, view) in zip(bucket.names, bucket.views(flat), strict=True):
                masters[name] = view.clone()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        saved[f"zero1={zero1}"] = {"masters": masters, "params": params}
    if rank == 0:
        torch.save(saved, path)


@pytest.mark.slow
def test_dp2_bf16_mixed_with_and_without_zero1_equals_the_single_process_reference(tmp_path):
    reference = Reference(tiny_model())
    for i in range(STEPS):
        reference.update(batches(i, 2))
    path = str(tmp_path / "rank0.pt")
    run_ranks(2, _dp2, path, batch(seq_len=16))
    for layout, got in torch.load(path).items():
        assert got["masters"].keys() == reference.masters.keys(), layout
        for name, master in reference.masters.items():
            assert rel_err(got["masters"][name], master) <= TOL, (layout, name)
            assert torch.equal(got["params"][name], got["masters"][name].to(torch.bfloat16)), \
                (layout, name)


def test_bf16_mixed_checkpoint_round_trip_resumes_exactly(tmp_path):
    """A flash checkpoint (train_state.capture/apply, as `mxgraph train` saves and resumes)
    of a bf16-mixed run after 2 steps, restored into a fresh compiled step and optimizer:
    2 more steps give masters torch.equal to 4 uninterrupted steps (and bf16 parameters)."""
    plan = mx.Plan(precision="bf16-mixed")

    def fresh():
        model = tiny_model()
        step = mx.compile(model, plan, example=batch(seq_len=16))
        return model, step, torch.optim.AdamW(step.parameters(), **ADAMW)

    def run(step, optimizer, steps):
        for i in steps:
            step(*batches(i, 1)[0])
            step.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()

    model, step, optimizer = fresh()
    named = dict(step.named_parameters())
    checkpointer = FlashCheckpointer(str(tmp_path), run_id=f"mixed-{tmp_path.name}")
    try:
        run(step, optimizer, range(2))
        checkpointer.save(2, capture(plan, named, optimizer, {"step": 2}), background=False)
        run(step, optimizer, range(2, 4))
        model2, step2, optimizer2 = fresh()
        named2 = dict(step2.named_parameters())
        restored = checkpointer.restore(into=capture(plan, named2, optimizer2))
        assert restored.step == 2
        apply(restored.state, named2, optimizer2)
        run(step2, optimizer2, range(2, 4))
    finally:
        checkpointer.close()
    step.sync_parameters()
    step2.sync_parameters()
    for name, master in named.items():
        assert master.dtype == torch.float32
        assert torch.equal(named2[name], master), name
    for (name, param), param2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(param2, param), name


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_estimated_bytes_per_parameter_are_the_tensors_held(precision, monkeypatch):
    """params + grads + masters + AdamW moments after a step and an update, tensor by
    tensor, against `estimate_memory`'s params, grads and optimizer (exact). The saved
    activations are not under test here (tests/test_memory_plan.py measures them): their
    two traces are replaced by zeros, so the test costs one compile per precision."""
    monkeypatch.setattr(memory_plan, "trace_layer_activations",
                        lambda *args, **kwargs: LayerActivations(0, 0, 0, 0, 0, 0.0, 0))
    model = tiny_model()
    args = batch(seq_len=16)
    step = mx.compile(model, mx.Plan(precision=precision), example=args)
    optimizer = torch.optim.AdamW(step.parameters(), **ADAMW)
    step(*args)
    step.clip_grad_norm_(1.0)
    optimizer.step()
    held = state_bytes(step, optimizer)
    config = dataclasses.replace(models.preset_config("llama-tiny"), **SIZES)
    stage, = estimate_memory(config, mx.Plan(precision=precision), seq_len=16)
    assert stage.params == held["params"]
    assert stage.grads == held["grads"]
    assert stage.optimizer == held["master"] + held["optimizer"]


def test_precision_flags_and_plan_disagreeing_are_one_line_errors():
    assert plan_with_precision(mx.Plan(), None, None).precision == "fp32"
    assert plan_with_precision(mx.Plan(), None, "bfloat16").precision == "bf16"
    assert plan_with_precision(mx.Plan(precision="bf16-mixed"), None, None).precision == \
        "bf16-mixed"
    for flags, words in (((None, "bf16-mixed", "bfloat16"), "--dtype bfloat16 means"),
                         ((None, "fp16", None), "--precision fp16 is unknown"),
                         ((mx.Plan(precision="bf16"), "fp32", None), "sets precision"),
                         ((None, "bf16-mixed", None, True), "drop --eager")):
        plan, *rest = flags
        with pytest.raises(UserError, match=words):
            plan_with_precision(plan or mx.Plan(), *rest)
    with pytest.raises(PlanError, match="precision"):
        mx.Plan(precision="mixed")
    with pytest.raises(PlanError, match="runs on torch.bfloat16"):
        estimate_memory("llama-tiny", mx.Plan(precision="bf16-mixed"), dtype=torch.float32)


def test_cli_disagreeing_flags_are_one_line_with_status_2(capfd):
    """`mxgraph train --precision bf16-mixed --dtype bfloat16`: exit 2, one line, before
    anything is built."""
    from mxgraph.cli.main import main
    assert main(["train", "--precision", "bf16-mixed", "--dtype", "bfloat16"]) == 2
    out = capfd.readouterr()
    assert out.out == ""
    assert out.err == ("mxgraph: error: --dtype bfloat16 means --precision bf16, but --precision "
                       "bf16-mixed was given; drop --dtype (--precision replaces it)\n")


def test_bf16_mixed_nonfinite_skip_equals_leaving_the_batches_out(tmp_path, monkeypatch):
    """The non-finite guard under bf16-mixed (tests/runtime/test_health.py's drill): NaN written into
    the (fp32 master) gradient of batches 2 and 3 with --on-nonfinite skip gives the run
    that never trains on them, bitwise: bf16 parameters and fp32 masters."""
    from tests.runtime.test_health import _drill, _same
    plan = tmp_path / "mixed.toml"
    plan.write_text('precision = "bf16-mixed"\n')
    sizes = ",".join(f"{k}={v}" for k, v in SIZES.items())
    reference = _drill(monkeypatch, drop="2,3", plan=str(plan), model_config=sizes)
    skipped = _drill(monkeypatch, nan="2,3", on_nonfinite="skip", plan=str(plan),
                     model_config=sizes)
    assert skipped["skipped"] == 2
    _same(skipped, reference)
    for name, master in reference["optimized"].items():
        assert master.dtype == torch.float32
        assert torch.equal(skipped["optimized"][name], master), name
