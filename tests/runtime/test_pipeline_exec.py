"""Pipeline (and data-parallel) execution on gloo processes vs the single-process model.

Each rank builds the same model (same seed), runs the compiled step on its share, and
compares the loss and the gradients of the parameters it owns with eager autograd on
the whole global batch (accumulated over the same micro-batches). Tolerances: loss 1e-5
relative, gradients 1e-4 relative (fp32), parameters after 3 AdamW steps 1e-4 (gradients
after the first step and parameters 4x wider under MXGRAPH_CODEGEN=inductor:
`tests.helpers.drift_tol`).
"""
import copy
import functools

import pytest
import torch

import models
import mxgraph as mx
from tests.distributed import run_ranks
from tests.helpers import drift_tol, rel_err

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def local(reference: torch.Tensor, mine: torch.Tensor, step, param=None) -> torch.Tensor:
    """This rank's part of a reference tensor (the tensor itself when unsharded): a
    parameter's (or its gradient's) cut as the step laid the parameter out (`step.layouts`:
    TP dim and blocks, experts over ep)."""
    for name, p in step.model.named_parameters(remove_duplicate=False):
        if p is param or p is mine or (p.grad is not None and p.grad is mine):
            layout = step.layouts.get(name)
            return reference if layout is None else \
                layout.shard(reference, step.mesh.sizes, step.mesh.coords)
    for dim, (full, part) in enumerate(zip(reference.shape, mine.shape, strict=True)):
        if full != part:
            return reference.chunk(full // part, dim)[step.mesh.coords["tp"]]
    return reference


def floored_err(mine: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    """Relative to the reference's norm, floored at 1e-3 of `scale` (the largest norm of its
    kind) so that mathematically-zero gradients compare as absolute noise."""
    return ((mine - ref).norm() / max(ref.norm().item(), 1e-3 * scale)).item()


def largest_norm(model, attr: str | None = None) -> float:
    """The largest norm of the model's parameters (or of their `.grad`s)."""
    tensors = (getattr(p, attr) if attr else p for p in model.parameters())
    return max(t.norm().item() for t in tensors if t is not None)


def assert_like_reference(rows, step, scale: float, tol: float, what: str) -> None:
    """`rows`: (name, this rank's tensor, the reference's full tensor, parameter); each within
    `tol` (`floored_err`; `scale`: the largest norm over the whole reference model) of the
    reference's local part."""
    rows = list(rows)
    assert rows, f"{what}: this rank owns no parameters"
    for name, mine, full, param in rows:
        err = floored_err(mine, local(full, mine, step, param), scale)
        assert err <= tol, f"{what} {name}: error {err:.2e}"


def check_plan(rank, world, model_name, plan_kwargs, steps=3, batch_size=8, seq_len=16,
               model_kwargs=None, lr=1e-2, adjust_reference=None):
    """`model_name`: a preset name, or a callable(**model_kwargs) building the model;
    `adjust_reference(model)`: changes the eager reference (e.g. the drops a plan's
    capacity makes, written as the model's own capacity)."""
    torch.manual_seed(0)
    build = model_name if callable(model_name) else functools.partial(models.build_model,
                                                                      model_name)
    model = build(**(model_kwargs or {}))
    for name, param in model.named_parameters():
        if name.endswith("attn.wk.bias"):  # softmax ignores it: its gradient is exactly 0
            param.requires_grad_(False)    # in exact arithmetic, rounding noise in fp32
    reference = copy.deepcopy(model)
    if adjust_reference is not None:
        adjust_reference(reference)
    plan = mx.Plan(**plan_kwargs)
    inductor = plan.codegen_for("cpu") == "inductor"  # drift_tol's widening
    dp = plan.resolve_dp(world)
    dp_rank = (rank // (plan.tp * plan.cp)) % dp  # the mesh's order: pp, dp, cp, tp
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (batch_size * dp, seq_len), generator=g),
                torch.randint(0, 256, (batch_size * dp, seq_len), generator=g))
               for _ in range(steps)]
    mine = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
    # the README's order: the optimizer on step.parameters() right after mx.compile (an
    # example batch only where the parameters need the graph: pipeline stages, ZeRO-1)
    needs_graph = plan.pp > 1 or plan.zero1
    example = (batches[0][0][mine], batches[0][1][mine]) if needs_graph else None
    step = mx.compile(model, plan, example=example)
    assert step.mesh.coords["dp"] == dp_rank
    # eps=1e-6: some gradients are mathematically zero (a key bias under softmax) and are
    # pure rounding noise; Adam's default eps turns noise into full steps.
    opt = torch.optim.AdamW(step.parameters(), lr=lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    for i, (tokens, targets) in enumerate(batches):
        loss = step(tokens[mine], targets[mine])
        reference.zero_grad()
        # eager autograd over the same micro-batches of the global batch, accumulated
        # (Adam amplifies reduction-order noise in near-zero gradients otherwise)
        chunks = dp * plan.micro_batches
        ref_loss = sum(reference(x, y) / chunks for x, y in
                       zip(tokens.chunk(chunks), targets.chunk(chunks), strict=True))
        ref_loss.backward()
        assert rel_err(loss, ref_loss) <= LOSS_TOL, (i, loss.item(), ref_loss.item())
        ref_params = dict(reference.named_parameters())
        if plan.zero1:  # the gradients are in this rank's flat shards
            from tests.runtime.test_data_parallel import check_grads
            check_grads(step, ref_params, i)
        else:
            assert_like_reference(((n, p.grad, ref_params[n].grad, p)
                                   for n, p in step.named_parameters() if p.requires_grad),
                                  step, largest_norm(reference, "grad"), drift_tol(GRAD_TOL, i, inductor),
                                  f"step {i} grad")
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    step.sync_parameters()  # zero1: the last update is in the shards
    ref_params = dict(reference.named_parameters())
    assert_like_reference(((n, p, ref_params[n], p) for n, p in step.model_parameters()), step,
                          largest_norm(reference), drift_tol(GRAD_TOL, steps, inductor),
                          f"after {steps} steps")


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("dualpipev", 1)]


