"""The fused ops trace (fake and symbolic shapes) with their fused backward ops in the graph,
and a symbolic trace taken at one token count reruns at another with the same results."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import mxgraph.codegen.kernels  # noqa: F401

ops = torch.ops.mxgraph
D, E, V = 8, 4, 11


def _block(x, residual, w_norm, w_router, bias, w_out, cos, sin, targets):
    """A toy transformer block with every fused op: attention half, MoE half, LM head."""
    t = x.shape[0]
    y, h, _ = ops.add_rmsnorm(x, residual, w_norm, 1e-6)
    q, k = ops.rope(y.view(1, t, 2, 4), y.view(1, t, 2, 4)[:, :, :1], cos, sin, False)
    attn, _ = ops.gqa_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), True, 0.5)
    a = ops.bias_dropout_add(attn.transpose(1, 2).reshape(t, D), bias, h, 0.1, True, 7, 0)
    z, _ = ops.rmsnorm(a, w_norm, 1e-6)
    probs, ids, _ = ops.moe_router(z @ w_router.T, bias[:E], 2, "sigmoid", 2, 1, True, 1.5)
    rows, row_map, _ = ops.moe_permute(z, ids, E)
    padded, slot_map, _ = ops.moe_permute_capacity(z, ids, E, 3)
    act = ops.bias_swiglu(rows, rows, bias, bias) + ops.swiglu(rows, rows)
    out = ops.moe_unpermute(act, row_map, probs) + ops.moe_unpermute(
        ops.bias_gelu(padded, bias, "tanh").reshape(E * 3, D), slot_map, probs)
    loss, _ = ops.linear_cross_entropy(out + a, w_out, targets, 3, -100)
    return loss


def _grads(*args):
    leaves = [a for a in args if a.requires_grad]
    loss = _block(*args)
    return (loss,) + torch.autograd.grad(loss, leaves)


def _args(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    ang = torch.arange(t)[:, None] * torch.tensor([1.0, 0.1])
    ang = torch.cat([ang, ang], -1)
    return [r(t, D), r(t, D), r(D), r(E, D), r(D), r(V, D), ang.cos(), ang.sin(),
            torch.randint(0, V, (t,), generator=g)]


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_forward_and_fused_backward_ops_appear(mode):
    gm = make_fx(_grads, tracing_mode=mode)(*_args(6))
    targets = {str(n.target) for n in gm.graph.nodes if str(n.target).startswith("mxgraph.")}
    for name in ["add_rmsnorm", "rope", "gqa_attention", "bias_dropout_add", "rmsnorm", "moe_router", "moe_permute",
                 "moe_permute_capacity", "bias_swiglu", "swiglu", "moe_unpermute", "bias_gelu", "linear_cross_entropy"]:
        assert f"mxgraph.{name}.default" in targets, name
    for name in ["rmsnorm_backward", "rope_backward", "gqa_attention_backward", "bias_dropout_add_backward",
                 "moe_router_backward", "moe_permute_backward", "bias_swiglu_backward", "swiglu_backward",
                 "moe_unpermute_backward", "bias_gelu_backward", "linear_cross_entropy_backward"]:
        assert f"mxgraph.{name}.default" in targets, name


def test_symbolic_trace_reruns_at_another_token_count():
    traced = make_fx(_grads, tracing_mode="symbolic")(*_args(6))
    args = _args(9, seed=1)
    for got, want in zip(traced(*args), _grads(*args), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
