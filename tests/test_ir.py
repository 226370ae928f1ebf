"""mxgraph.ir on small hand-built fx graphs: predicates, walks, schema arguments, insertion."""
import ast
import operator
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Graph

import mxgraph.codegen.kernels  # noqa: F401 - registers the fused ops and their kinds
from mxgraph import ir
from mxgraph.codegen.kernels import KERNELS

aten = torch.ops.aten
mx = torch.ops.mxgraph
ROOT = Path(__file__).resolve().parents[1]


def _graph(*names):
    graph = Graph()
    return graph, [graph.placeholder(name) for name in names]


def test_is_random_dropout_vs_attention_without_dropout_vs_randn():
    graph, (x, q, k, v) = _graph("x", "q", "k", "v")
    dropout = graph.call_function(aten.native_dropout.default, (x, 0.1, True))
    dropout_p0 = graph.call_function(aten.native_dropout.default, (x, 0.0, True))
    sdpa_p0 = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v))
    sdpa_p0_kw = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                     {"dropout_p": 0.0, "is_causal": True})
    sdpa_drop = graph.call_function(aten.scaled_dot_product_attention.default,
                                    (q, k, v, None, 0.1))
    flash_p0 = graph.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default,
                                   (q, k, v, 0.0, True))
    flash_drop = graph.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default,
                                     (q, k, v, 0.2))
    randn = graph.call_function(aten.randn.default, ([2, 3],))
    add = graph.call_function(aten.add.Tensor, (x, x))
    assert ir.is_random(dropout) and ir.is_random(randn)
    assert ir.is_random(dropout_p0)  # still draws its mask (bernoulli with p=1)
    assert ir.is_random(sdpa_drop) and ir.is_random(flash_drop)
    for node in (sdpa_p0, sdpa_p0_kw, flash_p0):
        assert not ir.is_random(node) and ir.has_random_tag(node), node
    assert not ir.is_random(add) and not ir.has_random_tag(add)
    assert not ir.is_random(x)


def test_is_alias_and_storage_roots_follow_a_view_chain():
    graph, (x,) = _graph("x")
    view = graph.call_function(aten.view.default, (x, [6]))
    t = graph.call_function(aten.t.default, (graph.call_function(aten.view.default, (view, [2, 3])),))
    detached = graph.call_function(aten.detach.default, (t,))
    unsafe = graph.call_function(aten._unsafe_view.default, (detached, [6]))
    relu = graph.call_function(aten.relu.default, (unsafe,))
    split = graph.call_function(aten.split.Tensor, (relu, 3))
    piece = graph.call_function(operator.getitem, (split, 0))
    topk = graph.call_function(aten.topk.default, (relu, 2))
    values = graph.call_function(operator.getitem, (topk, 0))
    graph.output((piece, values))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    for node in (view, t, detached, unsafe, split, piece):
        assert ir.is_alias(node), node
    for node in (x, relu, topk, values):
        assert not ir.is_alias(node), node
    roots = ir.storage_roots(gm)
    assert {roots[n] for n in (view, t, detached, unsafe)} == {x}
    assert roots[relu] is relu and roots[piece] is relu
    assert roots[values] is values  # a topk output owns its storage


def test_schema_arg_positional_keyword_default_and_unknown():
    graph, (q, k, v) = _graph("q", "k", "v")
    positional = graph.call_function(aten.scaled_dot_product_attention.default,
                                     (q, k, v, None, 0.5, True))
    keyword = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                  {"is_causal": True, "scale": 0.25})
    assert ir.schema_arg(positional, "dropout_p") == 0.5
    assert ir.schema_arg(positional, "is_causal") is True
    assert ir.schema_arg(keyword, "is_causal") is True and ir.schema_arg(keyword, "scale") == 0.25
    assert ir.schema_arg(keyword, "dropout_p") == 0.0  # the schema's default
    assert ir.schema_arg(keyword, "attn_mask") is None
    assert ir.schema_arg(keyword, "dropout_p", 0.7) == 0.7  # left out: the caller's default
    assert ir.schema_arg(keyword, "no_such_arg", 3) == 3
    with pytest.raises(KeyError):
        ir.schema_arg(keyword, "no_such_arg")


def _fake_graph():
    mode = FakeTensorMode()
    graph, (x, w) = _graph("x", "w")
    with mode:
        x.meta["val"] = torch.empty(4, 8)
        w.meta["val"] = torch.empty(16, 8)
    mm = graph.call_function(aten.linear.default, (x, w))
    mm.meta["custom"] = {"module": "layers.0.mlp", "layer": 0}
    mm.meta["val"] = torch.nn.functional.linear(x.meta["val"], w.meta["val"])
    graph.output(mm)
    return graph, x, w, mm


