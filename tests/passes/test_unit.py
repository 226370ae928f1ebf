"""Testing layer 1 for the forward passes (mxgraph/passes/pipeline.py FORWARD_PASSES, shard_ep
aside): each pass on a small traced module, run through `run_pass`, checked against what its
docstring and passes/README.md guarantee, and on a graph it should leave alone (the same gm
object, the same nodes). The joint passes: tests/passes/test_unit_joint.py.

Sharding runs on a paper mesh (`Mesh.on_paper`): collectives are inserted, never run.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

from mxgraph.capture import ForwardGraph, capture, model_tensors, slot_tensor
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import ancestors
from mxgraph.joint import build_joint
from mxgraph.passes.fusion.fuse import fused_counts
from mxgraph.passes.pipeline import FORWARD_PASSES, JOINT_PASSES
from mxgraph.passes.runner import run_pass
from mxgraph.plan import Plan
from mxgraph.runtime.cluster.mesh import Mesh

aten = torch.ops.aten
mx = torch.ops.mxgraph
SPECS = {spec.name: spec for spec in FORWARD_PASSES + JOINT_PASSES}


# ---- helpers (the joint file imports them) ------------------------------------------------
def nodes_of(gm: GraphModule) -> list[str]:
    """The graph as text, one line per node: equal lists = an unchanged graph."""
    return [node.format_node() for node in gm.graph.nodes]


def calls(gm: GraphModule, target) -> list:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def run(name: str, gm: GraphModule, plan: Plan | None = None, mesh=None):
    """(the pass's result, its context) for pass `name` through the runner."""
    ctx = CompileContext(plan=plan or Plan(), mesh=mesh)
    return run_pass(SPECS[name], gm, ctx), ctx


def assert_left_alone(name: str, gm: GraphModule, plan: Plan | None = None, mesh=None):
    before = nodes_of(gm)
    result, _ = run(name, gm, plan, mesh)
    assert result is gm, f"{name} returned a new GraphModule for a graph it does not change"
    assert nodes_of(result) == before


def forward_inputs(model: nn.Module, forward: ForwardGraph, inputs) -> list:
    """The forward graph's placeholder values: the model's tensors, then `inputs`."""
    tensors = model_tensors(model)
    return [slot_tensor(s, tensors, forward.constants).detach() if s.kind != "input"
            else inputs[s.key] for s in forward.slots]


def joint_of(model: nn.Module, inputs: tuple, forward_passes=(), plan: Plan | None = None):
    """(joint graph, its argument values, the forward graph) of `model` on `inputs`, derived
    as `steps.grad_step` does, after the named forward passes; the loss's tangent is 1."""
    forward = capture(model, inputs, {})
    for name in forward_passes:
        forward.gm, _ = run(name, forward.gm, plan)
    tensors = model_tensors(model)
    joint = build_joint(forward, [slot_tensor(s, tensors, forward.constants)
                                  for s in forward.slots if s.kind != "input"], list(inputs))
    values = []
    for slot in joint.inputs:
        if slot.kind == "tangent":
            values.append(torch.ones(()))
        elif slot.kind == "input":
            values.append(inputs[slot.key])
        else:
            values.append(slot_tensor(slot, tensors, forward.constants).detach())
    return joint, values, forward


def evaluate(gm: GraphModule, values, seed: int = 0) -> list:
    """The graph's outputs on `values` (no autograd; random ops seeded)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return [o for o in gm(*values) if o is not None]


def assert_equal_outputs(got, expected):
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"output {i} differs: max |diff| {(a - b).abs().max()}"


class Block(nn.Module):
    """x -> linear(W1) -> relu -> linear(W2)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class MLP(nn.Module):
    """A `Block`, then the sum; `tail="residual"`: x + block(x) through a second block first;
    `tail="flip"`: the block's output flipped first (aten.flip has no sharding rule)."""

    def __init__(self, tail: str = ""):
        super().__init__()
        self.block = Block()
        self.second = Block() if tail == "residual" else None
        self.tail = tail

    def forward(self, x):
        y = self.block(x)
        if self.tail == "residual":
            y = self.second(x + y)
        elif self.tail == "flip":
            y = torch.flip(y, [-1])
        return y.sum()


def x_bsh():
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))


