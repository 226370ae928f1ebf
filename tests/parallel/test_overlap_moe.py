"""Expert all-to-all overlap (`Plan.moe.a2a_overlap`): the window pass on hand-built
graphs (an independent matmul after the wait is hoisted into the window, a dW-like node
before the start is sunk into it, nothing crosses another collective, leaves its part or
is a random op that moved); the reorder budget on data-dependent rows; on 2 gloo ranks the
lowered ops against `ep_dispatch`/`ep_combine` (uneven, empty and padded splits) and
`ep_all_to_all` (through the pass), and `moe-tiny` with a2a_overlap against without: loss,
gradients and parameters after 2 AdamW steps bitwise equal, the expert all-to-alls
asynchronous and their windows filled."""
import copy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import models
import mxgraph as mx
import mxgraph.runtime.collectives.ep  # noqa: F401 - registers ops
import mxgraph.runtime.collectives.ep_async  # noqa: F401 - registers ops
from mxgraph.context import CompileContext
from mxgraph.passes.overlap.async_collectives import overlap_async_pass
from mxgraph.passes.overlap.moe import overlap_moe_pass
from mxgraph.passes.overlap.reorder import collective_bytes
from tests.distributed import run_ranks
from tests.helpers import batch
from tests.overlap_checks import run_plan

aten, c10d, mxops = torch.ops.aten, torch.ops._c10d_functional, torch.ops.mxgraph
A2A_PLAN = {"ep": 2, "overlap": True, "moe": mx.MoEOptions(a2a_overlap=True)}


def _window_graph() -> GraphModule:
    """Forward: an all-reduce, then an expert all-to-all on a = x @ w, then another
    all-reduce; a backward-tagged node at the end. Nodes named for what should happen."""
    graph = Graph()
    x, w, g = (graph.placeholder(name) for name in ("x", "w", "g"))

    def call(name, op, *args, backward=False):
        node = graph.call_function(op, args)
        node.name = name
        if backward:
            node.meta["partitioner_tag"] = "is_backward"
        return node

    stays_before_ar = call("stays_before_ar", aten.mm.default, g, g)  # behind a collective
    ar = call("ar", c10d.all_reduce.default, x, "sum", "g")
    ar_wait = call("ar_wait", c10d.wait_tensor.default, ar)
    dw = call("dw", aten.mm.default, g, w)  # a weight-gradient-like GEMM: sunk
    dw_use = call("dw_use", aten.relu.default, dw)  # its user, before the start: sunk too
    a = call("a", aten.mm.default, x, w)  # the start's input: stays
    start = call("start", c10d.all_to_all_single.default, a, [2, 2], [2, 2], "g")
    wait = call("wait", c10d.wait_tensor.default, start)
    routed = call("routed", aten.mm.default, wait, w)  # reads the wait: stays
    shared = call("shared", aten.mm.default, x, w)  # the shared expert: hoisted
    shared_act = call("shared_act", aten.silu.default, shared)  # hoisted with it
    noise = call("noise", aten.rand_like.default, x)  # random: stays
    noisy = call("noisy", aten.add.Tensor, shared, noise)  # reads a random op left: stays
    mixed = call("mixed", aten.add.Tensor, routed, shared_act)
    ar2 = call("ar2", c10d.all_reduce.default, mixed, "sum", "g")
    late = call("stays_after_ar2", aten.mm.default, g, g)  # behind a collective
    ar2_wait = call("ar2_wait", c10d.wait_tensor.default, ar2)
    bwd = call("bwd", aten.mm.default, g, w, backward=True)  # other part
    graph.output((stays_before_ar, ar_wait, dw_use, noisy, late, ar2_wait, bwd))
    return GraphModule(torch.nn.Module(), graph)


def _ctx():
    return CompileContext(plan=mx.Plan(**A2A_PLAN))


def test_window_pass_sinks_and_hoists_independent_compute():
    gm = overlap_moe_pass(_window_graph(), _ctx())
    order = [n.name for n in gm.graph.nodes]
    assert order == ["x", "w", "g", "stays_before_ar", "ar", "ar_wait", "a", "start",
                     "dw", "dw_use", "shared", "shared_act", "wait", "routed", "noise",
                     "noisy", "mixed", "ar2", "stays_after_ar2", "ar2_wait", "bwd",
                     "output"], order


def test_window_pass_keeps_nodes_in_their_part():
    """No barrier between the forward all-to-all's wait and the backward's start: the
    backward node that reads neither is sunk into the backward window, not hoisted into
    the forward one, and the forward node that reads the wait does not sink into it."""
    graph = Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    names = {}

    def call(name, op, *args, backward=False):
        node = names[name] = graph.call_function(op, args)
        node.name = name
        if backward:
            node.meta["partitioner_tag"] = "is_backward"
        return node

    fs = call("fs", c10d.all_to_all_single.default, call("fa", aten.mm.default, x, w), [1],
              [1], "g")
    fw = call("fw", c10d.wait_tensor.default, fs)
    call("f_dep", aten.relu.default, fw)
    call("b_ind", aten.mm.default, x, x, backward=True)
    bs = call("bs", c10d.all_to_all_single.default,
              call("ba", aten.mm.default, x, w, backward=True), [1], [1], "g", backward=True)
    call("bw", c10d.wait_tensor.default, bs, backward=True)
    graph.output((names["f_dep"], names["b_ind"], names["bw"]))
    gm = overlap_moe_pass(GraphModule(torch.nn.Module(), graph), _ctx())
    order = [n.name for n in gm.graph.nodes]
    assert order == ["x", "w", "fa", "fs", "fw", "f_dep", "ba", "bs", "b_ind", "bw",
                     "output"], order


