"""MoE permute/unpermute (dropless and capacity): Triton (interpreter) vs reference vs an
indexing composition, opcheck."""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["MXGRAPH_KERNEL_POISON"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st

from mxgraph.codegen.kernels import moe_permute as K  # noqa: E402
from tests.kernel_testing import assert_close, opcheck  # noqa: E402

# no shrinking: a failing example is reported as drawn (the interpreter is too slow to shrink)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
# fp16: row moves are exact; sums of K weighted rows and the dot products for grad_probs are
# computed in fp32 in both paths and rounded once.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


def _inputs(t, k, e, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    probs = torch.rand(t, k, generator=g)
    return mk(t, d), ids, probs, mk(t * k, d), mk(t, d)


CASES = st.tuples(st.integers(1, 19), st.integers(1, 3), st.integers(3, 7), st.integers(1, 37))


@SETTINGS
@given(case=CASES, dtype=st.sampled_from([torch.float32, torch.float16]), capacity=st.sampled_from([None, 1, 3]))
def test_triton_matches_reference(case, dtype, capacity):
    t, k, e, d = case
    x, ids, probs, _, gout = _inputs(t, k, e, d, dtype)
    if capacity is None:
        got, want = K.moe_permute_triton(x, ids, e), K.moe_permute_reference(x, ids, e)
    else:
        got = K.moe_permute_capacity_triton(x, ids, e, capacity)
        want = K.moe_permute_capacity_reference(x, ids, e, capacity)
    assert_close(got[0], want[0], tol=TOL, msg="rows")
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    row_map = want[1]
    rows = torch.randn(want[0].shape).to(dtype).reshape(-1, d)
    assert_close(K.moe_permute_backward_triton(rows, row_map, k), K.moe_permute_backward_reference(rows, row_map, k),
                 tol=TOL, msg="permute bwd")
    assert_close(K.moe_unpermute_triton(rows, row_map, probs), K.moe_unpermute_reference(rows, row_map, probs),
                 tol=TOL, msg="unpermute")
    got = K.moe_unpermute_backward_triton(gout, rows, row_map, probs)
    want = K.moe_unpermute_backward_reference(gout, rows, row_map, probs)
    assert_close(got[0], want[0], tol=TOL, msg="unpermute bwd rows")
    assert_close(got[1], want[1], tol={torch.float32: TOL[dtype]}, msg="unpermute bwd probs")


def test_layout_and_capacity_dropping():
    ids = torch.tensor([[2, 0], [0, 1], [0, 2], [1, 0]])
    x = torch.arange(4.0)[:, None].expand(4, 3).contiguous()
    xs, row_map, counts = torch.ops.mxgraph.moe_permute(x, ids, 4)
    assert counts.tolist() == [4, 2, 2, 0]
    assert xs[:, 0].tolist() == [0, 1, 2, 3, 1, 3, 0, 2]  # expert-major, token order inside
    xp, slot_map, counts = torch.ops.mxgraph.moe_permute_capacity(x, ids, 4, 2)
    assert counts.tolist() == [4, 2, 2, 0]
    assert xp[..., 0].tolist() == [[0, 1], [1, 3], [0, 2], [0, 0]]
    assert (slot_map == -1).sum() == 2  # tokens 2 and 3 overflow expert 0
    assert slot_map.view(4, 2)[2, 0] == -1 and slot_map.view(4, 2)[3, 1] == -1


@pytest.mark.parametrize("capacity", [None, 2])
def test_reference_matches_composition(capacity):
    t, k, e, d = 9, 2, 4, 5
    x, ids, probs, _, gout = _inputs(t, k, e, d, torch.float32, seed=1)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    p1, p2 = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    if capacity is None:
        rows, row_map, _ = torch.ops.mxgraph.moe_permute(x1, ids, e)
    else:
        rows, row_map, _ = torch.ops.mxgraph.moe_permute_capacity(x1, ids, e, capacity)
    expert_out = rows * torch.arange(1.0, rows.numel() + 1).view(rows.shape) / rows.numel()  # a stand-in expert
    if capacity is None:
        out = torch.ops.mxgraph.moe_unpermute(expert_out, row_map, p1)
    else:
        out = K.moe_unpermute_capacity(expert_out, row_map, p1)
    # composition: each (token, choice) applies the stand-in expert of its row, weighted
    keep = (row_map >= 0).float()
    factors = (torch.arange(1.0, rows.numel() + 1).view(-1, d) / rows.numel())[row_map.clamp(min=0)]
    want = ((x2.repeat_interleave(k, 0) * factors * keep[:, None]).view(t, k, d) * p2[..., None]).sum(1)
    assert_close(out, want.detach())
    for a, b in zip(torch.autograd.grad(out, (x1, p1), gout), torch.autograd.grad(want, (x2, p2), gout), strict=True):
        assert_close(a, b)


def test_opcheck():
    x, ids, probs, rows, gout = _inputs(6, 2, 4, 5, torch.float32, seed=2)
    opcheck(torch.ops.mxgraph.moe_permute.default, (x.clone().requires_grad_(), ids, 4))
    opcheck(torch.ops.mxgraph.moe_permute_capacity.default, (x.clone().requires_grad_(), ids, 4, 2))
    row_map, _ = K.routing_maps(ids, 4)
    slot_map, _ = K.routing_maps(ids, 4, 2)
    opcheck(torch.ops.mxgraph.moe_permute_backward.default, (rows, row_map, 2))
    opcheck(torch.ops.mxgraph.moe_unpermute.default, (rows.requires_grad_(), row_map, probs.requires_grad_()))
    opcheck(torch.ops.mxgraph.moe_unpermute_backward.default, (gout, rows.detach(), row_map, probs.detach()))
    opcheck(torch.ops.mxgraph.moe_unpermute_backward.default, (gout, rows.detach()[:8], slot_map, probs.detach()))
