"""Cost rules (FLOPs, bytes), their two named counts (executed and model FLOPs) and the
liveness peak-memory estimate against hand counts."""
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from mxgraph.cost import FLOP_RULES, OpCall, graph_cost, model_flops, node_cost
from mxgraph.memory import estimate_peak

aten = torch.ops.aten


def traced(fn, *args):
    return make_fx(fn)(*args)


def costs_by_op(gm):
    return {str(n.target): node_cost(n) for n in gm.graph.nodes if n.op == "call_function"}


def test_matmul_flops_and_bytes():
    gm = traced(lambda a, b: a @ b, torch.randn(3, 5), torch.randn(5, 7))
    cost = costs_by_op(gm)["aten.mm.default"]
    assert cost.flops == 2 * 3 * 5 * 7
    assert cost.bytes == 4 * (3 * 5 + 5 * 7 + 3 * 7)


def test_linear_and_addmm_flops():
    w, b = torch.randn(6, 4), torch.randn(6)
    gm = traced(lambda x: F.linear(x, w, b), torch.randn(2, 3, 4))
    flops = sum(c.flops for k, c in costs_by_op(gm).items() if "mm" in k)
    assert flops == 2 * 2 * 3 * 4 * 6


def test_attention_flops_causal_halves():
    q = torch.randn(2, 4, 16, 8)
    full = traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, q, q)
    causal = traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    q, q, q)
    f_full, _, unknown = graph_cost(full)
    f_causal, _, _ = graph_cost(causal)
    assert not unknown
    assert f_full >= 2 * 2 * 4 * 16 * 16 * (8 + 8)
    attention = lambda gm: sum(c.flops for k, c in costs_by_op(gm).items() if "attention" in k)
    assert attention(causal) * 2 == attention(full) == 2 * 2 * 4 * 16 * 16 * 16


def test_executed_and_model_flops_come_from_one_rule():
    """One rule per op, two counts: a causal SDPA executes half its model FLOPs (counted
    whole), a matmul counts the same in both, a norm in executed FLOPs only."""
    q, w = torch.randn(2, 4, 16, 8), torch.randn(8, 8)
    gm = traced(lambda q, w: F.layer_norm(F.scaled_dot_product_attention(q, q, q, is_causal=True)
                                          @ w, (8,)), q, w)
    nodes = {FLOP_RULES[n.target.overloadpacket].counts: n for n in gm.graph.nodes
             if n.op == "call_function" and getattr(n.target, "overloadpacket", None) in FLOP_RULES}
    counted = {kind: (node_cost(n).flops, model_flops(OpCall.of_node(n))) for kind, n in nodes.items()}
    attention = 2 * 2 * 4 * 16 * 16 * (8 + 8)
    assert counted["attention"] == (attention // 2, attention)
    assert counted["matmul"] == (2 * 2 * 4 * 16 * 8 * 8,) * 2
    assert counted["norm"] == (5 * 2 * 4 * 16 * 8, 0)


def test_grouped_mm_counts_the_rows_up_to_offs_where_known():
    """2-D rows x 3-D groups: a running op (real offsets) counts the rows that meet a group,
    a traced graph (fake offsets) every row; the 2-D x 2-D form (K split into groups) counts
    each K slice once."""
    a, b = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    offs = torch.tensor([16, 24], dtype=torch.int32)
    run = OpCall(aten._grouped_mm.default, (a, b, offs), {}, [aten._grouped_mm(a, b, offs)])
    assert model_flops(run) == 2 * 24 * 16 * 8
    gm = traced(lambda a, b, offs: aten._grouped_mm(a, b, offs), a, b, offs)
    assert costs_by_op(gm)["aten._grouped_mm.default"].flops == 2 * 32 * 16 * 8
    a, b = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(32, 8, dtype=torch.bfloat16)
    gm = traced(lambda a, b, offs: aten._grouped_mm(a, b, offs), a, b, offs)
    assert costs_by_op(gm)["aten._grouped_mm.default"].flops == 2 * 8 * 32 * 8


def test_views_are_free_and_pointwise_counts_elements():
    gm = traced(lambda x: (x.view(4, 3).t() + 1).relu(), torch.randn(12))
    costs = costs_by_op(gm)
    assert costs["aten.view.default"].flops == costs["aten.view.default"].bytes == 0
    assert costs["aten.add.Tensor"].flops == 12
    assert costs["aten.relu.default"].bytes == 2 * 12 * 4


def test_unknown_op_is_reported_not_zeroed_silently():
    gm = traced(lambda x: torch.linalg.qr(x)[0], torch.randn(4, 4))
    _, _, unknown = graph_cost(gm)
    assert any("linalg_qr" in name for name in unknown)


def test_peak_memory_of_a_chain():
    # x (resident 400 B) -> a = x+1 (400) -> b = a*2 (400, a freed after) -> c = b.sum()
    gm = traced(lambda x: ((x + 1) * 2).sum(), torch.randn(100))
    peak, resident = estimate_peak(gm)
    assert resident == 400
    assert peak == 400 + 400 + 400  # a and b live together while b is computed


def test_peak_memory_leaves_out_what_a_kernel_keeps_on_chip():
    # the same chain with a = x+1 kept on chip (share 0): b (400 B) and its sum (4 B)
    gm = traced(lambda x: ((x + 1) * 2).sum(), torch.randn(100))
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    peak, resident = estimate_peak(gm, lambda node: 0.0 if node is first else 1.0)
    assert (peak, resident) == (400 + 400 + 4, 400)


def test_peak_memory_views_keep_base_alive():
    # a view of `a` used late keeps a's 400 B alive while `b` exists
    def fn(x):
        a = x + 1
        v = a.view(10, 10)
        b = x * 3
        return (v.sum(0) + b.view(10, 10).sum(0))
    peak, resident = estimate_peak(traced(fn, torch.randn(100)))
    assert peak >= resident + 800
