"""MoE router: Triton (interpreter) vs reference vs a torch composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import moe_router as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
# fp16 logits: both paths upcast to fp32, so probs agree to fp32 rounding; grad_logits is
# rounded once to fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


@st.composite
def _configs(draw):
    groups = draw(st.sampled_from([1, 2, 4]))
    e = groups * draw(st.integers(2, 9))
    topk_groups = draw(st.integers(1, groups))
    topk = draw(st.integers(topk_groups if groups > 1 else 1, topk_groups * (e // groups) if groups > 1 else e))
    group_topk = draw(st.integers(0, e // groups))  # 0: topk // topk_groups
    return e, topk, groups, topk_groups, group_topk


def _logits(t, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(t, e, generator=g) * 2).to(dtype), torch.randn(e, generator=g) * 0.1,
            torch.randn(t, e, generator=g))


@SETTINGS
@given(t=st.integers(1, 33), cfg=_configs(), dtype=st.sampled_from([torch.float32, torch.float16]),
       score_func=st.sampled_from(["softmax", "sigmoid"]), bias=st.booleans(), normalize=st.booleans())
def test_triton_matches_reference(t, cfg, dtype, score_func, bias, normalize):
    e, topk, groups, topk_groups, group_topk = cfg
    logits, b, g = _logits(t, e, dtype)
    args = (b if bias else None, topk, score_func, groups, topk_groups, normalize, 2.5, group_topk)
    probs, ids, counts = K.moe_router_triton(logits, *args)
    want_probs, want_ids, want_counts = K.moe_router_reference(logits, *args)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert torch.equal(counts, want_counts)
    assert_close(probs, want_probs, tol={torch.float32: (1e-5, 1e-5)}, msg="probs")
    grad = g[:, :topk].contiguous()
    assert_close(K.moe_router_backward_triton(grad, logits, ids, score_func, normalize, 2.5),
                 K.moe_router_backward_reference(grad, logits, ids, score_func, normalize, 2.5), tol=TOL, msg="bwd")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
def test_reference_matches_composition(score_func, normalize):
    logits, b, g = _logits(11, 8, torch.float32, seed=1)
    l1, l2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    probs, ids, counts = torch.ops.mxgraph.moe_router(l1, b, 3, score_func, 2, 1, normalize, 1.5)
    # composition: plain torch scores, selection restricted by hand to the best group
    scores = torch.softmax(l2, -1) if score_func == "softmax" else torch.sigmoid(l2)
    sel = (scores + b).detach()
    group_best = sel.view(11, 2, 4).topk(3, -1).values.sum(-1).argmax(-1)
    sel = sel.masked_fill((torch.arange(8) // 4)[None, :] != group_best[:, None], float("-inf"))
    want_ids = sel.topk(3, -1).indices
    want = scores.gather(1, want_ids)
    if normalize:
        want = want / (want.sum(-1, keepdim=True) + 1e-20)
    want = want * 1.5
    assert torch.equal(ids, want_ids)
    assert torch.equal(counts, torch.bincount(want_ids.flatten(), minlength=8))
    assert_close(probs, want.detach())
    grad = g[:, :3]
    assert_close(torch.autograd.grad(probs, l1, grad)[0], torch.autograd.grad(want, l2, grad)[0])


def test_rejects_bad_groups():
    logits, *_ = _logits(3, 6, torch.float32)
    with pytest.raises(ValueError, match="divisible"):
        torch.ops.mxgraph.moe_router(logits, None, 2, "softmax", 4, 1, False, 1.0)


def test_opcheck():
    logits, b, g = _logits(7, 8, torch.float32, seed=2)
    opcheck(torch.ops.mxgraph.moe_router.default,
            (logits.clone().requires_grad_(), b, 2, "sigmoid", 2, 1, True, 2.0))
    opcheck(torch.ops.mxgraph.moe_router.default,
            (logits.clone().requires_grad_(), None, 3, "softmax", 1, 1, False, 1.0))
    _, ids, _ = K.moe_router_reference(logits, b, 2, "sigmoid", 2, 1, True, 2.0)
    opcheck(torch.ops.mxgraph.moe_router_backward.default, (g[:, :2].contiguous(), logits, ids, "sigmoid", True, 2.0))


def test_group_topk_sums_that_many_scores_per_group():
    # 2 groups of 4; group 0 has one high score, group 1 two medium ones: summing the best
    # one keeps group 0, summing the best two (DeepSeek-V3) keeps group 1
    logits = torch.tensor([[4.0, -9, -9, -9, 1.5, 1.5, -9, -9]])
    _, ids_1, _ = K.moe_router_reference(logits, None, 1, "sigmoid", 2, 1, False, 1.0, 1)
    _, ids_2, _ = K.moe_router_reference(logits, None, 1, "sigmoid", 2, 1, False, 1.0, 2)
    assert ids_1.item() == 0 and ids_2.item() in (4, 5)
