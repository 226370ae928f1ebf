"""SwiGLU / bias-SwiGLU: Triton (interpreter) vs reference vs torch composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import KERNELS  # noqa: E402
from mxgraph.codegen.kernels import swiglu as K
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 43), st.integers(1, 73))
DTYPES = st.sampled_from([torch.float32, torch.float16])


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 2).to(dtype)  # noqa: E731
    return mk(*shape), mk(*shape), mk(shape[-1]), mk(shape[-1]), mk(*shape)


@SETTINGS
@given(shape=SHAPES, dtype=DTYPES, bias=st.booleans())
@example(shape=(3, 423, 73), dtype=torch.float16, bias=True)
def test_triton_matches_reference(shape, dtype, bias):
    a, b, ba, bb, g = _inputs(shape, dtype)
    biases = (ba, bb) if bias else ()
    assert_close(K.swiglu_triton(a, b, *biases), K.swiglu_reference(a, b, *biases), msg="fwd")
    got = K.swiglu_backward_triton(g, a, b, *biases)
    want = K.swiglu_backward_reference(g, a, b, *biases)
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert_close(x, y, msg=f"bwd[{i}]")  # bias grads: fp32 sums in both paths, rounded once


def test_poisoned_outputs_catch_unwritten_elements(monkeypatch):
    a, b, *_ = _inputs((2, 5, 300), torch.float32)
    monkeypatch.setattr(K.triton, "cdiv", lambda n, d: max(1, (n + d - 1) // d - 1))  # skip last block
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(K.swiglu_triton(a, b), K.swiglu_reference(a, b))


@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_composition(bias):
    a, b, ba, bb, _ = _inputs((3, 7, 37), torch.float32, seed=1)
    leaves = [t.clone().requires_grad_() for t in ((a, b, ba, bb) if bias else (a, b))]
    want_leaves = [t.clone().requires_grad_() for t in leaves]
    if bias:
        out = torch.ops.mxgraph.bias_swiglu(*leaves)
        wa, wb, wba, wbb = want_leaves
        want = F.silu(wa + wba) * (wb + wbb)
    else:
        out = torch.ops.mxgraph.swiglu(*leaves)
        want = F.silu(want_leaves[0]) * want_leaves[1]
    assert_close(out, want.detach())
    g = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, leaves, g)
    want_grads = torch.autograd.grad(want, want_leaves, g)
    for x, y in zip(got_grads, want_grads, strict=True):
        assert_close(x, y, tol={torch.float32: (1e-5, 1e-5)})


def test_opcheck():
    a, b, ba, bb, g = _inputs((2, 3, 17), torch.float32, seed=2)
    req = lambda t: t.clone().requires_grad_()  # noqa: E731
    opcheck(torch.ops.mxgraph.swiglu.default, (req(a), req(b)))
    opcheck(torch.ops.mxgraph.swiglu_backward.default, (g, a, b))
    opcheck(torch.ops.mxgraph.bias_swiglu.default, (req(a), req(b), req(ba), req(bb)))
    opcheck(torch.ops.mxgraph.bias_swiglu_backward.default, (g, a, b, ba, bb))


def test_registry():
    assert KERNELS["swiglu"].op is torch.ops.mxgraph.swiglu.default
    assert KERNELS["bias_swiglu_backward"].triton is K.swiglu_backward_triton
