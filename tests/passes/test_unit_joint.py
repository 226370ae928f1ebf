"""Testing layer 1 for the joint passes (mxgraph/passes/pipeline.py JOINT_PASSES): each pass on
the joint graph of a small module (`mxgraph.joint.build_joint`, as `steps.grad_step` derives
it) or on a small traced function, run through `run_pass`, checked against its docstring and
passes/README.md ("bitwise equal" with torch.equal, random ops seeded alike), and on a graph
it should leave alone (the same gm object, the same nodes)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from mxgraph.ir import ancestors, is_alias, is_backward
from mxgraph.plan import Plan
from mxgraph.runtime.offload import get_pool, wait_prefetch
from tests.passes.test_unit import assert_equal_outputs, assert_left_alone, calls, evaluate, joint_of, run, x_bsh

aten = torch.ops.aten
mx = torch.ops.mxgraph


class SiluMLP(nn.Module):
    """x -> linear -> silu -> linear -> sum: silu's output is saved for the second linear's
    weight gradient, its input for silu's backward."""

    def __init__(self, act=F.silu):
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x))).sum()


def silu_joint():
    torch.manual_seed(0)
    return joint_of(SiluMLP(), (x_bsh(),))


def order_of(gm) -> dict:
    return {node: i for i, node in enumerate(gm.graph.nodes)}


# ---- remove_noop_joint ----------------------------------------------------------------------
def test_remove_noop_joint_drops_autograd_detaches_bitwise():
    """AOTAutograd saves tanh's output for its backward through detach nodes."""
    torch.manual_seed(0)
    joint, values, _ = joint_of(SiluMLP(act=torch.tanh), (x_bsh(),))
    gm = joint.gm
    detaches = calls(gm, aten.detach.default)
    assert detaches
    (tanh,) = calls(gm, aten.tanh.default)
    expected = evaluate(gm, values)
    result, _ = run("remove_noop_joint", gm)
    assert result is gm and not calls(gm, aten.detach.default)
    (backward,) = calls(gm, aten.tanh_backward.default)
    assert backward.args[1] is tanh  # rewired past the detach chain
    assert_equal_outputs(evaluate(gm, values), expected)


def test_remove_noop_joint_leaves_a_joint_without_noops_alone():
    joint, _, _ = silu_joint()
    assert not calls(joint.gm, aten.detach.default)
    assert_left_alone("remove_noop_joint", joint.gm)


# ---- fuse_residual_grad ---------------------------------------------------------------------
class NormResidual(nn.Module):
    """h feeds a fused RMSNorm and the residual stream: autograd adds the two gradients."""

    def __init__(self, residual=True):
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.norm = nn.RMSNorm(8)
        self.out = nn.Linear(8, 8, bias=False)
        self.residual = residual
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = self.inp(x)
        y = self.out(self.norm(h))
        return ((h + y) if self.residual else y).square().sum()


def norm_joint(residual=True):
    torch.manual_seed(0)
    model, x = NormResidual(residual), x_bsh()
    joint, values, _ = joint_of(model, (x,), ["fuse"], Plan(fusion="rmsnorm"))
    return model, x, joint, values


def test_fuse_residual_grad_folds_the_add_and_equals_eager_autograd():
    model, x, joint, values = norm_joint()
    gm = joint.gm
    (norm,) = calls(gm, mx.rmsnorm_backward.default)
    grad_h = next(u for u in norm.users if u.target is operator.getitem and u.args[1] == 0)
    (add,) = grad_h.users
    assert add.target is aten.add.Tensor and add.args[1] is grad_h
    residual, readers = add.args[0], list(add.users)
    assert norm.args[4] is None
    result, _ = run("fuse_residual_grad", gm)
    assert result is gm
    assert add not in gm.graph.nodes and norm.args[4] is residual
    assert all(grad_h in r.args for r in readers)  # the add's readers read grad_h itself
    outputs = evaluate(gm, values)
    model.zero_grad()
    loss = model(x)  # eager autograd of the unfused norm (aten.rms_norm)
    loss.backward()
    params = dict(model.named_parameters())
    grads = [params[slot.key].grad for slot in joint.grad_of if slot is not None]
    assert_equal_outputs(outputs, [loss.detach()] + grads)  # [loss, grad per parameter]


