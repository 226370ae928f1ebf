"""Donated buffers under Inductor codegen (mxgraph/codegen/donation.py): a backward program
writes its results over saved values that die with it, as torch.compile's backward does,
and over nothing else: never a parameter, an input, a view of either, or a value a later
program or the executor still reads."""
import copy
import types
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import models
import mxgraph as mx
from mxgraph.codegen.donation import donated
from tests.distributed import run_ranks
from tests.helpers import batch, rel_err


def _programs(fn, examples, b_inputs: int):
    """A fake StagePrograms over `fn`'s graph: its placeholders are the stage's inputs,
    its first `b_inputs` computed values B's inputs, and the rest W's; no outputs."""
    gm = make_fx(fn)(*examples)
    computed = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in gm.graph.nodes:
        if node.op != "output" and "val" not in node.meta:
            raise AssertionError(node)
    b, w = computed[:b_inputs], computed[b_inputs:]
    stage = types.SimpleNamespace(
        forward_outputs=[], input_grads={}, param_grads=[], weight_reads=frozenset(w),
        backward_input=types.SimpleNamespace(inputs=b),
        backward_weight=types.SimpleNamespace(inputs=w))
    return gm, stage


def test_only_fresh_saved_values_whose_views_die_too_are_donated():
    def fn(weight, x):
        h = x @ weight                   # fresh: donated to B
        t = weight.t()                   # a view of a parameter: never
        g = torch.relu(x)                # fresh, but its view v is read by W: not to B
        v = g.view(-1)
        s = torch.sigmoid(x)             # fresh, W's only: donated to W
        return h, t, g, v, s
    gm, stage = _programs(fn, (torch.randn(4, 4), torch.randn(3, 4)), b_inputs=3)
    names = {kind: sorted(n.name for n in nodes) for kind, nodes in donated(stage).items()}
    assert names["B"] == ["mm"], names
    assert "t" not in names["W"] and "view" not in names["W"] and "sigmoid" in names["W"], names


def test_a_lowered_step_reuses_donated_buffers_and_leaves_parameters_and_inputs(monkeypatch,
                                                                             tmp_path):
    """llama-tiny, one layer, Inductor codegen: W's output code writes over a donated saved
    value; a further step leaves every parameter and the batch bitwise as they were, and its
    gradients match eager within 1e-4."""
    monkeypatch.setenv("MXGRAPH_STRICT", "1")
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=1)
    reference = copy.deepcopy(model)
    step = mx.compile(model, mx.Plan(codegen="inductor", dump_dir=str(tmp_path)))
    tokens, targets = batch(batch_size=2, seq_len=16)
    step(tokens, targets)
    code = next(tmp_path.glob("**/inductor_stage0_W.py")).read_text()
    assert "= donated_" in code and "# reuse" in code
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = tokens.clone(), targets.clone()
    model.zero_grad(set_to_none=True)
    step(tokens, targets)
    reference(tokens, targets).backward()
    assert torch.equal(tokens, inputs[0]) and torch.equal(targets, inputs[1])
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
        assert rel_err(param.grad, grads[name].grad) <= 1e-4, name


def _ep2_donates(rank, world, dump_dir):
    from tests.runtime.test_pipeline_exec import check_plan
    # one layer, a MoE one: the symbolic sizes are the experts' (half the C++ to compile cold)
    check_plan(rank, world, "moe-tiny", dict(ep=2, codegen="inductor", dump_dir=dump_dir), 2,
               model_kwargs=dict(n_layers=1, n_dense_layers=0))
    codes = [p.read_text() for p in Path(dump_dir).glob("**/inductor_stage0_*.py")]
    assert any("= donated_" in code and "# reuse" in code for code in codes), dump_dir


@pytest.mark.slow(seconds=60)  # measured on 2 cores, cold Inductor cache (2 layers: 92 s)
def test_expert_parallel_programs_of_symbolic_sizes_donate_too(monkeypatch, tmp_path):
    """ep=2 under Inductor codegen: the programs' sizes are symbols (tokens received from
    each rank), and their backward programs still write over the saved values that die with
    them; loss, gradients and parameters after two AdamW steps match eager (check_plan)."""
    monkeypatch.setenv("MXGRAPH_STRICT", "1")
    run_ranks(2, _ep2_donates, str(tmp_path))
