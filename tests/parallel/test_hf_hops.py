"""Higher-order ops with submodules (`mxgraph/hops.py`): `torch.no_grad()` and `torch.autocast`
regions inside forward, as torch.export captures them (`wrap_with_set_grad_enabled`,
`wrap_with_autocast`), compile and train like eager: PhiMoE from transformers' defaults on
one device, hand-built modules on one device, under pp=2 (1F1B, 2 gloo ranks) and tp=2. And
the `torch.compile(backend="mxmaca")` forward of an in-place `copy_` into slices of a fresh
buffer (deepseek_v3's key assembly) is differentiable (no fallback, eager's gradients).

Tolerances, fp32 (the suite's, tests/runtime/test_pipeline_exec.py): loss 1e-5 relative, gradients
and parameters 1e-4 of the reference's norm (floored at 1e-3 of the largest norm). The
one-device PhiMoE loss is bitwise equal to eager (the same ops in the same order, random
routing draws included, from the same seed).
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxgraph as mx
from mxgraph.backend import BackendFallbackWarning
from mxgraph.capture import capture
from mxgraph.errors import TraceError
from tests.distributed import run_ranks
from tests.helpers import rel_err
from tests.runtime.test_pipeline_exec import GRAD_TOL, LOSS_TOL, check_plan, floored_err, largest_norm

VOCAB, WIDTH = 256, 32


class Block(nn.Module):
    """A residual block whose scale and mask are computed under `torch.no_grad()` (as
    PhiMoE's router computes its sparsity mask): no gradient may flow through them; with
    `autocast`, its projection runs under `torch.autocast` in bf16."""

    def __init__(self, autocast: bool):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.autocast = autocast

    def forward(self, x):
        h = self.norm(x)
        with torch.no_grad():
            scale = h.abs().amax(-1, keepdim=True) + 1.0       # floating: read through a detach
            keep = (h.amax(-1, keepdim=True) - h) < 1.5          # bool: carries no gradient
            with torch.enable_grad():
                gate = torch.sigmoid(h)                            # grad mode back on: differentiable
        if self.autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                up = self.up(h)                                    # bf16 linear
            up = up.float()
        else:
            up = self.up(h)
        return x + self.down(F.silu(up)) * gate / scale + h.masked_fill(keep, 0.0) * 0.1


class ToyLM(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy; two `Block`s in a ModuleList."""

    def __init__(self, autocast: bool = False, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(autocast) for _ in range(num_layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def toy(autocast: bool = False) -> ToyLM:
    return ToyLM(autocast)


def test_regions_are_inlined_with_detached_no_grad_outputs():
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 8))
    gm = capture(toy(autocast=True), (tokens, tokens), {}).gm
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "higher_order" in t], targets
    assert not list(gm.named_children())
    detached = [n.args[0] for n in gm.graph.find_nodes(op="call_function",
                                                        target=torch.ops.aten.detach.default)]
    # per block: the scale (floating) is cut where the grad-enabled code reads it; the bool
    # mask is not; the sigmoid computed under enable_grad inside the region stays connected
    assert len(detached) == 2 and all(n.meta["val"].is_floating_point() for n in detached)
    casts = [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten._to_copy.default)
             if n.kwargs.get("dtype") is torch.bfloat16]
    assert len(casts) == 2 * 3  # per block: input, weight and bias of the bf16 linear


@pytest.mark.parametrize("autocast", [False, True])
def test_one_device_matches_eager(autocast):
    check_plan(0, 1, toy, {}, 2, 4, 8, {"autocast": autocast})


@pytest.mark.parametrize("autocast", [False, True])
def test_pp2_1f1b_matches_eager(autocast):
    run_ranks(2, check_plan, toy, dict(pp=2, schedule="1f1b", micro_batches=2), 2, 4, 8,
              {"autocast": autocast})


def test_tp2_matches_eager():
    run_ranks(2, check_plan, toy, dict(tp=2), 2, 4, 8)


def test_model_detach_stops_gradients():
    """A `.detach()` in the model survives the forward clean-up (remove_noop keeps it until
    autograd): the gradient is eager's, not the one through the detached value."""
    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return (h * h.detach()).sum()

    torch.manual_seed(0)
    model, x = Detached(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    loss = mx.compile(model, mx.Plan(), example=(x,))(x)
    reference(x).backward()
    assert loss.item() == reference(x).item()
    torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad, rtol=1e-6, atol=1e-6)


def test_control_flow_hop_is_refused_by_name():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,)).sum()

    with pytest.raises(TraceError, match="higher-order op cond"):
        capture(Branch(), (torch.randn(4, 8),), {})