def test_fuse_residual_grad_leaves_a_norm_without_residual_alone():
    _, _, joint, _ = norm_joint(residual=False)
    assert calls(joint.gm, mx.rmsnorm_backward.default)
    assert_left_alone("fuse_residual_grad", joint.gm)


def test_fuse_residual_grad_leaves_a_joint_without_fused_norm_alone():
    assert_left_alone("fuse_residual_grad", silu_joint()[0].gm)


# ---- remat ----------------------------------------------------------------------------------
def assert_recomputed(gm, original_names: set[str]):
    """Every named forward value's backward users read a clone of it (`recomputed_from`),
    placed in the backward before that clone's first use; the original has no backward user."""
    order = order_of(gm)
    clones = {n: n.meta["recomputed_from"] for n in gm.graph.nodes if "recomputed_from" in n.meta}
    assert original_names <= set(clones.values()), (sorted(clones.values()), original_names)
    last_forward = max(order[n] for n in gm.graph.nodes
                       if n.op == "call_function" and not is_backward(n))
    for clone in clones:
        assert is_backward(clone) and order[clone] > last_forward, clone.name
        assert all(order[clone] < order[u] for u in clone.users), clone.name
    for node in gm.graph.nodes:
        if node.name in original_names and "recomputed_from" not in node.meta:
            assert not [u for u in node.users if is_backward(u)], node.name


def test_remat_act_recomputes_silu_before_its_first_backward_use_bitwise():
    joint, values, _ = silu_joint()
    gm = joint.gm
    (silu,) = calls(gm, aten.silu.default)
    (view,) = list(silu.users)  # the forward view the weight gradient reads
    first_use = min((u for u in view.users if is_backward(u)), key=order_of(gm).__getitem__)
    expected = evaluate(gm, values)
    result, _ = run("remat", gm, Plan(recompute="act"))
    assert result is gm
    assert_recomputed(gm, {silu.name, view.name})
    clone = next(a for a in first_use.all_input_nodes if "recomputed_from" in a.meta)
    assert clone.meta["recomputed_from"] == view.name
    assert clone.args[0].target is aten.silu.default and clone.args[0] is not silu
    order = order_of(gm)
    assert order[clone.args[0]] < order[clone] < order[first_use]
    assert_equal_outputs(evaluate(gm, values), expected)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return x + self.w2(F.dropout(torch.tanh(self.w1(x)), 0.5, True))


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_remat_full_keeps_dropout_masks_and_is_bitwise():
    torch.manual_seed(0)
    joint, values, _ = joint_of(Layers(), (x_bsh(),))
    gm = joint.gm
    dropouts = calls(gm, aten.native_dropout.default)
    masks = [next(u for u in d.users if u.args[1] == 1) for d in dropouts]
    outputs = [next(u for u in d.users if u.args[1] == 0) for d in dropouts]
    expected = evaluate(gm, values, seed=3)
    run("remat", gm, Plan(recompute="full"))
    assert calls(gm, aten.native_dropout.default) == dropouts  # never redrawn
    replays = [n for n in calls(gm, aten.native_dropout_backward.default)
               if "recomputed_from" in n.meta]
    assert sorted(r.meta["recomputed_from"] for r in replays) == sorted(o.name for o in outputs)
    assert {r.args[1] for r in replays} == set(masks)  # rebuilt from the saved masks
    assert all(r.args[0].meta.get("recomputed_from") for r in replays)  # from recomputed tanh
    assert_recomputed(gm, {o.name for o in outputs})
    assert_equal_outputs(evaluate(gm, values, seed=3), expected)


@pytest.mark.parametrize("plan", [Plan(), Plan(recompute="attn"), Plan(memory_budget=1 << 30)],
                         ids=["off", "no-attention", "budget-fits"])
def test_remat_leaves_alone_when_nothing_is_recomputed(plan):
    assert_left_alone("remat", silu_joint()[0].gm, plan)


