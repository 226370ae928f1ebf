"""The CPU references of the fused ops equal eager torch bit for bit, forward and backward.

Each reference makes the ATen calls that eager autograd makes for the pattern's textbook form
(``mxgraph/codegen/kernels/__init__.py``); this is what lets fusion on equal fusion off exactly
in ``tests/passes/test_fuse.py``. Oracle: the textbook form run eagerly, ``backward()`` for gradients.
Shapes are odd on purpose; fp32; ``torch.equal`` (no tolerance).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mxgraph.codegen.kernels import bias_gelu, gqa, linear_cross_entropy, moe_router, rmsnorm, swiglu


def _leaves(*shapes):
    torch.manual_seed(0)
    return [torch.randn(*s, requires_grad=True) for s in shapes]


def _assert_equal(mine, eager, what: str) -> None:
    assert torch.equal(mine, eager), (what, ((mine - eager).abs().max() / eager.abs().max()).item())


def test_swiglu():
    a, b = _leaves((3, 7, 37), (3, 7, 37))
    g = torch.randn(3, 7, 37)
    (F.silu(a) * b).backward(g)
    _assert_equal(swiglu.swiglu_reference(a.detach(), b.detach()), (F.silu(a) * b).detach(), "out")
    da, db = swiglu.swiglu_backward_reference(g, a.detach(), b.detach())
    _assert_equal(da, a.grad, "grad a")
    _assert_equal(db, b.grad, "grad b")


def _norm(x, w, eps):  # how Llama writes it: fp32 reduction, cast back, then the weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


@pytest.mark.parametrize("residual", [False, True], ids=["rmsnorm", "add_rmsnorm"])
def test_rmsnorm(residual):
    """With a residual, its gradient arrives first (the stream's later layers run backward
    first) and the fused backward adds it first, as eager does."""
    x, r, w = _leaves((3, 7, 37), (3, 7, 37), (37,))
    g, g_stream = torch.randn(3, 7, 37), torch.randn(3, 7, 37)
    h = x + r if residual else x
    y = _norm(h, w, 1e-5)
    (y * g + h * g_stream).sum().backward()
    if residual:
        mine, h_mine, rstd = rmsnorm.add_rmsnorm_reference(x.detach(), r.detach(), w.detach(), 1e-5)
    else:
        (mine, rstd), h_mine = rmsnorm.rmsnorm_reference(x.detach(), w.detach(), 1e-5), x.detach()
    _assert_equal(mine, y.detach(), "out")
    dh, dw = rmsnorm.rmsnorm_backward_reference(g, h_mine, w.detach(), rstd, g_stream)
    _assert_equal(dh, x.grad, "grad x")
    _assert_equal(dw, w.grad, "grad weight")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(approximate):
    x, b = _leaves((3, 7, 37), (37,))
    g = torch.randn(3, 7, 37)
    y = F.gelu(x + b, approximate=approximate)
    y.backward(g)
    _assert_equal(bias_gelu.bias_gelu_reference(x.detach(), b.detach(), approximate), y.detach(), "out")
    dx, db = bias_gelu.bias_gelu_backward_reference(g, x.detach(), b.detach(), approximate)
    _assert_equal(dx, x.grad, "grad x")
    _assert_equal(db, b.grad, "grad bias")


def test_linear_cross_entropy_in_one_chunk():
    """One chunk (the fusion pass's choice up to 64M logits) is eager's computation exactly."""
    x, w = _leaves((37, 24), (101, 24))
    targets = torch.randint(0, 101, (37,))
    targets[3] = -100
    loss = F.cross_entropy(F.linear(x, w), targets)
    loss.backward()
    mine, lse = linear_cross_entropy.linear_cross_entropy_reference(x.detach(), w.detach(), targets, 64)
    _assert_equal(mine, loss.detach(), "loss")
    dx, dw = linear_cross_entropy.linear_cross_entropy_backward_reference(
        torch.tensor(1.0), x.detach(), w.detach(), targets, lse, 64)
    _assert_equal(dx, x.grad, "grad x")
    _assert_equal(dw, w.grad, "grad weight")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_router(score_func, normalize):
    (logits,) = _leaves((37, 8))
    g = torch.randn(37, 3)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    ids = scores.topk(3, dim=-1).indices
    probs = scores.gather(1, ids)
    if normalize:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    probs = probs * 2.5
    probs.backward(g)
    mine, mine_ids, _ = moe_router.moe_router_reference(logits.detach(), None, 3, score_func,
                                                        normalize=normalize, route_scale=2.5)
    assert torch.equal(mine_ids, ids)
    _assert_equal(mine, probs.detach(), "probs")
    d = moe_router.moe_router_backward_reference(g, logits.detach(), ids, score_func, normalize, 2.5)
    _assert_equal(d, logits.grad, "grad logits")


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (8, 2)])
def test_gqa_attention(heads, kv_heads):
    """Llama's form: K/V repeated by expand + reshape in [B, S, H, E], SDPA on transposed views."""
    B, S, E = 2, 19, 8
    q, k, v = _leaves((B, S, heads, E), (B, S, kv_heads, E), (B, S, kv_heads, E))
    g = torch.randn(B, S, heads, E)

    def repeat(t):
        return t[:, :, :, None, :].expand(B, S, kv_heads, heads // kv_heads, E).reshape(B, S, heads, E)

    out = F.scaled_dot_product_attention(q.transpose(1, 2), repeat(k).transpose(1, 2),
                                         repeat(v).transpose(1, 2), is_causal=True).transpose(1, 2)
    out.backward(g)
    heads_first = [t.detach().transpose(1, 2) for t in (q, k, v)]
    mine, lse = gqa.gqa_attention_reference(*heads_first, True, E ** -0.5)
    _assert_equal(mine.transpose(1, 2), out.detach(), "out")
    grads = gqa.gqa_attention_backward_reference(g.transpose(1, 2), None, *heads_first, mine, lse, True, E ** -0.5)
    for name, mine_grad, leaf in zip("qkv", grads, (q, k, v), strict=True):
        _assert_equal(mine_grad.transpose(1, 2), leaf.grad, f"grad {name}")
