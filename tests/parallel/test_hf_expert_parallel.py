"""Expert parallelism on Hugging Face MoE models (mxgraph/hf/models.py's tiny Mixtral and
Qwen2-MoE: 2 layers, hidden 64, 4 experts, top-2, fp32) on gloo processes vs one process.

The step is used as the README writes it: the optimizer is built from `step.parameters()`
right after `mx.compile`, before the first step (the parameters are cut to this rank's
part in place, so it holds what the step updates). Loss within 1e-5 relative, gradients
1e-4 after one step, parameters 1e-4 after 3 AdamW steps, each against eager autograd on
the global batch (`tests/runtime/test_pipeline_exec.py`'s helpers: this rank's part of each
reference tensor by `step.layouts`). One set of 4 processes runs every layout (start-up
and tracing dominate): ep=2 (dp=4, so edp=2) and tp=2 x ep=2 (dp=2, edp=1), with the
default experts ("grouped_mm": transformers::grouped_mm_fallback in fp32) and, under
tp=2 x ep=2, "batched_mm" (per-row gathered weights).
"""
import copy
import functools

import pytest
import torch

import mxgraph as mx
from tests.distributed import run_ranks
from tests.helpers import rel_err
from tests.runtime.test_pipeline_exec import GRAD_TOL, LOSS_TOL, assert_like_reference, largest_norm

pytest.importorskip("transformers")
from mxgraph.hf.models import TINY, build_hf_model  # noqa: E402

# (family, experts implementation: None = transformers' default "grouped_mm", plan, lr);
# lr 1e-3 under tp: at 1e-2 TP's summation order flips a top-k choice within 3 steps
CASES = [("mixtral", None, dict(ep=2), 1e-2),
         ("qwen2_moe", None, dict(ep=2), 1e-2),
         ("mixtral", None, dict(tp=2, ep=2), 1e-3),
         ("mixtral", "batched_mm", dict(tp=2, ep=2), 1e-3),
         ("qwen2_moe", None, dict(tp=2, ep=2), 1e-3)]


def build(family: str, experts: str | None = None):
    torch.manual_seed(0)
    overrides = TINY[family] | ({"experts_implementation": experts} if experts else {})
    return build_hf_model(f"hf:{family}", overrides)


def check_readme_order(rank, world, make_model, plan_kwargs, steps=3, batch_size=4,
                       seq_len=16, lr=1e-2):
    """`check_plan` (test_pipeline_exec.py) with the optimizer built before the first step."""
    model = make_model()
    reference = copy.deepcopy(model)
    step = mx.compile(model, mx.Plan(**plan_kwargs))
    opt = torch.optim.AdamW(step.parameters(), lr=lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    dp, dp_rank = step.mesh.sizes["dp"], step.mesh.coords["dp"]
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        tokens = torch.randint(0, 256, (batch_size * dp, seq_len), generator=g)
        targets = torch.randint(0, 256, (batch_size * dp, seq_len), generator=g)
        mine = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
        loss = step(tokens[mine], targets[mine])
        reference.zero_grad()
        ref_loss = sum(reference(x, y) / dp for x, y in zip(tokens.chunk(dp), targets.chunk(dp), strict=True))
        ref_loss.backward()
        assert rel_err(loss, ref_loss) <= LOSS_TOL, (i, loss.item(), ref_loss.item())
        if i == 0:
            ref_params = dict(reference.named_parameters())
            assert_like_reference(((n, p.grad, ref_params[n].grad, p)
                                   for n, p in step.named_parameters() if p.requires_grad), step,
                                  largest_norm(reference, "grad"), GRAD_TOL, "grad")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    ref_params = dict(reference.named_parameters())
    assert_like_reference(((n, p, ref_params[n], p) for n, p in step.named_parameters()), step,
                          largest_norm(reference), GRAD_TOL, f"after {steps} steps")
    experts = [n for n, layout in step.layouts.items() if layout.ep]
    assert experts and all(dict(model.named_parameters())[n].shape[0] == 2 for n in experts)


def _every_case(rank, world, cases):
    for family, experts, plan_kwargs, lr in cases:
        try:
            check_readme_order(rank, world, functools.partial(build, family, experts),
                               plan_kwargs, lr=lr)
        except Exception as error:
            raise AssertionError(f"{family} experts={experts or 'grouped_mm'} "
                                 f"{plan_kwargs}: {error}") from error


def test_hf_moe_ep_layouts_on_4_ranks():
    run_ranks(4, _every_case, CASES)
