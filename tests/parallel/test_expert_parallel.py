"""Expert parallelism (`Plan(ep=N)`) on gloo processes vs the single-process model.

`check_plan` (tests/runtime/test_pipeline_exec.py) runs the compiled step on each data-parallel
rank's batch and compares the loss (1e-5), the gradients after one step (1e-4) and the
parameters after 3 AdamW steps (1e-4) with eager autograd on the global batch. Expert
weights are compared with this rank's experts: [r*E/ep, (r+1)*E/ep) along dim 0.
Router aux loss and expert bias stay per rank, so the models run with aux_loss_coef=0.
Blocks are found by what they do (passes/sharding/moe_blocks.py): besides mxgraph's two forms, a
hand-built loop over the experts (torch.where selection, index_add_ combine) is sharded,
and forms expert parallelism cannot shard are refused by a PlanError that names the
weights, the op and the module (Hugging Face models: tests/parallel/test_hf_expert_parallel.py).
"""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models
import mxgraph as mx
import tests.runtime.test_pipeline_exec as pipeline_exec
from mxgraph.capture import capture
from mxgraph.context import CompileContext
from mxgraph.driver import compile_step, fake_model
from mxgraph.passes.sharding.ep import shard_ep_pass, stable_toposort
from mxgraph.runtime.cluster.mesh import Mesh
from tests.distributed import run_ranks
from tests.parallel.test_moe_blocks import HandMoE


def check_ep(rank, world, model_name, plan_kwargs, steps=3, model_kwargs=None, lr=1e-2):
    pipeline_exec.check_plan(rank, world, model_name, plan_kwargs, steps,
                             model_kwargs=model_kwargs, lr=lr)


@pytest.mark.parametrize("expert_impl", ["grouped_mm", "loop"])
def test_ep2_moe_tiny(expert_impl):
    run_ranks(2, check_ep, "moe-tiny", dict(ep=2), 3, dict(expert_impl=expert_impl))


def test_ep2_cp2_moe_tiny():
    """Expert gradients reduce over edp x cp (runtime/data_parallel/buckets.py): with edp = 1, the sum
    of the two sequence halves' gradients of this rank's experts."""
    run_ranks(4, check_ep, "moe-tiny", dict(ep=2, cp=2), 2,
              dict(n_layers=2, expert_impl="grouped_mm"), 1e-3)


def test_tp2_ep2_moe_tiny():
    # lr 1e-3: at 1e-2 two AdamW steps already turn TP's summation-order differences
    # into a different top-k choice for some token (tp2 x dp2 without EP does the same)
    run_ranks(4, check_ep, "moe-tiny", dict(tp=2, ep=2), 3,
              dict(expert_impl="grouped_mm", n_layers=2), 1e-3)


@settings(max_examples=1, deadline=None)
@given(experts=st.sampled_from([2, 4, 6]), topk=st.integers(1, 2),
       shared=st.integers(0, 1), dense=st.integers(0, 1),
       score=st.sampled_from(["softmax", "sigmoid"]),
       impl=st.sampled_from(["grouped_mm", "loop"]), attention=st.sampled_from(["mla", "gqa"]))
def test_ep2_drawn_moe(experts, topk, shared, dense, score, impl, attention):
    config = dict(n_layers=2, dim=64, n_heads=2, n_kv_heads=1, moe_ffn_dim=32, ffn_dim=96,
                  n_routed_experts=experts, topk=topk, n_groups=1, topk_groups=1,
                  n_shared_experts=shared, n_dense_layers=dense, score_func=score,
                  expert_impl=impl, attention=attention)
    run_ranks(2, check_ep, "moe-tiny", dict(ep=2), 1, config)


def _paper_pass(model, ep):
    tokens = torch.randint(0, 256, (2, 8))
    forward = capture(model, (tokens, tokens), {})
    ctx = CompileContext(plan=mx.Plan(), mesh=Mesh.on_paper(dp=ep, ep=ep))
    return shard_ep_pass(forward.gm, ctx)


