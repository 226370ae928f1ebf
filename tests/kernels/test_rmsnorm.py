"""RMSNorm / add+RMSNorm: Triton (interpreter) vs reference vs torch composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import rmsnorm as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 23), st.integers(1, 173))
# fp16: outputs are rounded once from fp32 in both paths (~1 ulp); the weight gradient is a
# sum over rows in a different order, rounded to fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}
EPS = 1e-6


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(*shape), mk(*shape), mk(shape[-1]), mk(*shape), mk(*shape)


@SETTINGS
@given(shape=SHAPES, dtype=st.sampled_from([torch.float32, torch.float16]), residual=st.booleans())
@example(shape=(3, 141, 73), dtype=torch.float16, residual=True)
def test_triton_matches_reference(shape, dtype, residual):
    x, res, w, gy, gh = _inputs(shape, dtype)
    if residual:
        got, want = K.add_rmsnorm_triton(x, res, w, EPS), K.add_rmsnorm_reference(x, res, w, EPS)
        h = want[1]
    else:
        got, want = K.rmsnorm_triton(x, w, EPS), K.rmsnorm_reference(x, w, EPS)
        h, gh = x, None
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a, b, tol=TOL, msg=f"fwd[{i}]")
    rstd = want[-1]
    got = K.rmsnorm_backward_triton(gy, h, w, rstd, gh)
    want = K.rmsnorm_backward_reference(gy, h, w, rstd, gh)
    assert_close(got[0], want[0], tol=TOL, msg="dh")
    assert_close(got[1], want[1], tol={torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 2e-3)}, msg="dw")


def _composition(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


@pytest.mark.parametrize("residual", [False, True])
def test_reference_matches_composition(residual):
    x, res, w, gy, gh = _inputs((3, 5, 47), torch.float32, seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, res, w)]
    want_leaves = [t.clone().requires_grad_() for t in (x, res, w)]
    wx, wres, ww = want_leaves
    if residual:
        y, h, _ = torch.ops.mxgraph.add_rmsnorm(*leaves, EPS)
        want_h = wx + wres
        want_y = _composition(want_h, ww)
        assert_close(h, want_h.detach())
        outs, want_outs, grads = (y, h), (want_y, want_h), (gy, gh)
        check = leaves
    else:
        y, _ = torch.ops.mxgraph.rmsnorm(leaves[0], leaves[2], EPS)
        want_y = _composition(wx, ww)
        outs, want_outs, grads = (y,), (want_y,), (gy,)
        check, want_leaves = [leaves[0], leaves[2]], [wx, ww]
    assert_close(y, want_y.detach())
    got = torch.autograd.grad(outs, check, grads)
    want = torch.autograd.grad(want_outs, want_leaves, grads)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, tol={torch.float32: (1e-5, 1e-5)})


def test_opcheck():
    x, res, w, gy, gh = _inputs((2, 3, 19), torch.float32, seed=2)
    req = lambda t: t.clone().requires_grad_()  # noqa: E731
    opcheck(torch.ops.mxgraph.rmsnorm.default, (req(x), req(w), EPS))
    opcheck(torch.ops.mxgraph.add_rmsnorm.default, (req(x), req(res), req(w), EPS))
    _, rstd = K.rmsnorm_reference(x, w, EPS)
    opcheck(torch.ops.mxgraph.rmsnorm_backward.default, (gy, x, w, rstd, None))
    opcheck(torch.ops.mxgraph.rmsnorm_backward.default, (gy, x, w, rstd, gh))
