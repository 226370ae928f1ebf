"""Fused linear + cross-entropy: Triton (interpreter) vs chunked reference vs F.cross_entropy."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import linear_cross_entropy as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
# fp16: the Triton path's chunk GEMMs produce fp16 logits and fp16 dlogits (the reference stays
# in fp32), so values agree to about 1e-2.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-2, 2e-2)}


def _inputs(n, d, v, dtype, ignore_frac, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    return x, w, t


@SETTINGS
@given(n=st.integers(1, 29), d=st.integers(1, 24), v=st.integers(2, 300), chunk=st.integers(1, 16),
       dtype=st.sampled_from([torch.float32, torch.float16]), ignore_frac=st.sampled_from([0.0, 0.3]))
def test_triton_matches_reference(n, d, v, chunk, dtype, ignore_frac):
    x, w, t = _inputs(n, d, v, dtype, ignore_frac)
    t[0] = 0  # at least one counted token
    loss, lse = K.linear_cross_entropy_triton(x, w, t, chunk)
    want_loss, want_lse = K.linear_cross_entropy_reference(x, w, t, chunk)
    fp32_out_tol = {torch.float32: TOL[dtype]}  # loss and lse are fp32 whatever the input dtype
    assert_close(loss, want_loss, tol=fp32_out_tol, msg="loss")
    assert_close(lse, want_lse, tol=fp32_out_tol, msg="lse")
    grad = torch.tensor(1.7)
    got = K.linear_cross_entropy_backward_triton(grad, x, w, t, want_lse, chunk)
    want = K.linear_cross_entropy_backward_reference(grad, x, w, t, want_lse, chunk)
    assert_close(got[0], want[0], tol=TOL, msg="dx")
    assert_close(got[1], want[1], tol=TOL, msg="dw")


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_reference_matches_composition(chunk):
    x, w, t = _inputs(23, 16, 50, torch.float32, 0.2, seed=1)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    want_leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    loss, lse = torch.ops.mxgraph.linear_cross_entropy(*leaves, t, chunk, -100)
    want = F.cross_entropy(want_leaves[0] @ want_leaves[1].T, t, ignore_index=-100)
    assert_close(loss, want.detach())
    assert_close(lse, torch.logsumexp(x @ w.T, -1))
    for a, b in zip(torch.autograd.grad(loss * 1.3, leaves), torch.autograd.grad(want * 1.3, want_leaves), strict=True):
        assert_close(a, b)


def test_all_ignored_is_nan_like_torch():
    x, w, t = _inputs(4, 8, 10, torch.float32, 1.0)
    loss, _ = torch.ops.mxgraph.linear_cross_entropy(x, w, t, 2, -100)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x @ w.T, t))


def test_opcheck():
    x, w, t = _inputs(9, 8, 20, torch.float32, 0.2, seed=2)
    opcheck(torch.ops.mxgraph.linear_cross_entropy.default,
            (x.clone().requires_grad_(), w.clone().requires_grad_(), t, 4, -100))
    _, lse = K.linear_cross_entropy_reference(x, w, t, 4)
    opcheck(torch.ops.mxgraph.linear_cross_entropy_backward.default, (torch.tensor(1.0), x, w, t, lse, 4, -100))