def test_window_pass_is_off_without_a2a_overlap():
    gm = _window_graph()
    before = [n.name for n in gm.graph.nodes]
    ctx = CompileContext(plan=mx.Plan(ep=2, overlap=True))
    assert [n.name for n in overlap_moe_pass(gm, ctx).graph.nodes] == before


def test_in_flight_bytes_of_data_dependent_rows_count_at_their_bound():
    """The reorder pass's budget reads a dropless all-to-all's rows (an unbacked size) at
    the upper bound of its torch._check calls instead of guarding on it."""
    shape_env = ShapeEnv()
    rows = shape_env.create_unbacked_symint()
    torch._check(rows >= 0)
    torch._check(rows <= 256)
    with FakeTensorMode(shape_env=shape_env):
        fake = torch.empty(rows, 4)
    graph = Graph()
    x = graph.placeholder("x")
    start = graph.call_function(mxops.ep_rows_start.default, (x, x, x, 256, "g"))
    x.meta["val"] = start.meta["val"] = fake
    assert collective_bytes(start) == 2 * 256 * 4 * 4


def _lowered(x, send, recv, out_rows, group, dispatch: bool):
    """What overlap_async writes for ep_dispatch / ep_combine, run eagerly."""
    ep, local = recv.shape
    send_splits, recv_splits = send.view(ep, local).sum(1), recv.sum(1)
    if dispatch:
        started = mxops.ep_rows_start(x, send_splits, recv_splits, out_rows, group)
        return mxops.ep_rows_by_expert(c10d.wait_tensor(started), recv)
    by_source = mxops.ep_rows_by_source(x, recv)
    return c10d.wait_tensor(mxops.ep_rows_start(by_source, recv_splits, send_splits, out_rows,
                                                group))


def _check_equal_split_lowering(rank, group):
    """overlap_async's ep_all_to_all lowering (a functional all_to_all_single), run."""
    graph = Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 3)
    node = graph.call_function(mxops.ep_all_to_all.default, (x, group))
    node.meta["val"] = x.meta["val"]
    graph.output(node)
    gm = overlap_async_pass(GraphModule(torch.nn.Module(), graph), _ctx())
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        c10d.all_to_all_single.default, c10d.wait_tensor.default]
    rows = torch.arange(12.0).view(4, 3) + 100 * rank
    assert torch.equal(gm(rows), mxops.ep_all_to_all(rows, group))


def _check_ops(rank):
    """Uneven counts, an expert with no rows, and outputs padded past the counted rows."""
    group = torch.distributed.group.WORLD.group_name
    _check_equal_split_lowering(rank, group)
    counts = [torch.tensor([3, 0, 2, 1]), torch.tensor([1, 2, 0, 4])][rank]  # 4 experts
    recv = mxops.ep_counts(counts, group)
    total = int(recv.sum())
    x = torch.randn(int(counts.sum()) + 1, 3, generator=torch.Generator().manual_seed(rank))
    for out_rows in (total, total + 2):
        sync = mxops.ep_dispatch(x, counts, recv, out_rows, group)
        assert torch.equal(_lowered(x, counts, recv, out_rows, group, True), sync)
        back = mxops.ep_combine(sync, counts, recv, x.shape[0], group)
        assert torch.equal(_lowered(sync, counts, recv, x.shape[0], group, False), back)
        assert torch.equal(back[:-1], x[:-1]) and not back[-1].any()
    assert torch._C._distributed_c10d._get_work_registry_size() == 0


def _graph_checks(step):
    """Each expert all-to-all is an ep_rows_start with its wait; the forward combine's window
    holds the shared expert's matmuls, the backward's the experts' weight gradients."""
    joints = [rt.joint.gm for executor in step.executors() for rt in executor.stages.values()]
    graph_ops = [n.target for gm in joints for n in gm.graph.nodes]
    assert graph_ops.count(mxops.ep_rows_start.default) == 4, "not 4 expert all-to-alls"
    assert mxops.ep_dispatch.default not in graph_ops and mxops.ep_combine.default not in graph_ops
    windows = []
    for gm in joints:
        nodes = list(gm.graph.nodes)
        for start in (n for n in nodes if n.target is mxops.ep_rows_start.default):
            wait = next(iter(start.users))
            windows.append({n.target for n in nodes[nodes.index(start) + 1:nodes.index(wait)]})
    assert any(aten.mm.default in w for w in windows), "no shared-expert GEMM in a window"
    assert any(mxops.grouped_mm_wgrad.default in w for w in windows), "no dW in a window"


def _check_model(rank):
    torch.manual_seed(0)
    base = models.build_model("moe-tiny", expert_impl="grouped_mm", n_layers=2, aux_loss_coef=0)
    tokens, targets = batch(vocab=base.config.vocab_size, batch_size=4, seq_len=16, seed=rank)
    results = []
    for plan in (mx.Plan(ep=2, overlap=True), mx.Plan(**A2A_PLAN)):
        results.append(run_plan(copy.deepcopy(base), plan, tokens, targets))
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = results
    assert all(torch.equal(a, b) for a, b in zip(loss_a, loss_b, strict=True)), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and params_a.keys() == params_b.keys()
    for key in grads_a:
        assert torch.equal(grads_a[key], grads_b[key]), f"grad {key}"
    for key in params_a:
        assert torch.equal(params_a[key], params_b[key]), f"param {key}"
    _graph_checks(mx.compile(copy.deepcopy(base), mx.Plan(**A2A_PLAN), example=(tokens, targets)))


def _check_all(rank, world):
    _check_ops(rank)
    _check_model(rank)


def test_a2a_overlap_is_bitwise_and_asynchronous_on_two_ranks():
    run_ranks(2, _check_all)
