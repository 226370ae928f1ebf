"""Views the tracer recorded from fake strides that the real kernels do not keep
(mxgraph/passes/cleanup.py `safe_views_pass`, run as `safe_views_joint`): a `cat` of
gradients that torch's fake tensors call contiguous, but that the CPU kernels lay out
transposed, then a `view` that merges its dims. Eager runs (autograd's `reshape` copies);
the compiled step must too, with eager's values: bitwise for a small module, and for
Qwen3-Next (gated DeltaNet) from transformers' defaults with sizes shrunk, loss and every
gradient bitwise against eager taking the branch the export traces, within 1e-6 of the
largest gradient against plain eager (its triangular solve rounds otherwise)."""
from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import mxgraph as mx
from mxgraph.passes.cleanup import merges_dims

aten = torch.ops.aten


def test_softplus_backward_fake_strides_differ_from_the_cpu_kernel():
    """The root cause: torch's meta of softplus_backward (its decomposition, a `where` led by
    the contiguous input) says contiguous; the CPU kernel follows the gradient's layout.
    If torch fixes its meta, this fails: the pass stays right, update the docstrings."""
    grad = torch.randn(2, 4, 16).transpose(1, 2)  # [2, 16, 4], strides (64, 1, 16)
    x = torch.randn(2, 16, 4)
    real = aten.softplus_backward(grad, x, 1.0, 20.0)
    with FakeTensorMode() as mode:
        fake = aten.softplus_backward(mode.from_tensor(grad), mode.from_tensor(x), 1.0, 20.0)
    assert real.stride() == (64, 1, 16) and fake.stride() == (64, 4, 1)


@pytest.mark.parametrize("src,dst,merges", [
    ((2, 16, 2, 4), (2, 16, 8), True), ((2, 16, 8), (32, 8), True), ((6, 4), (4, 6), True),
    ((32, 8), (2, 16, 8), False), ((24,), (2, 3, 4), False), ((4, 6), (2, 2, 3, 2), False),
    ((2, 1, 3), (2, 3), False), ((2, 3), (2, 1, 3, 1), False), ((), (1, 1), False),
    ((0, 3), (3, 0), False)])
def test_merges_dims(src, dst, merges):
    """Only a view that folds dims of size > 1 together depends on its input's strides."""
    assert merges_dims(src, dst) is merges


class GateHeads(nn.Module):
    """Qwen3-Next's gate inputs in small: one projection viewed per head and split in two
    (autograd: a `cat` of both halves' gradients, then a `view` back to the projection's
    shape), sigmoid and softplus of each, heads moved first (their gradients come back
    transposed: softplus_backward's CPU output is transposed, its fake one contiguous)."""

    def __init__(self, width: int = 8, heads: int = 2, per_head: int = 2):
        super().__init__()
        self.heads, self.per_head = heads, per_head
        self.proj = nn.Linear(width, heads * 2 * per_head)
        self.bias = nn.Parameter(torch.rand(heads * per_head))

    def forward(self, x):
        batch, seq, _ = x.shape
        mixed = self.proj(x).view(batch, seq, self.heads, 2 * self.per_head)
        b, a = torch.split(mixed, [self.per_head, self.per_head], dim=3)
        beta = b.reshape(batch, seq, -1).sigmoid()
        g = F.softplus(a.reshape(batch, seq, -1) + self.bias)
        beta, g = (t.transpose(1, 2).contiguous() for t in (beta, g))
        return (beta * g.cumsum(-1)).square().mean()


def _gate_heads():
    torch.manual_seed(0)
    return GateHeads(), torch.randn(2, 16, 8)


def test_cat_then_view_of_a_transposed_gradient_equals_eager_bitwise():
    model, x = _gate_heads()
    reference = copy.deepcopy(model)
    loss = mx.compile(model, mx.Plan(), example=(x,))(x)
    expected = reference(x)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_without_the_pass_the_traced_view_fails():
    """The module reproduces the failure: with safe_views_joint disabled, the backward's
    `view` of the `cat` meets the CPU's strides."""
    model, x = _gate_heads()
    step = mx.compile(model, mx.Plan(disable_passes=("safe_views_joint",)), example=(x,))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        step(x)


def test_qwen3_next_tiny_matches_eager_in_fp32():
    """Qwen3-Next from transformers' defaults, sizes shrunk (benchmarks/hf_zoo): one step on
    one device. Under torch.export the model builds its triangular inverse by forward
    substitution (`is_torchdynamo_exporting()`), eager by `solve_triangular`: against eager
    taking the export's branch, loss and gradients are bitwise equal; against plain eager,
    the loss is within 1e-6 relative and each gradient within 1e-6 of the largest."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next

    from benchmarks.hf_zoo.cells import BATCH, batches, build
    model = build("qwen3_next")
    same_branch, plain = copy.deepcopy(model), copy.deepcopy(model)
    tokens, targets = batches(BATCH, 1)[0]
    loss = mx.compile(model, mx.Plan(), example=(tokens, targets))(tokens, targets)
    with mock.patch.object(modeling_qwen3_next, "is_torchdynamo_exporting", lambda: True):
        same_loss = same_branch(tokens, targets)
    same_loss.backward()
    plain_loss = plain(tokens, targets)
    plain_loss.backward()
    assert torch.equal(loss, same_loss)
    assert abs(loss.item() - plain_loss.item()) <= 1e-6 * abs(plain_loss.item())
    grads = {name: p.grad for name, p in model.named_parameters()}
    largest = max(p.grad.abs().max().item() for p in plain.parameters())
    for (name, p), q in zip(same_branch.named_parameters(), plain.parameters(), strict=True):
        assert grads[name] is not None, name
        assert torch.equal(grads[name], p.grad), name
        assert (grads[name] - q.grad).abs().max().item() <= 1e-6 * largest, name


def test_eval_loss_runs_the_rule_and_equals_eager_bitwise():
    """A forward-only compile runs the same rule (`safe_views`, after the forward passes)."""
    model, x = _gate_heads()
    step = mx.compile(model, mx.Plan(), example=(x,))
    loss = step.eval_loss(x)
    assert "safe_views" in [r["pass"] for r in step.contexts[-1].records]
    with torch.no_grad():
        assert torch.equal(loss, model.eval()(x))
