"""Bias-GELU (erf and tanh): Triton (interpreter) vs reference vs torch composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import bias_gelu as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 43), st.integers(1, 73))
APPROX = ["none", "tanh"]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 3).to(dtype)  # noqa: E731
    return mk(*shape), mk(shape[-1]), mk(*shape)


@SETTINGS
@given(shape=SHAPES, dtype=st.sampled_from([torch.float32, torch.float16]), approximate=st.sampled_from(APPROX))
@example(shape=(3, 423, 73), dtype=torch.float32, approximate="tanh")
def test_triton_matches_reference(shape, dtype, approximate):
    x, bias, g = _inputs(shape, dtype)
    assert_close(K.bias_gelu_triton(x, bias, approximate), K.bias_gelu_reference(x, bias, approximate), msg="fwd")
    dx, dbias = K.bias_gelu_backward_triton(g, x, bias, approximate)
    want_dx, want_dbias = K.bias_gelu_backward_reference(g, x, bias, approximate)
    assert_close(dx, want_dx, msg="dx")
    assert_close(dbias, want_dbias, tol={torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}, msg="dbias")


@pytest.mark.parametrize("approximate", APPROX)
def test_reference_matches_composition(approximate):
    x, bias, g = _inputs((3, 5, 41), torch.float32, seed=1)
    x1, b1 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    x2, b2 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    out = torch.ops.mxgraph.bias_gelu(x1, b1, approximate)
    want = F.gelu(x2 + b2, approximate=approximate)
    assert_close(out, want.detach())
    for a, b in zip(torch.autograd.grad(out, (x1, b1), g), torch.autograd.grad(want, (x2, b2), g), strict=True):
        assert_close(a, b, tol={torch.float32: (1e-5, 1e-5)})


def test_bad_approximate():
    x, bias, _ = _inputs((2, 3), torch.float32)
    with pytest.raises(ValueError, match="approximate"):
        torch.ops.mxgraph.bias_gelu(x, bias, "fast")


@pytest.mark.parametrize("approximate", APPROX)
def test_opcheck(approximate):
    x, bias, g = _inputs((2, 3, 17), torch.float32, seed=2)
    opcheck(torch.ops.mxgraph.bias_gelu.default, (x.requires_grad_(), bias.requires_grad_(), approximate))
    opcheck(torch.ops.mxgraph.bias_gelu_backward.default, (g, x.detach(), bias.detach(), approximate))
