"""Auto remat (passes/memory/auto_remat.py): under Inductor codegen the joint graph
recomputes what the min-cut partitioner would, after decomposing softmax, layer norm and
NLL loss as torch.compile does; the recompute is bitwise (the joint graph with it and the
decomposed one without it, run op by op, give equal outputs), the saved activations fall
(a loss's fp32 log-softmax is no longer saved), and a plan with its own memory policy or
Python codegen is left alone.

The joint-graph tests compile under Python codegen with the pass's codegen gate patched
open (`lowered_by_inductor`): the joint graph is the same whichever codegen lowers it, and
Inductor's lowering of it (tens of seconds a model here) is the last test's."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import models
import mxgraph as mx
from mxgraph.memory_saved import measure_saved, step_joint
from mxgraph.passes.memory import auto_remat
from mxgraph.passes.memory.auto_remat import decompose_saved, merge_duplicates
from tests.helpers import batch

aten = torch.ops.aten


@pytest.fixture
def inductor_gate(monkeypatch):
    """Auto remat runs as under Inductor codegen; the programs lower with Python codegen."""
    monkeypatch.setattr(auto_remat, "lowered_by_inductor", lambda plan, device_type: True)


def joint(name: str, plan: mx.Plan, dtype=torch.float32, **config):
    torch.manual_seed(0)
    model = models.build_model(name, dtype=dtype, **config)
    step = mx.compile(model, plan)
    return step, step_joint(step, *batch(seq_len=16, seed=0))


def run(gm, inputs):
    with torch.no_grad():
        return torch.fx.Interpreter(gm).run(*inputs)


@pytest.mark.parametrize("name,dtype,layers", [
    ("llama-tiny", torch.bfloat16, dict(n_layers=1)),
    ("moe-tiny", torch.float32, dict(n_layers=1, n_dense_layers=0)),  # one routed-MoE layer
    ("gpt-tiny", torch.float32, dict(n_layers=1))])
def test_auto_remat_bitwise_and_saves_less(name, dtype, layers, inductor_gate):
    _, (gm, inputs) = joint(name, mx.Plan(codegen="python"), dtype, **layers)
    _, (plain, plain_inputs) = joint(name, mx.Plan(codegen="python",
                                                   disable_passes=["auto_remat"]), dtype, **layers)
    recomputed = [n for n in gm.graph.nodes if "recomputed_from" in n.meta]
    assert recomputed and not any("recomputed_from" in n.meta for n in plain.graph.nodes)
    before = measure_saved(plain, plain_inputs)
    assert decompose_saved(plain) > 0
    outputs, expected = run(gm, inputs), run(plain, plain_inputs)
    assert len(outputs) == len(expected)
    for out, ref in zip(outputs, expected, strict=True):
        assert (out is None) == (ref is None)
        if ref is not None:
            assert torch.equal(out, ref)
    after = measure_saved(gm, inputs)
    assert after.device_bytes < before.device_bytes, (after, before)
    if dtype == torch.bfloat16:  # the loss's fp32 log-probabilities (tokens, vocab 256)
        values = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        assert not any(isinstance(v := values[name], torch.Tensor) and v.dtype == torch.float32
                       and tuple(v.shape[-1:]) == (256,) for name, _ in after.values), after.values
    assert not any(n.target == torch.ops.aten._log_softmax.default for n in gm.graph.nodes)


def test_repeated_forward_ops_are_merged_before_the_partitioner(monkeypatch, inductor_gate):
    # each projection of a layer reshapes the normed input again; the partitioner's CSE names
    # only one of them as saved, so without the merge the others (and the norm before them)
    # were recomputed in the backward: more clones, no fewer saved bytes
    _, (gm, inputs) = joint("llama-tiny", mx.Plan(codegen="python"), n_layers=2)
    monkeypatch.setattr(auto_remat, "merge_duplicates", lambda gm: 0)
    _, (unmerged, unmerged_inputs) = joint("llama-tiny", mx.Plan(codegen="python"), n_layers=2)
    clones = [n for n in gm.graph.nodes if "recomputed_from" in n.meta]
    unmerged_clones = [n for n in unmerged.graph.nodes if "recomputed_from" in n.meta]
    assert len(clones) < len(unmerged_clones), (len(clones), len(unmerged_clones))
    assert measure_saved(gm, inputs).device_bytes <= measure_saved(
        unmerged, unmerged_inputs).device_bytes
    assert merge_duplicates(gm) == 0  # nothing left to merge


def _forward_graph(fn, *args):
    gm = make_fx(fn)(*args)
    for node in gm.graph.nodes:
        node.meta["partitioner_tag"] = "is_forward"
    return gm


def test_merge_duplicates_merges_repeats_only_and_is_bitwise():
    def fn(x, w):
        a = (x * w).reshape(-1, 8)
        b = (x * w).reshape(-1, 8)  # repeats a: merged
        return a @ b.t(), x + 0.0, x + -0.0  # the adds differ in a zero's sign: kept apart
    x, w = torch.randn(4, 8), torch.randn(8)
    x[0, 0] = -0.0
    gm = _forward_graph(fn, x, w)
    expected = gm(x, w)
    assert merge_duplicates(gm) == 2  # the mul and the reshape
    assert len([n for n in gm.graph.nodes if n.target == aten.add.Tensor]) == 2
    for out, ref in zip(gm(x, w), expected, strict=True):
        assert torch.equal(out, ref) and torch.equal(out.signbit(), ref.signbit())
    assert merge_duplicates(gm) == 0


def test_a_tensor_concatenated_with_itself_is_decomposed_bitwise():
    def fn(f):
        return torch.cat((f, f), dim=-1).cos()  # a rotary embedding's angles
    f = torch.randn(1, 16, 4)
    gm = _forward_graph(fn, f)
    expected = gm(f)
    assert decompose_saved(gm) == 1
    assert not any(n.target == aten.cat.default for n in gm.graph.nodes)
    assert torch.equal(gm(f), expected)


def test_auto_remat_is_off_under_python_codegen():
    _, (gm, _) = joint("llama-tiny", mx.Plan(codegen="python"), n_layers=2)
    assert not any(n.meta.get("created_by") == "auto_remat" for n in gm.graph.nodes)


@pytest.mark.parametrize("plan", [mx.Plan(codegen="python", recompute="norm"),
                                  mx.Plan(codegen="python", offload="all")])
def test_auto_remat_leaves_plans_with_a_memory_policy_alone(plan, inductor_gate):
    _, (gm, _) = joint("llama-tiny", plan, n_layers=2)
    assert not any(n.meta.get("created_by") == "auto_remat" for n in gm.graph.nodes)
    _, (default, _) = joint("llama-tiny", mx.Plan(codegen="python"), n_layers=2)
    assert any(n.meta.get("created_by") == "auto_remat" for n in default.graph.nodes)


def test_auto_remat_step_matches_eager():
    """A compiled step under Inductor codegen (auto remat on) against the eager model:
    loss and gradients, fp32, relative 1e-5 (Inductor sums in its own order)."""
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=2)
    reference = models.build_model("llama-tiny", n_layers=2)
    reference.load_state_dict(model.state_dict())
    args = batch(seq_len=16, seed=0)
    loss = mx.compile(model, mx.Plan(codegen="inductor"))(*args)
    expected = reference(*args)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5), (loss.item(), expected.item())
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        err = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert err <= 1e-5, (n, err)