# ---- remove_noop ----------------------------------------------------------------------------
class Noops(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = self.w(x)
        h = aten.alias(h).detach()
        h = F.dropout(h, p=0.0, training=True)
        h = F.dropout(h, p=0.5, training=False)
        h = aten._to_copy(h, dtype=torch.float32)
        return torch.relu(h).sum()


IDENTITIES = (aten.alias.default, aten.dropout.default, aten._to_copy.default)


def test_remove_noop_drops_identities_and_rewires_their_users():
    """Before autograd a detach stops gradients: the forward pass keeps it, the joint one
    (after autograd) drops it too."""
    model, x = Noops(), x_bsh()
    forward = capture(model, (x,), {})
    gm = forward.gm
    assert all(calls(gm, op) for op in IDENTITIES + (aten.detach.default,)), nodes_of(gm)
    values = forward_inputs(model, forward, (x,))
    expected = evaluate(gm, values)
    result, _ = run("remove_noop", gm)
    assert result is gm
    assert not any(calls(gm, op) for op in IDENTITIES), nodes_of(gm)
    (relu,) = calls(gm, aten.relu.default)
    (detach,) = calls(gm, aten.detach.default)
    assert relu.args[0] is detach and detach.args[0] is calls(gm, aten.linear.default)[0]
    assert_equal_outputs(evaluate(gm, values), expected)
    result, _ = run("remove_noop_joint", gm)
    assert result is gm and not calls(gm, aten.detach.default)
    assert relu.args[0] is calls(gm, aten.linear.default)[0]
    assert_equal_outputs(evaluate(gm, values), expected)


def test_remove_noop_drops_unused_metadata_asserts():
    mode = FakeTensorMode()
    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"] = mode.from_tensor(torch.randn(4))
    graph.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    neg = graph.call_function(aten.neg.default, (x,))
    neg.meta["val"] = aten.neg.default(x.meta["val"])
    graph.output((neg,))
    gm = GraphModule(nn.Module(), graph)
    result, _ = run("remove_noop", gm)
    assert result is gm and not calls(gm, aten._assert_tensor_metadata.default)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]


