"""The runner's invariants (mxgraph/passes/invariants.py) on small hand-built fx graphs: each
rule raises PassError when a pass breaks it, and passes a pass that keeps it."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

import mxgraph.runtime.collectives.tp  # noqa: F401 - registers the mxgraph:: collectives
from mxgraph.context import CompileContext
from mxgraph.passes.invariants import PassError
from mxgraph.passes.runner import PassSpec, run_pass
from mxgraph.plan import Plan
from mxgraph.runtime.cluster.mesh import Mesh

aten = torch.ops.aten


def small_graph() -> GraphModule:
    """x -> relu -> sum, with meta["val"] on every node."""
    mode = FakeTensorMode()
    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"] = mode.from_tensor(torch.randn(4, 4))
    relu = graph.call_function(aten.relu.default, (x,))
    relu.meta["val"] = torch.ops.aten.relu.default(x.meta["val"])
    total = graph.call_function(aten.sum.default, (relu,))
    total.meta["val"] = torch.ops.aten.sum.default(relu.meta["val"])
    graph.output((total,))
    return GraphModule(torch.nn.Module(), graph)


def run(fn, mesh=None, adds_random=False):
    ctx = CompileContext(plan=Plan(), mesh=mesh)
    return run_pass(PassSpec("probe", fn, "forward", "test", adds_random), small_graph(), ctx)


def insert_after_relu(gm, target, args_of, val=True):
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    with gm.graph.inserting_after(relu):
        node = gm.graph.call_function(target, args_of(relu))
    if val:
        node.meta["val"] = relu.meta["val"]
    relu.replace_all_uses_with(node, delete_user_cb=lambda user: user is not node)
    return gm


def test_a_pass_that_keeps_the_rules_passes():
    gm = run(lambda gm, ctx: insert_after_relu(gm, aten.neg.default, lambda r: (r,)))
    assert any(n.meta.get("created_by") == "probe" for n in gm.graph.nodes)


def test_new_node_without_meta_val():
    with pytest.raises(PassError, match="without meta\\['val'\\]"):
        run(lambda gm, ctx: insert_after_relu(gm, aten.neg.default, lambda r: (r,), val=False))


def test_undeclared_random_op():
    def add_dropout(gm, ctx):
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        with gm.graph.inserting_after(relu):
            drop = gm.graph.call_function(aten.native_dropout.default, (relu, 0.5, True))
            drop.meta["val"] = aten.native_dropout.default(relu.meta["val"], 0.5, True)
        return gm
    with pytest.raises(PassError, match="random op"):
        run(add_dropout)
    run(add_dropout, adds_random=True)  # declared: allowed


def test_mutating_op():
    with pytest.raises(PassError, match="mutating op"):
        run(lambda gm, ctx: insert_after_relu(gm, aten.relu_.default, lambda r: (r,)))


def test_collective_on_a_group_of_no_axis():
    all_reduce = torch.ops.mxgraph.tp_all_reduce.default
    mesh = Mesh.on_paper(tp=2)
    with pytest.raises(PassError, match="no axis of this mesh"):
        run(lambda gm, ctx: insert_after_relu(gm, all_reduce, lambda r: (r, "made-up")), mesh)
    with pytest.raises(PassError, match="one-device compile"):
        run(lambda gm, ctx: insert_after_relu(gm, all_reduce, lambda r: (r, "made-up")))
    group = mesh.group_name("tp")
    run(lambda gm, ctx: insert_after_relu(gm, all_reduce, lambda r: (r, group)), mesh)


def test_collective_unknown_to_the_comm_report(monkeypatch):
    from mxgraph.runtime.collectives import groups
    monkeypatch.delitem(groups.KIND, "tp_all_reduce")
    mesh = Mesh.on_paper(tp=2)
    group = mesh.group_name("tp")
    with pytest.raises(PassError, match="unknown to the communication report"):
        run(lambda gm, ctx: insert_after_relu(gm, torch.ops.mxgraph.tp_all_reduce.default,
                                              lambda r: (r, group)), mesh)


def test_output_made_an_alias_of_an_input():
    def return_a_view(gm, ctx):
        x = next(iter(gm.graph.find_nodes(op="placeholder")))
        output = gm.graph.find_nodes(op="output")[0]
        with gm.graph.inserting_before(output):
            view = gm.graph.call_function(aten.view.default, (x, [16]))
            view.meta["val"] = x.meta["val"].view(16)
        output.args = ((output.args[0][0], view),)
        return gm
    with pytest.raises(PassError, match="alias of an input"):
        run(return_a_view)


def test_malformed_graph():
    def dangling(gm, ctx):
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        total = next(n for n in gm.graph.nodes if n.target is aten.sum.default)
        total.append(relu)  # relu now comes after its user
        return gm
    with pytest.raises(PassError, match="malformed"):
        run(dangling)


def test_functional_collective_without_wait():
    def unwaited(gm, ctx):
        return insert_after_relu(gm, torch.ops._c10d_functional.all_reduce.default,
                                 lambda r: (r, "sum", "0"))
    with pytest.raises(PassError, match="has no wait_tensor"):
        run(unwaited, Mesh.on_paper())
