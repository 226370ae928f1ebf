"""The routed-MoE block finder (mxgraph/passes/sharding/moe_blocks.py) on small traced graphs: each
form it recognises, in mxgraph's models, Hugging Face's experts implementations and
hand-built modules, with the right expert weights, counts, rows and exit. The counts and
ids are checked by value too: the graph run on real tensors, the per-expert counts equal
the bincount of the routing top-k's indices."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from mxgraph.capture import capture, model_tensors, slot_tensor
from mxgraph.passes.sharding.moe_blocks import find_expert_blocks


class HandMoE(nn.Module):
    """A tiny LM around one hand-written MoE block: embedding, the block (a residual), LM
    head; `forward(tokens, targets) -> loss`. `form`: "nonzero" (a loop over range(E),
    tokens selected by torch.where on a one-hot mask, combined by index_add_, weights
    stacked [E, ...]), "modules" (the same loop, one nn.Module per expert), "capacity"
    (every expert on a padded [E, C, D] buffer by bmm)."""

    def __init__(self, form: str = "nonzero", experts: int = 4, dim: int = 16,
                 ffn: int = 32, topk: int = 2, vocab: int = 256):
        super().__init__()
        self.form, self.num_experts, self.topk = form, experts, topk
        self.embed = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        if form == "modules":
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(dim, ffn, bias=False), nn.SiLU(),
                              nn.Linear(ffn, dim, bias=False)) for _ in range(experts))
        else:
            self.w_in = nn.Parameter(torch.randn(experts, ffn, dim) * 0.2)
            self.w_out = nn.Parameter(torch.randn(experts, dim, ffn) * 0.2)
        self.head = nn.Linear(dim, vocab, bias=False)

    def moe(self, x_TD: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x_TD).softmax(-1).topk(self.topk, dim=-1)
        if self.form == "capacity":
            T, E = x_TD.shape[0], self.num_experts
            buf_ECD = torch.zeros(E, T, x_TD.shape[1]).index_add(
                1, torch.arange(T), x_TD.expand(E, -1, -1))
            h = torch.bmm(F.silu(torch.bmm(buf_ECD, self.w_in.transpose(1, 2))),
                          self.w_out.transpose(1, 2))
            gate_TE = torch.zeros(T, E).scatter(1, ids, weights)
            return torch.einsum("etd,te->td", h, gate_TE)
        out = torch.zeros_like(x_TD)
        mask_EKT = F.one_hot(ids, self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            choice, token = torch.where(mask_EKT[e])
            h = x_TD[token]
            if self.form == "modules":
                h = self.experts[e](h)
            else:
                h = F.linear(F.silu(F.linear(h, self.w_in[e])), self.w_out[e])
            out.index_add_(0, token, h * weights[token, choice, None])
        return out

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)
        x = x + self.moe(x)
        return F.cross_entropy(self.head(x), targets.flatten())


def _tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _find(model):
    tokens = _tokens()
    forward = capture(model, (tokens, tokens), {})
    return forward, find_expert_blocks(forward.gm)


def _keys(block):
    return [w.param.meta["mx_slot_key"] for w in block.weights]


def _run(forward, model, nodes):
    """The values of `nodes` when the captured graph runs on the model's tensors."""
    tokens, tensors, seen = _tokens(), model_tensors(model), {}
    inputs = [(tokens, tokens)[s.key] if s.kind == "input" else
              slot_tensor(s, tensors, forward.constants) for s in forward.slots]

    class Record(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node in nodes:
                seen[node] = value
            return value
    with torch.no_grad():
        Record(forward.gm).run(*inputs)
    return seen


def _check_counts(forward, model, block):
    """The block's counts (or per-row ids) are those of its routing top-k's indices."""
    indices = next(u for u in block.topk.users if u.args[1] == 1)
    source = block.counts if block.counts is not None else block.expert_ids
    values = _run(forward, model, {indices, source})
    chosen = values[indices].flatten()
    if block.counts is not None:
        expected = torch.bincount(chosen, minlength=block.num_experts)
        torch.testing.assert_close(values[source].to(expected.dtype), expected)
    else:
        torch.testing.assert_close(values[source], chosen)


def test_mxgraph_grouped_mm():
    torch.manual_seed(0)
    model = models.build_model("moe-tiny", n_layers=2, expert_impl="grouped_mm")
    forward, blocks = _find(model)
    [block] = blocks  # layer 0 is dense
    assert block.form == "grouped" and block.num_experts == 8 and block.problem is None
    assert _keys(block) == [f"layers.1.mlp.experts.w_{p}" for p in ("gate", "up", "down")]
    assert [str(g.target) for g in block.gemms] == ["mxgraph.grouped_mm.default"] * 3
    assert block.exit is block.gemms[-1] and block.rows.meta["val"].shape[0] == 16 * 2 * 2
    assert block.combine.target is torch.ops.aten.index_add.default
    _check_counts(forward, model, block)


def test_mxgraph_loop():
    torch.manual_seed(0)
    model = models.build_model("moe-tiny", n_layers=2, expert_impl="loop", n_routed_experts=4)
    forward, [block] = _find(model)
    assert block.form == "loop" and block.num_experts == 4 and block.problem is None
    assert block.stacked and block.exit.target is torch.ops.aten.cat.default
    assert sorted(_keys(block)) == [f"layers.1.mlp.experts.w_{p}" for p in ("down", "gate", "up")]
    assert [[s.args[2] for s in selects] for selects in block.selects] == [[e] * 3 for e in range(4)]
    assert block.exit.args[0] == block.outputs
    _check_counts(forward, model, block)


def test_mxgraph_capacity():
    torch.manual_seed(0)
    _, [block] = _find(models.build_model("moe-tiny", n_layers=2, capacity_factor=1.5))
    assert block.form == "capacity" and len(block.gemms) == 3 and block.topk is not None
    assert block.problem.reason == "a capacity-padded form"
    assert block.problem.node.target is torch.ops.aten.bmm.default


def test_dense_model_has_no_block():
    torch.manual_seed(0)
    assert _find(models.build_model("llama-tiny"))[1] == []


def _hf(family, experts=None, dtype=torch.float32):
    pytest.importorskip("transformers")
    from mxgraph.hf.models import TINY, build_hf_model
    torch.manual_seed(0)
    overrides = TINY[family] | ({"experts_implementation": experts} if experts else {})
    return build_hf_model(f"hf:{family}", overrides, dtype=dtype)


@pytest.mark.parametrize("family,dtype,op", [
    ("mixtral", torch.float32, "transformers.grouped_mm_fallback.default"),
    ("mixtral", torch.bfloat16, "aten._grouped_mm.default"),
    ("qwen2_moe", torch.float32, "transformers.grouped_mm_fallback.default")])
def test_hf_grouped_mm(family, dtype, op):
    model = _hf(family, dtype=dtype)
    forward, blocks = _find(model)
    assert [b.form for b in blocks] == ["grouped", "grouped"]
    for layer, block in enumerate(blocks):
        assert block.problem is None and block.num_experts == 4
        assert _keys(block) == [f"model.model.layers.{layer}.mlp.experts.{p}"
                                for p in ("gate_up_proj", "down_proj")]  # no shared expert
        assert [str(g.target) for g in block.gemms] == [op, op]
        assert block.counts.target is torch.ops.aten.histc.default
        assert block.exit is block.gemms[1] and block.rows.meta["val"].shape[0] == 2 * 16 * 2
        assert block.combine.target is torch.ops.aten.sum.dim_IntList  # view(T, k, D).sum(1)
    _check_counts(forward, model, blocks[0])


def test_hf_batched_mm():
    model = _hf("mixtral", "batched_mm")
    forward, blocks = _find(model)
    assert [b.form for b in blocks] == ["gathered", "gathered"]
    block = blocks[0]
    assert block.problem is None and block.counts is None
    assert _keys(block) == [f"model.model.layers.0.mlp.experts.{p}"
                            for p in ("gate_up_proj", "down_proj")]
    assert [w.reads[0].target for w in block.weights] == [torch.ops.aten.index.Tensor] * 2
    assert [g.target for g in block.gemms] == [torch.ops.aten.bmm.default] * 2
    assert block.expert_ids.meta["val"].shape == (64,) and block.rows.meta["val"].shape[0] == 64
    assert block.exit.target is torch.ops.aten.squeeze.dim
    _check_counts(forward, model, block)


def test_hand_built_loop_over_experts():
    torch.manual_seed(0)
    model = HandMoE("nonzero")
    forward, [block] = _find(model)
    assert block.form == "loop" and block.stacked and block.problem is None
    assert block.rows is None and block.exit is None and len(block.masks) == 4
    assert sorted(_keys(block)) == ["w_in", "w_out"]
    assert [p.target for p in block.pieces] == [torch.ops.aten.index.Tensor] * 4
    assert [[s.args[2] for s in selects] for selects in block.selects] == [[e] * 2 for e in range(4)]
    assert all(o.target is torch.ops.aten.linear.default for o in block.outputs)
    assert block.combine.target is torch.ops.aten.index_add_.default
    indices = next(u for u in block.topk.users if u.args[1] == 1)
    values = _run(forward, model, set(block.pieces) | {indices})
    expected = torch.bincount(values[indices].flatten(), minlength=4).tolist()
    assert [values[p].shape[0] for p in block.pieces] == expected  # expert e's rows


def test_hand_built_module_per_expert_is_found_and_refused():
    torch.manual_seed(0)
    _, [block] = _find(HandMoE("modules"))
    assert block.form == "loop" and not block.stacked and len(block.weights) == 8
    assert block.problem.reason.startswith("experts held as one module each")
    assert "stacked in one parameter [E, ...]" in block.problem.remedy


def test_hand_built_capacity():
    torch.manual_seed(0)
    _, [block] = _find(HandMoE("capacity"))
    assert block.form == "capacity" and sorted(_keys(block)) == ["w_in", "w_out"]


def test_finder_does_not_change_the_graph():
    torch.manual_seed(0)
    forward = capture(HandMoE("nonzero"), (_tokens(), _tokens()), {})
    before = forward.gm.code
    find_expert_blocks(forward.gm)
    assert forward.gm.code == before