def test_ep_must_divide_experts():
    model = models.build_model("moe-tiny", n_layers=2, expert_impl="grouped_mm")  # 8 experts
    with pytest.raises(mx.PlanError, match=r"ep=3 does not divide the number of routed "
                                           r"experts 8 .*choose ep in \[1, 2, 4, 8\]"):
        _paper_pass(model, 3)


def test_capacity_form_is_refused():
    model = models.build_model("moe-tiny", n_layers=2, capacity_factor=1.5)
    with pytest.raises(mx.PlanError, match=r"expert weights layers\.1\.mlp\.experts\.w_gate "
                                           r"\[8, 64, 128\] read by aten\.bmm at layers\.1\.mlp, "
                                           r"a capacity-padded form; ep needs a dropless form .*"
                                           r"set ep=1 or route without capacity$"):
        _paper_pass(model, 2)


@pytest.mark.parametrize("expert_impl", ["grouped_mm", "loop"])
def test_pass_keeps_local_experts_only(expert_impl):
    model = models.build_model("moe-tiny", n_layers=2, expert_impl=expert_impl)
    gm = _paper_pass(model, 2)
    sharded = [n for n in gm.graph.find_nodes(op="placeholder") if "ep_shard_dim" in n.meta]
    assert len(sharded) == 3 and all(n.meta["val"].shape[0] == 4 for n in sharded)
    ops = [n.target for n in gm.graph.nodes]
    assert ops.count(torch.ops.mxgraph.ep_dispatch.default) == 1
    assert ops.count(torch.ops.mxgraph.ep_combine.default) == 1
    if expert_impl == "loop":  # four experts' chains of three linears left
        selects = [n for n in gm.graph.nodes if n.target is torch.ops.aten.select.int
                   and n.args[0] in sharded]
        assert sorted(n.args[2] for n in selects) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_ep2_hand_built_loop_over_experts():
    """A loop over range(E) selecting each expert's tokens with torch.where on a one-hot
    mask and adding its output back with index_add_ (the loop-by-gather form)."""
    run_ranks(2, check_ep, functools.partial(HandMoE, "nonzero"), dict(ep=2), 3)


def _paper_compile(model, ep=2):
    tokens = torch.randint(0, 256, (2, 8))
    model, inputs = fake_model(model, (tokens, tokens))
    plan, mesh = mx.Plan(ep=ep), Mesh.on_paper(ep=ep, dp=ep)
    return compile_step(model, plan, mesh, CompileContext(plan=plan, mesh=mesh), inputs, {},
                        stop_after="shard_ep")


def test_hand_built_capacity_block_is_refused():
    with torch.device("meta"):
        model = HandMoE("capacity")
    with pytest.raises(mx.PlanError, match=r"^expert parallelism \(ep=2\) found the expert "
                                           r"weights w_in \[4, 32, 16\] read by aten\.bmm at "
                                           r"<top>, a capacity-padded form; ep needs a dropless "
                                           r"form \(grouped GEMM with offsets, .*\); set ep=1 "
                                           r"or route without capacity$"):
        _paper_compile(model)


def test_hand_built_module_per_expert_is_refused():
    with torch.device("meta"):
        model = HandMoE("modules")
    with pytest.raises(mx.PlanError, match=r"expert weights experts\.0\.0\.weight \[32, 16\] "
                                           r"read by aten\.linear at experts\.0\.0, experts "
                                           r"held as one module each .*stacked in one parameter "
                                           r"\[E, \.\.\.\].*set ep=1$"):
        _paper_compile(model)


def test_no_expert_block_is_refused():
    with torch.device("meta"):
        model = models.build_model("llama-tiny", n_layers=1)
    with pytest.raises(mx.PlanError, match=r"found no routed-MoE block .*; set ep=1$"):
        _paper_compile(model)


def test_stable_toposort_moves_only_what_must_move():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(torch.neg, (x,))
    graph.output(graph.call_function(torch.add, (a, b)))
    late = graph.call_function(torch.sin, (x,))  # created after the output, read by `a`
    a.args = (late,)
    stable_toposort(graph)
    graph.lint()
    assert [n.name for n in graph.nodes] == ["x", "neg", "sin", "relu", "add", "output"]
