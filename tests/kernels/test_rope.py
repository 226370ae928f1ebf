"""RoPE (rotate-half and interleaved, partial rotary): Triton (interpreter) vs reference vs
a torch composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import rope as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


def _tables(s, r, interleaved, base=10000.0):
    inv = base ** (-torch.arange(0, r, 2).float() / r)
    ang = torch.arange(s).float()[:, None] * inv[None, :]
    ang = ang.repeat_interleave(2, dim=-1) if interleaved else torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _inputs(b, s, hq, hk, d, r, dtype, interleaved, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *sh: torch.randn(*sh, generator=g).to(dtype)  # noqa: E731
    cos, sin = _tables(s, r, interleaved)
    return mk(b, s, hq, d), mk(b, s, hk, d), cos, sin, mk(b, s, hq, d), mk(b, s, hk, d)


@st.composite
def _cases(draw):
    d = draw(st.integers(2, 41))
    r = 2 * draw(st.integers(1, d // 2))
    return (draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 5)), draw(st.integers(1, 3)),
            d, r)


@SETTINGS
@given(case=_cases(), dtype=st.sampled_from([torch.float32, torch.float16]), interleaved=st.booleans())
@example(case=(3, 42, 4, 2, 73, 72), dtype=torch.float16, interleaved=False)
@example(case=(1, 7, 2, 1, 73, 34), dtype=torch.float32, interleaved=True)
def test_triton_matches_reference(case, dtype, interleaved):
    q, k, cos, sin, gq, gk = _inputs(*case, dtype, interleaved)
    for a, b in zip(K.rope_triton(q, k, cos, sin, interleaved), K.rope_reference(q, k, cos, sin, interleaved),
                    strict=True):
        assert_close(a, b, msg="fwd")
    for a, b in zip(K.rope_backward_triton(gq, gk, cos, sin, interleaved),
                    K.rope_backward_reference(gq, gk, cos, sin, interleaved), strict=True):
        assert_close(a, b, msg="bwd")


def _composition(x, cos, sin, interleaved):
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    if interleaved:
        rotated = torch.stack([-xr[..., 1::2], xr[..., 0::2]], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([-xr[..., r // 2:], xr[..., : r // 2]], dim=-1)
    return torch.cat([xr * cos[None, :, None] + rotated * sin[None, :, None], rest], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("r", [8, 12])
def test_reference_matches_composition(interleaved, r):
    q, k, cos, sin, gq, gk = _inputs(2, 5, 3, 1, 12, r, torch.float32, interleaved, seed=1)
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    want_leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    outs = torch.ops.mxgraph.rope(*leaves, cos, sin, interleaved)
    wants = [_composition(x, cos, sin, interleaved) for x in want_leaves]
    for a, b in zip(outs, wants, strict=True):
        assert_close(a, b.detach())
    if r < 12:
        assert torch.equal(outs[0][..., r:], q[..., r:])  # partial rotary leaves the rest untouched
    for a, b in zip(torch.autograd.grad(outs, leaves, (gq, gk)), torch.autograd.grad(wants, want_leaves, (gq, gk)),
                    strict=True):
        assert_close(a, b)


def test_rejects_bad_rot_dim():
    q, k, cos, sin, *_ = _inputs(1, 3, 2, 1, 8, 6, torch.float32, False)
    with pytest.raises(ValueError, match="rot_dim"):
        torch.ops.mxgraph.rope(q, k, cos[:, :5], sin[:, :5], False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck(interleaved):
    q, k, cos, sin, gq, gk = _inputs(2, 3, 2, 1, 10, 8, torch.float32, interleaved, seed=2)
    opcheck(torch.ops.mxgraph.rope.default, (q.requires_grad_(), k.requires_grad_(), cos, sin, interleaved))
    opcheck(torch.ops.mxgraph.rope_backward.default, (gq, gk, cos, sin, interleaved))