@pytest.mark.parametrize("schedule, vpp", SCHEDULES)
@pytest.mark.parametrize("model_name", ["llama-tiny", "moe-tiny"])
def test_pp2_every_schedule(model_name, schedule, vpp):
    # MoE experts in the loop form (unbacked per-expert sizes across stages) under 1F1B
    # and ZB-H1, as grouped GEMMs under the others (the loop form traces slowly)
    extra = ({"expert_impl": "grouped_mm"}
             if model_name == "moe-tiny" and schedule not in ("1f1b", "zbh1") else None)
    run_ranks(2, check_plan, model_name,
              dict(pp=2, vpp=vpp, schedule=schedule, micro_batches=4), 3, 8, 16, extra)


def test_pp2_dp2_gpt_tied_embeddings():
    run_ranks(4, check_plan, "gpt-tiny", dict(pp=2, schedule="zbh1", micro_batches=2), 2)


def test_microbatches_without_pp():
    check_plan(0, 1, "llama-tiny", dict(micro_batches=4), 2)


@pytest.mark.parametrize("model_name", ["llama-tiny", "moe-tiny", "gpt-tiny"])
def test_tp2(model_name):
    # MoE at lr 1e-3: at 1e-2 two AdamW steps turn summation-order differences into a
    # different top-k choice for some token (a discrete change, not a sharding error)
    # moe-tiny at 2 layers (one dense, one MoE in the per-expert loop form): suite time
    moe = model_name == "moe-tiny"
    run_ranks(2, check_plan, model_name, dict(tp=2), 3, 8, 16, dict(n_layers=2) if moe else None,
              1e-3 if moe else 1e-2)


def test_tp2_dp2_llama():
    run_ranks(4, check_plan, "llama-tiny", dict(tp=2), 3)


def test_pp2_tp2_llama():
    run_ranks(4, check_plan, "llama-tiny", dict(tp=2, pp=2, micro_batches=2), 2)


def _tp_not_dividing_kv_heads(rank, world):
    model = models.build_model("llama-tiny")  # 4 heads, 2 KV heads
    step = mx.compile(model, mx.Plan(tp=4))
    with pytest.raises(mx.PlanError, match=r"tp=4 cannot shard .* choose tp in \[1, 2\]"):
        step(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))


def test_tp_must_divide_heads():
    run_ranks(4, _tp_not_dividing_kv_heads)


def test_empty_layer_padding_5_layers_pp2_vpp2():
    # 5 layers over 4 virtual stages: padded to 8 slots, 2 per stage
    run_ranks(2, check_plan, "llama-tiny",
              dict(pp=2, vpp=2, schedule="interleaved", micro_batches=2, empty_layers=True),
              2, 8, 16, dict(n_layers=5))


def _every_schedule_pp4(rank, world, model_name):
    extra = {"expert_impl": "grouped_mm"} if model_name == "moe-tiny" else {}
    for schedule, vpp in SCHEDULES:
        if model_name == "moe-tiny" and schedule in ("gpipe", "1f1b"):
            continue  # at pp=4 on llama, and on moe at pp=2 (suite time)
        micro = 8 if schedule == "dualpipev" else 4  # DualPipeV needs 2 * pp
        check_plan(rank, world, model_name,
                   dict(pp=4, vpp=vpp, schedule=schedule, micro_batches=micro), 1, 8, 16,
                   dict(n_layers=8, **extra))


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["llama-tiny"])
def test_pp4_every_schedule(model_name):
    # one set of 4 processes runs all five schedules (loss and gradients, one step; 1f1b
    # at pp=4 is only here);
    # 8 layers so that interleaved and DualPipeV have a layer for each of 8 stages; the
    # MoE preset runs every schedule at pp=2 (test_pp2_every_schedule, both expert forms):
    # at pp=4 its 8 layers cost 40 s of the suite's budget for no other path
    run_ranks(4, _every_schedule_pp4, model_name)


def _w_holds_only_what_it_reads(rank, world):
    from mxgraph.runtime.pipeline.executor import PipelineExecutor
    held = []  # per deferred W: the values its micro-batch holds that W does not read
    backward_weight = PipelineExecutor.backward_weight

    def checked(self, run, stage, mb):
        keep = self.stages[stage].programs.weight_reads
        held.append([n.name for n in run.env[(stage, mb)] if n not in keep])
        yield from backward_weight(self, run, stage, mb)

    PipelineExecutor.backward_weight = checked
    try:
        check_plan(rank, world, "llama-tiny", {"pp": 2, "schedule": "zbh1", "micro_batches": 4}, 1)
    finally:
        PipelineExecutor.backward_weight = backward_weight
    assert len(held) == 4, held  # one W per micro-batch on this rank's stage
    assert all(not extra for extra in held), held


def test_zbh1_b_frees_what_w_does_not_read():
    # from B to W a micro-batch keeps only W's inputs and the parameter gradients: what F
    # saved for B alone is gone before the deferred W (ZB-H1's memory), same numerics
    run_ranks(2, _w_holds_only_what_it_reads)