class FreshCache(nn.Module):
    """A key/value cache created in the forward, as transformers' `DynamicCache` is when a
    config keeps its default `use_cache=True`: the first update concatenates an empty 1-D
    tensor (`torch.cat`'s legacy rule skips it) with the keys, and again with the values."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        k = self.w(x).unsqueeze(1)
        cache = torch.tensor([])
        k = torch.cat([cache, k], dim=-2)
        kv = torch.cat([cache, k, k], dim=-2)
        return kv.sum() + k.sum()


def test_remove_noop_drops_the_empty_operands_of_a_fresh_cache_cat():
    model, x = FreshCache(), x_bsh()
    forward = capture(model, (x,), {})
    assert len(calls(forward.gm, aten.cat.default)) == 2, nodes_of(forward.gm)
    values = forward_inputs(model, forward, (x,))
    expected = evaluate(forward.gm, values)
    result, _ = run("remove_noop", forward.gm)
    (cat,) = calls(result, aten.cat.default)  # the one-operand cat is gone, the other kept two
    assert [a.meta["val"].ndim for a in cat.args[0]] == [4, 4], nodes_of(result)
    assert_equal_outputs(evaluate(result, values), expected)


class RealOps(nn.Module):
    """Ops that look like no-ops but are not: a dropout that draws, a cast to another dtype."""

    def forward(self, x):
        h = F.dropout(x, p=0.5, training=True)
        return aten._to_copy(h, dtype=torch.float64).sum()


def test_remove_noop_leaves_real_ops_alone():
    forward = capture(RealOps(), (x_bsh(),), {})
    assert calls(forward.gm, aten.dropout.default) and calls(forward.gm, aten._to_copy.default)
    assert_left_alone("remove_noop", forward.gm)


# ---- shard_tp -------------------------------------------------------------------------------
TP2 = Mesh.on_paper(tp=2)


def shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def test_shard_tp_column_then_row_parallel():
    gm = capture(MLP(), (x_bsh(),), {}).gm
    result, ctx = run("shard_tp", gm, Plan(tp=2), TP2)
    assert result is gm
    w1, w2, x = gm.graph.find_nodes(op="placeholder")
    assert (w1.meta["tp_shard_dim"], w2.meta["tp_shard_dim"]) == (0, 1)
    assert (shape(w1), shape(w2)) == ((8, 8), (8, 8))  # [16, 8] and [8, 16], halved
    first, second = calls(gm, aten.linear.default)
    assert shape(first) == (2, 4, 8) and shape(second) == (2, 4, 8)  # 16 features -> 8 local
    (copy,) = calls(gm, mx.tp_copy.default)
    assert copy.args[0] is x and first.args[0] is copy
    (reduce,) = calls(gm, mx.tp_all_reduce.default)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert order[reduce] > order[second] and second in ancestors([reduce])
    assert gm.graph.find_nodes(op="output")[0].args[0] == (reduce,)
    assert not calls(gm, mx.sp_all_gather.default) and not calls(gm, mx.sp_reduce_scatter.default)
    assert ctx.records[-1]["finding_lines"] == []


def test_shard_tp_sequence_parallel_gathers_before_and_scatters_after():
    """Two MLP blocks with a residual add between them: the first block's partial output is
    reduce-scattered along the sequence, the add runs on sequence shards (x sliced), and the
    second block's input is all-gathered."""
    gm = capture(MLP("residual"), (x_bsh(),), {}).gm
    run("shard_tp", gm, Plan(tp=2, sequence_parallel=True), TP2)
    (scatter,) = calls(gm, mx.sp_reduce_scatter.default)
    (gather,) = calls(gm, mx.sp_all_gather.default)
    (add,) = calls(gm, aten.add.Tensor)
    _, second, third, _ = calls(gm, aten.linear.default)
    assert scatter.args[:2] == (second, 1) and gather.args[1] == 1  # along the sequence
    assert scatter in add.args and gather.args[0] is add and third.args[0] is gather
    assert shape(add) == (2, 2, 8)  # [b, s/tp, h]
    (slice_x,) = calls(gm, mx.tp_slice.default)
    assert slice_x in add.args
    assert len(calls(gm, mx.tp_all_reduce.default)) == 1  # the loss only


def test_shard_tp_op_without_rule_is_a_finding_and_strict_raises():
    gm = capture(MLP("flip"), (x_bsh(),), {}).gm  # the flip reads the partial block output
    _, ctx = run("shard_tp", gm, Plan(tp=2), TP2)
    (finding,) = ctx.records[-1]["finding_lines"]
    assert "aten::flip" in finding and "no sharding rule" in finding
    (reduce,) = calls(gm, mx.tp_all_reduce.default)
    assert calls(gm, aten.flip.default)[0].args[0] is reduce  # gathered before the flip
    gm = capture(MLP("flip"), (x_bsh(),), {}).gm
    with pytest.raises(PlanError, match="strict_sharding: aten::flip"):
        run("shard_tp", gm, Plan(tp=2, strict_sharding=True), TP2)