def test_phimoe_one_device_matches_eager():
    """PhiMoE's router computes its sparsity masks under `torch.no_grad()` and samples experts
    (Gumbel) in training: transformers' defaults, sizes only shrunk, training mode."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.hf_zoo.cells import CausalLMLoss
    from benchmarks.hf_zoo.shrink import shrink
    config = shrink(transformers.CONFIG_MAPPING["phimoe"]())
    torch.manual_seed(0)
    model = CausalLMLoss(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)).train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, config.vocab_size, (2, 16), generator=g) for _ in range(2))
    step = mx.compile(model, mx.Plan(), example=(tokens, targets))
    torch.manual_seed(7)
    loss = step(tokens, targets)
    torch.manual_seed(7)
    ref_loss = reference(tokens, targets)
    ref_loss.backward()
    assert loss.item() == ref_loss.item()
    ref_params = dict(reference.named_parameters())
    scale = largest_norm(reference, "grad")
    for name, param in model.named_parameters():
        ref = ref_params[name].grad
        if ref is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        assert floored_err(param.grad, ref, scale) <= GRAD_TOL, name


def phimoe_eval() -> nn.Module:
    """The zoo's PhiMoE (transformers' defaults, sizes only) in eval mode: no Gumbel sampling,
    so micro-batches on two ranks route as eager does; the no_grad mask regions stay."""
    from benchmarks.hf_zoo.cells import build
    return build("phimoe").eval()


def test_phimoe_pp2_1f1b_matches_eager():
    pytest.importorskip("transformers")
    run_ranks(2, check_plan, phimoe_eval, dict(pp=2, schedule="1f1b", micro_batches=2), 2, 2, 16)


class SliceCopy(nn.Module):
    """Writes two projections into slices of a fresh buffer with `copy_` (deepseek_v3's
    `expand_kv`): functionalized, an `aten.copy` that autograd cannot differentiate."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6), nn.Linear(8, 1)

    def forward(self, x):
        out = x.new_empty(*x.shape[:-1], 8)
        out[..., :6].copy_(self.a(x))
        out[..., 6:].copy_(self.b(x).expand(-1, 2))           # broadcast in the copy
        transposed = x.new_empty(8, x.shape[0]).t()           # a dense, non-contiguous target
        transposed.copy_(self.a(x).sum(-1, keepdim=True).to(torch.float64))  # cast in the copy
        return (out.view(-1) ** 2).sum() + transposed.float().sum()


def test_backend_differentiates_copy_into_slices():
    torch.manual_seed(0)
    model, x = SliceCopy(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)  # the region keeps the passes
        loss = torch.compile(model, backend="mxmaca")(x)
    loss.backward()
    ref_loss = reference(x)
    ref_loss.backward()
    assert rel_err(loss.detach(), ref_loss.detach()) <= LOSS_TOL
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-6, name  # the same ops: rounding-level at most


class RoundSTE(torch.autograd.Function):
    """round() with a straight-through gradient: a backward no op formula derives."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return RoundSTE.apply(self.lin(x) * 4).pow(2).mean()


def test_backend_keeps_a_custom_autograd_function_backward(monkeypatch):
    """Dynamo keeps the Function's backward (`autograd_function_apply`); a functional forward
    would lose it (round's gradient is 0), so the region falls back with the warning."""
    monkeypatch.delenv("MXGRAPH_STRICT", raising=False)  # the fallback this test checks
    torch.manual_seed(0)
    model, x = Quantized(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    with pytest.warns(BackendFallbackWarning, match="custom autograd.Function"):
        loss = torch.compile(model, backend="mxmaca")(x)
    loss.backward()
    reference(x).backward()
    assert reference.lin.weight.grad.abs().max() > 0
    torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad, rtol=1e-6, atol=0)


class SameDtypeCast(nn.Module):
    """A no_grad region casts `h` to its own dtype (dots3_note's indexer: `.to` hands back
    the same tensor); the tracer then records the later, grad-enabled read of `h` as a read
    of that cast."""

    def __init__(self):
        super().__init__()
        self.lin, self.score, self.gate = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            keep = self.score(h.to(h.dtype)) > 0
        return (self.gate(h) * keep).pow(2).sum()


def test_a_cast_to_the_same_dtype_in_a_no_grad_region_keeps_gradients():
    torch.manual_seed(0)
    model, x = SameDtypeCast(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    step = mx.compile(model, mx.Plan(), example=(x,))
    loss = step(x)
    ref_loss = reference(x)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss.detach())
    assert reference.lin.weight.grad.abs().max() > 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            assert rel_err(p.grad, q.grad) <= 1e-6, name


def test_a_traced_constant_names_the_module_that_made_it():
    """torch.export's check after tracing (a constant holding a traced value; gemma3n_text
    from its defaults) has no module stack left: the message names the module from the
    constant's attribute path."""
    from mxgraph.capture import _describe_failure
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    error = RuntimeError("We found a fake tensor in the exported program constant's list. ... "
                         "you can refer to following model attribute: 1.0.lifted_tensor_3. "
                         "Please file an issue on github.")
    message = _describe_failure(model, [], error)
    assert message.startswith("cannot trace module 1.0 (ReLU): a tensor its forward creates "
                              "(torch.export's `1.0.lifted_tensor_3`)"), message
    assert "Create that tensor once in __init__" in message
