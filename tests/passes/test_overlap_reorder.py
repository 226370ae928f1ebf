"""The overlap passes on hand-built graphs: the reorder pass starts a collective before
independent compute and waits after it, keeps a backward collective in the backward, and
never holds more than `max_in_flight_mb` in flight; the async lowering's layout ops
against the synchronous collectives' layouts (plain torch)."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule

import mxgraph as mx
import mxgraph.runtime.collectives.async_layout  # noqa: F401 - registers the layout ops
from mxgraph.passes.overlap.reorder import MiB, collective_bytes, overlap_reorder_pass

aten, c10d, mxops = torch.ops.aten, torch.ops._c10d_functional, torch.ops.mxgraph


def _graph(collectives: int, mib: float, compute_between: int = 2, backward_from=None):
    """x_i -> all_reduce start_i; a chain of `compute_between` matmuls on y; then each
    wait_i is used by an add with the chain's end. Collective tensors of `mib` MiB (inputs
    and outputs count: 2 * mib per collective). Nodes from index `backward_from` of the
    compute chain on are tagged backward."""
    graph = Graph()
    elements = int(mib * MiB / 4)
    xs = [graph.placeholder(f"x{i}") for i in range(collectives)]
    y = graph.placeholder("y")
    for x in xs:
        x.meta["val"] = torch.empty(elements)
    y.meta["val"] = torch.empty(4, 4)
    starts, waits = [], []
    for x in xs:  # as overlap_async leaves them: each wait right after its start
        start = graph.call_function(c10d.all_reduce.default, (x, "sum", "g"))
        start.meta["val"] = torch.empty(elements)
        wait = graph.call_function(c10d.wait_tensor.default, (start,))
        wait.meta["val"] = start.meta["val"]
        starts.append(start)
        waits.append(wait)
    chain = y
    for i in range(compute_between):
        chain = graph.call_function(aten.mm.default, (chain, chain))
        chain.meta["val"] = torch.empty(4, 4)
        if backward_from is not None and i >= backward_from:
            chain.meta["partitioner_tag"] = "is_backward"
    outs = [graph.call_function(aten.add.Tensor, (w, chain))
            for w in waits]
    graph.output(tuple(outs))
    return GraphModule(torch.nn.Module(), graph)


def _ctx(**options):
    return SimpleNamespace(plan=mx.Plan(overlap=options or True))


def _order(gm):
    return [n for n in gm.graph.nodes]


def test_start_moves_before_independent_compute_and_wait_after_it():
    gm = overlap_reorder_pass(_graph(1, 1.0, compute_between=3), _ctx())
    nodes = _order(gm)
    start = next(n for n in nodes if n.target is c10d.all_reduce.default)
    wait = next(n for n in nodes if n.target is c10d.wait_tensor.default)
    mms = [i for i, n in enumerate(nodes) if n.target is aten.mm.default]
    assert nodes.index(start) < mms[0] and nodes.index(wait) > mms[-1], nodes
    assert nodes[nodes.index(wait) + 1].target is aten.add.Tensor  # waited at first use
    assert all(n.op == "placeholder" for n in nodes[:nodes.index(start)])


def test_a_forward_collective_is_waited_before_the_backward():
    gm = overlap_reorder_pass(_graph(1, 1.0, compute_between=4, backward_from=2), _ctx())
    nodes = _order(gm)
    wait = next(n for n in nodes if n.target is c10d.wait_tensor.default)
    first_backward = next(n for n in nodes if n.meta.get("partitioner_tag") == "is_backward")
    assert nodes.index(wait) < nodes.index(first_backward)
    assert nodes.index(wait) > max(i for i, n in enumerate(nodes[:nodes.index(first_backward)])
                                   if n.target is aten.mm.default)


def _in_flight_peak(gm) -> int:
    held = peak = 0
    for node in gm.graph.nodes:
        if node.target is c10d.all_reduce.default:
            held += collective_bytes(node)
            peak = max(peak, held)
        elif node.target is c10d.wait_tensor.default:
            held -= collective_bytes(node.args[0])
    return peak


@settings(max_examples=12, deadline=None)
@given(collectives=st.integers(1, 5), mib=st.sampled_from([0.25, 1.0]),
       budget_mib=st.sampled_from([0.5, 1.0, 2.5, 4.0, 64.0]))
def test_in_flight_bytes_stay_within_the_budget(collectives, mib, budget_mib):
    gm = overlap_reorder_pass(_graph(collectives, mib), _ctx(max_in_flight_mb=budget_mib))
    one = 2 * mib * MiB
    assert _in_flight_peak(gm) <= max(budget_mib * MiB, one)
    starts = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert [n.args[0].name for n in starts] == [f"x{i}" for i in range(collectives)]
    # as many as fit start before the compute: the budget is not left unused
    first_mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    early = sum(1 for n in gm.graph.nodes if n.target is c10d.all_reduce.default and
                _order(gm).index(n) < _order(gm).index(first_mm))
    assert early == min(collectives, max(1, int(budget_mib * MiB // one)))


def test_overlap_off_leaves_the_graph_alone():
    gm = _graph(2, 1.0)
    before = [n.name for n in gm.graph.nodes]
    after = overlap_reorder_pass(gm, SimpleNamespace(plan=mx.Plan()))
    assert [n.name for n in after.graph.nodes] == before


@pytest.mark.parametrize("dim, n", [(0, 2), (1, 2), (2, 4), (1, 3)])
def test_layout_ops_match_the_synchronous_layouts(dim, n):
    """What a gather along `dim` returns is rows_to_dim of the ranks' blocks stacked along
    dim 0; what a reduce-scatter along `dim` gives rank r is block r of dim_to_rows; the
    CP forms reorder head-tail chunks as cp_all_gather/cp_reduce_scatter do."""
    torch.manual_seed(0)
    blocks = [torch.randn(4, 6, 8) for _ in range(n)]
    assert torch.equal(mxops.rows_to_dim(torch.cat(blocks, 0), dim, n), torch.cat(blocks, dim))
    full = torch.randn(4 * n, 6 * n, 8 * n)
    rows = mxops.dim_to_rows(full, dim, n)
    for r in range(n):
        assert torch.equal(rows.chunk(n, 0)[r], full.chunk(n, dim)[r])
    # context parallelism: rank r holds chunks r and 2n-1-r of the sequence
    pieces = full.chunk(2 * n, dim)
    local = [torch.cat([pieces[r], pieces[2 * n - 1 - r]], dim) for r in range(n)]
    assert torch.equal(mxops.cp_rows_to_dim(torch.cat(local, 0), dim, n), full)
    assert torch.equal(mxops.cp_dim_to_rows(full, dim, n), torch.cat(local, 0))
