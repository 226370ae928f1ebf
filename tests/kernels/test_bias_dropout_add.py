"""Bias-Dropout-Add: Triton (interpreter) vs reference (same mask bits), composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import bias_dropout_add as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 43), st.integers(1, 73))


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(*shape), mk(shape[-1]), mk(*shape), mk(*shape)


@SETTINGS
@given(shape=SHAPES, dtype=st.sampled_from([torch.float32, torch.float16]), bias=st.booleans(),
       p=st.sampled_from([0.0, 0.1, 0.5, 1.0]), training=st.booleans(),
       seed=st.integers(0, 2**63 - 1), offset=st.integers(0, 2**40))
@example(shape=(3, 423, 73), dtype=torch.float16, bias=True, p=0.1, training=True, seed=2**40 + 1,
         offset=2**32 - 5000)  # the counter wraps past 2**32 inside the tensor
def test_triton_matches_reference(shape, dtype, bias, p, training, seed, offset):
    x, b, res, g = _inputs(shape, dtype)
    b = b if bias else None
    args = (p, training, seed, offset)
    assert_close(K.bias_dropout_add_triton(x, b, res, *args), K.bias_dropout_add_reference(x, b, res, *args),
                 msg="fwd")
    assert_close(K.bias_dropout_add_backward_triton(g, *args), K.bias_dropout_add_backward_reference(g, *args),
                 msg="bwd")


def test_mask_statistics_and_determinism():
    keep = K.dropout_keep_mask(200_000, 0.3, seed=1234, offset=77)
    assert abs(keep.float().mean().item() - 0.7) < 0.005
    assert torch.equal(keep, K.dropout_keep_mask(200_000, 0.3, seed=1234, offset=77))
    other_seed = K.dropout_keep_mask(200_000, 0.3, seed=1235, offset=77)
    assert (keep != other_seed).float().mean().item() > 0.3  # independent-looking masks
    # the offset shifts the counter: element i at offset o is element i + 5 at offset o - 5
    assert torch.equal(keep[5:], K.dropout_keep_mask(200_000, 0.3, seed=1234, offset=82)[:-5])


@pytest.mark.parametrize("p,training", [(0.0, True), (0.25, True), (0.25, False)])
def test_reference_matches_composition(p, training):
    x, b, res, g = _inputs((3, 7, 29), torch.float32, seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, b, res)]
    want_leaves = [t.clone().requires_grad_() for t in (x, b, res)]
    out = torch.ops.mxgraph.bias_dropout_add(leaves[0], leaves[1], leaves[2], p, training, 99, 3)
    wx, wb, wres = want_leaves
    if training and p > 0:
        keep = K.dropout_keep_mask(x.numel(), p, 99, 3).view(x.shape)
        want = wres + (wx + wb) * keep / (1 - p)
    else:
        want = wres + wx + wb
    assert_close(out, want.detach())
    for a, c in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, want_leaves, g), strict=True):
        assert_close(a, c)


def test_opcheck():
    x, b, res, g = _inputs((2, 3, 17), torch.float32, seed=2)
    req = lambda t: t.clone().requires_grad_()  # noqa: E731
    for bias in (b, None):
        opcheck(torch.ops.mxgraph.bias_dropout_add.default,
                (req(x), None if bias is None else req(bias), req(res), 0.2, True, 5, 7))
    opcheck(torch.ops.mxgraph.bias_dropout_add_backward.default, (g, 0.2, True, 5, 7))