class FlipInside(nn.Module):
    """relu(x W1^T) flipped along its features before W2: the column shard cannot pass."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block.w2(torch.flip(torch.relu(self.block.w1(x)), [-1])).sum()


def test_shard_tp_keeps_a_weight_whole_whose_shard_would_only_be_gathered():
    """The module docstring: a column-parallel weight whose shard reaches a gather stays
    replicated (found in a trial run), so nothing is gathered and nothing is a finding."""
    gm = capture(FlipInside(), (x_bsh(),), {}).gm
    _, ctx = run("shard_tp", gm, Plan(tp=2), TP2)
    w1 = gm.graph.find_nodes(op="placeholder")[0]
    assert "tp_shard_dim" not in w1.meta and shape(w1) == (16, 8)
    (flip,) = calls(gm, aten.flip.default)
    assert flip.args[0].target is aten.relu.default  # no gather in front of it
    assert ctx.records[-1]["finding_lines"] == []


@pytest.mark.parametrize("mesh", [None, Mesh.on_paper()], ids=["one-device", "tp1"])
def test_shard_tp_leaves_tp1_alone(mesh):
    assert_left_alone("shard_tp", capture(MLP(), (x_bsh(),), {}).gm, Plan(), mesh)


# ---- shard_cp -------------------------------------------------------------------------------
CP2 = Mesh.on_paper(cp=2)


class CausalAttention(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def cp_input():
    return torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))


def test_shard_cp_cuts_inputs_gathers_kv_masks_and_replicates_the_loss():
    model = CausalAttention()
    gm = capture(model, (cp_input(),), {}).gm
    weight, x = gm.graph.find_nodes(op="placeholder")
    result, ctx = run("shard_cp", gm, Plan(cp=2), CP2)
    assert result is gm
    cut = next(n for n in calls(gm, mx.cp_chunk.default) if n.args[0] is x)
    assert cut.args[1] == 1 and list(x.users) == [cut] and shape(cut) == (2, 4, 8)
    assert shape(weight) == (24, 8) and "tp_shard_dim" not in weight.meta  # unchanged
    (attn,) = calls(gm, aten.scaled_dot_product_attention.default)
    q, k, v, mask = attn.args[:4]
    assert shape(q) == (2, 2, 4, 4)  # this rank's 4 of 8 queries
    for kv in (k, v):
        assert kv.target is mx.cp_all_gather.default and kv.args[1] == 2
        assert shape(kv) == (2, 2, 8, 4)  # every key
    assert mask.target is aten.ge.Tensor and shape(mask) == (4, 8)  # my queries x all keys
    assert attn.args[5] is False and not attn.kwargs.get("is_causal", False)
    rows = mask.args[0]
    assert any(n.target is mx.cp_chunk.default for n in ancestors([rows]))  # my positions
    (out,) = gm.graph.find_nodes(op="output")[0].args[0]
    assert out.target is mx.cp_replicated.default
    assert out.args[0].target is mx.cp_all_reduce.default  # the mean over the sequence
    assert shape(out) == ()
    assert ctx.records[-1]["finding_lines"] == []


def test_shard_cp_refuses_a_sequence_not_divisible_by_2cp():
    gm = capture(CausalAttention(), (torch.randn(2, 6, 8),), {}).gm
    with pytest.raises(PlanError, match=r"divisible by 2\*cp = 4"):
        run("shard_cp", gm, Plan(cp=2), CP2)


@pytest.mark.parametrize("mesh", [None, Mesh.on_paper()], ids=["one-device", "cp1"])
def test_shard_cp_leaves_cp1_alone(mesh):
    assert_left_alone("shard_cp", capture(CausalAttention(), (cp_input(),), {}).gm, Plan(),
                      mesh)


# ---- fuse -----------------------------------------------------------------------------------
class SwiGLUMLP(nn.Module):
    def __init__(self, act=F.silu):
        super().__init__()
        self.gate = nn.Linear(8, 16, bias=False)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.act = act

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x)).sum()


def test_fuse_swiglu_is_one_op_and_bitwise_equal():
    torch.manual_seed(0)
    model, x = SwiGLUMLP(), x_bsh()
    forward = capture(model, (x,), {})
    gm = forward.gm
    values = forward_inputs(model, forward, (x,))
    expected = evaluate(gm, values)
    (mul,) = calls(gm, aten.mul.Tensor)
    module = mul.meta["custom"]["module"]
    result, _ = run("fuse", gm, Plan(fusion=True))
    assert result is gm
    assert fused_counts(gm) == {"swiglu": 1}
    (fused,) = calls(gm, mx.swiglu.default)
    gate, up = calls(gm, aten.linear.default)[:2]
    assert fused.args == (gate, up)
    assert not calls(gm, aten.silu.default) and not calls(gm, aten.mul.Tensor)
    custom = fused.meta["custom"]
    assert "fused:swiglu" in custom["tags"] and set(custom["fused_from"]) == {"silu", "mul"}
    assert custom["module"] == module and fused.meta["created_by"] == "fuse"  # provenance
    assert shape(fused) == (2, 4, 16)
    assert_equal_outputs(evaluate(gm, values), expected)


def test_fuse_swiglu_gradients_bitwise_equal_to_unfused():
    """The fused op's registered backward, derived by AOTAutograd, against the unfused joint."""
    torch.manual_seed(0)
    model, x = SwiGLUMLP(), x_bsh()
    plain, values, _ = joint_of(model, (x,))
    fused, fused_values, _ = joint_of(model, (x,), ["fuse"], Plan(fusion="swiglu"))
    assert calls(fused.gm, mx.swiglu.default) and calls(fused.gm, mx.swiglu_backward.default)
    assert_equal_outputs(evaluate(fused.gm, fused_values), evaluate(plain.gm, values))


