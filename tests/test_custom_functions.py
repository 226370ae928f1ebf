"""A user's custom `torch.autograd.Function` keeps its own backward under `mx.compile`
(mxgraph/functions.py): one device and tp=2 against eager autograd, which runs the
Function's backward; clear refusals for what the capture cannot keep."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxgraph as mx
from mxgraph.capture import capture
from mxgraph.errors import TraceError
from tests.distributed import run_ranks
from tests.runtime.test_pipeline_exec import check_plan

VOCAB, WIDTH = 256, 32


class ClippedRound(torch.autograd.Function):
    """Quantise to steps of 1/scale; straight-through gradient where |x| < limit. Round's own
    derivative is 0, so a graph that differentiates the forward's ops trains nothing."""

    @staticmethod
    def forward(ctx, x, scale, limit):
        ctx.save_for_backward(x)
        ctx.limit = limit
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() < ctx.limit), None, None


class SplitScaled(torch.autograd.Function):
    """The new style (forward without ctx, then setup_context), two outputs, and a backward
    that is not the forward's derivative (each half's gradient scaled by 0.5 and 2)."""

    @staticmethod
    def forward(x):
        a, b = x.chunk(2, dim=-1)
        return a * 1.0, b.relu()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        (x,) = ctx.saved_tensors
        return torch.cat([grad_a * 0.5, grad_b * 2.0 * (x.chunk(2, dim=-1)[1] > 0)], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        a, b = SplitScaled.apply(ClippedRound.apply(self.up(x), 4.0, 2.0))
        return x + self.down(a * torch.sigmoid(b))


class QuantLM(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy; two `Block`s."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_capture_keeps_each_call_as_one_op():
    tokens = torch.randint(0, VOCAB, (2, 8))
    gm = capture(QuantLM(), (tokens, tokens), {}).gm
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.mxgraph.autograd_function.default)
    assert len(calls) == 4  # two Functions in each of two blocks
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.round.default)


def test_eager_gradient_flows_only_through_the_custom_backward():
    """The reference is meaningful: the `up` weights get a gradient in eager only because
    ClippedRound's backward passes it (round's derivative is 0)."""
    torch.manual_seed(0)
    model, tokens = QuantLM(), torch.randint(0, VOCAB, (2, 8))
    model(tokens, tokens).backward()
    assert model.layers[0].up.weight.grad.abs().max() > 0


def test_one_device_matches_eager():
    check_plan(0, 1, QuantLM, {}, 2, 4, 8)


def test_tp2_matches_eager():
    run_ranks(2, check_plan, QuantLM, dict(tp=2), 2, 4, 8)


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + torch.randn_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Listed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs):
        return xs[0] + xs[1]

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("function, match", [
    (lambda h: Noisy.apply(h), "draws random numbers .*randn_like.*pass the random tensor in"),
    (lambda h: InPlace.apply(h * 1), r"in place \(ctx.mark_dirty\).*return a new tensor"),
    (lambda h: Listed.apply([h, h]), "tensors inside a list .*its own argument"),
])
def test_what_cannot_be_kept_is_refused_naming_the_function(function, match):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return function(self.lin(x)).sum()

    with pytest.raises(TraceError, match=match):
        capture(Model(), (torch.randn(4, 8),), {})


class TwoHalves(torch.autograd.Function):
    """Two outputs; its backward adds both gradients, so an unread output's gradient must
    come as zeros (autograd materialises them for a Function), never None."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0, x * 3.0

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return grad_a * 2.0 + grad_b * 3.0


def test_an_unread_output_gets_a_zero_gradient():
    lin = nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            first, _ = TwoHalves.apply(self.lin(x))
            return first.pow(2).sum()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    loss = mx.compile(model, mx.Plan(), example=(x,))(x)
    ref_loss = reference(x)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss.detach())
    torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad, rtol=1e-6, atol=0)