def test_insert_call_sets_fake_value_and_copies_custom():
    graph, x, w, mm = _fake_graph()
    relu = ir.insert_call(graph, aten.relu.default, (mm,), after=mm, like=mm)
    assert list(graph.nodes).index(relu) == list(graph.nodes).index(mm) + 1
    assert isinstance(relu.meta["val"], FakeTensor) and relu.meta["val"].shape == (4, 16)
    assert relu.meta["custom"] == mm.meta["custom"]
    assert relu.meta["custom"] is not mm.meta["custom"]  # a copy: the pass may extend it
    cast = ir.insert_call(graph, aten._to_copy.default, (x,), {"dtype": torch.bfloat16},
                          before=mm, like=mm)
    assert list(graph.nodes).index(cast) == list(graph.nodes).index(mm) - 1
    assert cast.meta["val"].dtype == torch.bfloat16
    pair = ir.insert_call(graph, aten.topk.default, (relu, 2), after=relu)
    first = ir.insert_call(graph, operator.getitem, (pair, 1), after=pair)
    assert "custom" not in pair.meta and first.meta["val"].dtype == torch.int64
    bare = ir.insert_call(graph, aten.neg.default, (mm,), after=mm, like=x, val=None)
    assert "val" not in bare.meta and bare.meta["custom"] == {}
    given = ir.insert_call(graph, aten.neg.default, (mm,), after=mm, val=x.meta["val"])
    assert given.meta["val"] is x.meta["val"]
    graph.lint()


def test_fused_kind_of_fused_ops():
    graph, (a, b, w, offs) = _graph("a", "b", "w", "offs")
    swiglu = graph.call_function(mx.swiglu.default, (a, b))
    norm = graph.call_function(mx.rmsnorm.default, (a, w, 1e-6))
    norm_bwd = graph.call_function(mx.rmsnorm_backward.default, (a, a, w, b))
    gmm = graph.call_function(mx.grouped_mm.default, (a, w, offs))
    wgrad = graph.call_function(mx.grouped_mm_wgrad.default, (a, b, offs))
    mm = graph.call_function(aten.mm.default, (a, b))
    assert ir.fused_kind(swiglu) == "act" and ir.fused_kind(norm) == "norm"
    assert ir.fused_kind(gmm) == "matmul" and ir.fused_kind(mm) is None
    assert ir.fused_kind(norm_bwd) is None and ir.fused_kind(norm_bwd, backward=True) == "norm"
    assert ir.fused_kind(wgrad) is None and ir.fused_kind(wgrad, backward=True) == "matmul"
    assert ir.fused_kind(a) is None
    for name, kernel in KERNELS.items():
        assert kernel.kind in ir.FUSED_KINDS, name
        node = graph.call_function(kernel.op, ())
        assert ir.fused_kind(node, backward=True) == kernel.kind, name
    with pytest.raises(ValueError):
        ir.register_fused_kind(mx.swiglu.default, "elementwise")


def test_ancestors_descendants_and_closure():
    graph, (x, y) = _graph("x", "y")
    a = graph.call_function(aten.relu.default, (x,))
    b = graph.call_function(aten.add.Tensor, (a, y))
    c = graph.call_function(aten.neg.default, (b,))
    d = graph.call_function(aten.neg.default, (a,))
    assert ir.ancestors([c]) == {c, b, a, x, y}
    assert ir.ancestors([c, None], stop={a}) == {c, b, y}
    assert ir.ancestors([c], keep=lambda n: n.op != "placeholder") == {c, b, a}
    assert ir.descendants([a]) == {a, b, c, d}
    assert ir.descendants([a], keep=lambda n: n is not b) == {a, d}
    assert ir.closure([x], lambda n: n.users, stop=lambda n: n is b) == {x, a, b, d}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_ir_is_the_lowest_layer_and_mxgraph_does_not_import_models():
    assert _imports(ROOT / "mxgraph" / "ir.py") <= {"__future__", "contextlib", "operator",
                                                     "typing", "torch"}
    application = ("hf/", "data/", "train/", "cli/")  # above the compiler: they may
    importers = {p.relative_to(ROOT / "mxgraph").as_posix()
                 for p in (ROOT / "mxgraph").rglob("*.py") if "models" in _imports(p)}
    compiler = {path for path in importers if not path.startswith(application)}
    assert compiler <= {"memory_plan.py"}, compiler - {"memory_plan.py"}