# ---- offload --------------------------------------------------------------------------------
def test_offload_moves_saved_values_to_the_host_and_back_bitwise():
    joint, values, _ = silu_joint()
    gm = joint.gm
    expected = evaluate(gm, values)
    backward = [n for n in gm.graph.nodes if n.op == "call_function" and is_backward(n)]
    result, _ = run("offload", gm, Plan(offload="all", offload_prefetch=2))
    assert result is gm
    offloads = calls(gm, mx.offload.default)
    assert {o.args[0].target for o in offloads} == {aten.mm.default, aten.silu.default}
    for host in offloads:
        value = host.args[0]
        assert value.next is host  # right after it is produced
        (prefetch,) = host.users
        assert prefetch.target is mx.prefetch.default and is_backward(prefetch)
        (ready,) = prefetch.users
        assert ready.target is wait_prefetch
        first, views = ready.next, []
        while first not in backward:  # past the forward views re-created on the prefetch
            views.append(first)
            first = first.next
        assert all(is_alias(v) and is_backward(v) for v in views)
        assert ready in ancestors([first])  # the first backward use reads the prefetched copy
        order = order_of(gm)
        between = [n for n in backward if order[prefetch] < order[n] < order[first]]
        assert len(between) == 2, (prefetch.name, first.name, [n.name for n in between])
        assert not [u for u in value.users if is_backward(u)]
    assert_equal_outputs(evaluate(gm, values), expected)
    pool = get_pool(gm.meta["offload_pool"])
    assert pool.bytes == sum(o.args[0].meta["val"].nbytes for o in offloads)


@pytest.mark.parametrize("plan", [Plan(), Plan(offload="layer3:all"), Plan(offload="attn")],
                         ids=["off", "other-layer", "no-attention"])
def test_offload_leaves_alone_when_nothing_is_offloaded(plan):
    assert_left_alone("offload", silu_joint()[0].gm, plan)


# ---- dead_code ------------------------------------------------------------------------------
def with_dead_code(x):
    aten.native_dropout(x, 0.5, True)  # unused, but it advances the generator
    aten.abs(aten.neg(x))  # an unused chain
    return (x + torch.rand_like(x),)


def test_dead_code_removes_unused_nodes_and_keeps_random_ops():
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    gm = make_fx(with_dead_code, tracing_mode="fake")(x)
    (dropout,) = calls(gm, aten.native_dropout.default)
    expected = evaluate(gm, [x], seed=5)
    result, _ = run("dead_code", gm)
    assert result is gm
    assert calls(gm, aten.native_dropout.default) == [dropout] and not dropout.users
    assert not calls(gm, aten.neg.default) and not calls(gm, aten.abs.default)
    assert not calls(gm, operator.getitem)  # the dropout's unused outputs
    assert_equal_outputs(evaluate(gm, [x], seed=5), expected)  # the same random stream


def test_dead_code_leaves_a_graph_without_dead_code_alone():
    joint, _, _ = silu_joint()
    assert all(n.users for n in joint.gm.graph.nodes if n.op == "call_function")
    assert_left_alone("dead_code", joint.gm)


# ---- safe_views_joint -----------------------------------------------------------------------
def test_safe_views_joint_makes_merging_views_reshapes_bitwise():
    """The linear layers' `view`s of [2, 4, 8] as [8, 8] fold two dims: they become
    `reshape`s in place (same nodes); views that only split or add size-1 dims stay.
    tests/test_view_strides.py runs a graph whose real strides make such a view fail."""
    joint, values, _ = silu_joint()
    gm = joint.gm
    views = calls(gm, aten.view.default)
    merging = [n for n in views if n.args[0].meta["val"].dim() > n.meta["val"].dim()]
    assert merging and len(merging) < len(views)
    expected = evaluate(gm, values)
    result, _ = run("safe_views_joint", gm)
    assert result is gm
    assert all(n.target is aten.reshape.default and n.meta.get("val") is not None for n in merging)
    assert all(n.target is aten.view.default for n in views if n not in merging)
    assert not any(n.meta.get("created_by") for n in gm.graph.nodes)
    assert_equal_outputs(evaluate(gm, values), expected)


def views_that_split(x):
    """Views of x [8, 8] valid for any strides: a dim split, a size-1 dim added, a scalar."""
    return x.view(2, 4, 8).sin(), x.view(8, 1, 8).cos(), x.sum().view(1, 1)


def test_safe_views_joint_leaves_views_that_only_split_alone():
    gm = make_fx(views_that_split, tracing_mode="fake")(torch.randn(8, 8))
    assert len(calls(gm, aten.view.default)) == 3
    assert_left_alone("safe_views_joint", gm)
