"""GQA attention: Triton flash kernels (interpreter) vs reference vs SDPA over repeated K/V."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import gqa as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
# fp16: both paths accumulate in fp32 but the Triton kernels round P and dS to fp16 before
# the second matmul (as flash attention does on a GPU).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}


def _inputs(b, hkv, g, sq, sk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    return (mk(b, hkv * g, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d), mk(b, hkv * g, sq, d),
            mk(b, hkv * g, sq).float())


CASES = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(1, 37), st.integers(1, 24))


@SETTINGS
@given(case=CASES, dtype=st.sampled_from([torch.float32, torch.float16]), causal=st.booleans(),
       with_grad_lse=st.booleans())
@example(case=(1, 2, 2, 70, 73), dtype=torch.float16, causal=True, with_grad_lse=True)  # odd head_dim
def test_triton_matches_reference(case, dtype, causal, with_grad_lse):
    b, hkv, g, s, d = case
    q, k, v, do, dlse = _inputs(b, hkv, g, s, s, d, dtype)
    scale = K.default_scale(d)
    out, lse = K.gqa_attention_triton(q, k, v, causal, scale)
    want_out, want_lse = K.gqa_attention_reference(q, k, v, causal, scale)
    assert_close(out, want_out, tol=TOL, msg="out")
    assert_close(lse, want_lse, tol={torch.float32: (1e-5, 1e-5)}, msg="lse")
    dlse = dlse if with_grad_lse else None
    got = K.gqa_attention_backward_triton(do, dlse, q, k, v, want_out, want_lse, causal, scale)
    want = K.gqa_attention_backward_reference(do, dlse, q, k, v, want_out, want_lse, causal, scale)
    for name, a, c in zip("qkv", got, want, strict=True):
        assert_close(a, c, tol=TOL, msg=f"d{name}")


def test_uneven_lengths_without_causal():
    q, k, v, do, _ = _inputs(1, 2, 2, 5, 21, 16, torch.float32, seed=3)
    scale = 0.3
    out, lse = K.gqa_attention_triton(q, k, v, False, scale)
    want_out, want_lse = K.gqa_attention_reference(q, k, v, False, scale)
    assert_close(out, want_out)
    for a, c in zip(K.gqa_attention_backward_triton(do, None, q, k, v, out, lse, False, scale),
                    K.gqa_attention_backward_reference(do, None, q, k, v, out, lse, False, scale), strict=True):
        assert_close(a, c)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa(causal):
    q, k, v, do, dlse = _inputs(2, 2, 3, 9, 9, 8, torch.float32, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.mxgraph.gqa_attention(*leaves, causal, 0.4)
    wq, wk, wv = want_leaves
    want = F.scaled_dot_product_attention(wq, wk.repeat_interleave(3, 1), wv.repeat_interleave(3, 1),
                                          is_causal=causal, scale=0.4)
    assert_close(out, want.detach())
    for a, c in zip(torch.autograd.grad(out, leaves, do, retain_graph=True),
                    torch.autograd.grad(want, want_leaves, do, retain_graph=True), strict=True):
        assert_close(a, c)
    # the log-sum-exp output and its gradient, against the explicit composition
    s = (wq @ wk.repeat_interleave(3, 1).transpose(-1, -2)) * 0.4
    if causal:
        s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    assert_close(lse, want_lse.detach())
    got = torch.autograd.grad((out, lse), leaves, (do, dlse))
    for a, c in zip(got, torch.autograd.grad((want, want_lse), want_leaves, (do, dlse)), strict=True):
        assert_close(a, c)


def test_opcheck():
    q, k, v, do, dlse = _inputs(1, 2, 2, 5, 5, 8, torch.float32, seed=2)
    req = lambda t: t.clone().requires_grad_()  # noqa: E731
    opcheck(torch.ops.mxgraph.gqa_attention.default, (req(q), req(k), req(v), True, 0.35))
    out, lse = K.gqa_attention_reference(q, k, v, True, 0.35)
    opcheck(torch.ops.mxgraph.gqa_attention_backward.default, (do, dlse, q, k, v, out, lse, True, 0.35))
    opcheck(torch.ops.mxgraph.gqa_attention_backward.default, (do, None, q, k, v, out, lse, False, 0.35))