@pytest.mark.parametrize("plan", [Plan(fusion=True), Plan(fusion=False)], ids=["no-match", "off"])
def test_fuse_leaves_unmatched_or_unselected_graphs_alone(plan):
    act = F.relu if plan.fusion else F.silu  # relu(a) * b: no pattern; fusion off: none runs
    assert_left_alone("fuse", capture(SwiGLUMLP(act), (x_bsh(),), {}).gm, plan)


class Einsums(nn.Module):
    """Two einsum projections over [batch, seq, features], written as equations."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))
        self.v = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        h = torch.einsum("bsd,df->bsf", x, self.w).relu()
        return torch.einsum("bsf,fd->bsd", h, self.v).pow(2).mean()


def test_shard_cp_einsum_keeps_the_token_shard():
    gm = capture(Einsums(), (x_bsh(),), {}).gm
    _, ctx = run("shard_cp", gm, Plan(cp=2, strict_sharding=True), Mesh.on_paper(cp=2))
    assert not ctx.records[-1].get("finding_lines")
    einsums = calls(gm, aten.einsum.default)
    assert [shape(e) for e in einsums] == [(2, 2, 16), (2, 2, 8)]  # this rank's s/cp rows


def test_einsum_contracting_a_shard_is_partial():
    from mxgraph.passes.sharding.einsum import einsum_rule
    from mxgraph.passes.sharding.placement import P, R, Shard

    class Sharder:  # the three calls the rule makes
        def __init__(self, places):
            self.places, self.needs = places, []

        def of(self, x):
            return self.places.get(x, R)

        def ndim(self, x):
            return 3 if x == "h" else 2

        def need(self, node, x, placement):
            self.needs.append((x, placement))

    node = torch.fx.Graph().call_function(aten.einsum.default, ("bsf,fd->bsd", ["h", "v"]))
    s = Sharder({"h": Shard(2)})
    assert einsum_rule(s, node) == P and s.needs == [("v", Shard(0))]  # v sliced along f
    s = Sharder({"h": Shard(1)})
    assert einsum_rule(s, node) == Shard(1) and s.needs == []
    assert einsum_rule(Sharder({"h": P}), node) == P
