"""The fusion pass on the llama, moe and gpt tiny presets: every occurrence of each pattern is
fused (counted against the model's structure), and training with fusion on matches fusion off.

About the bounds: the fused ops round differently from the ATen ops they replace (fp32 math,
one rounding), so on vs off is not bitwise. The loss and the gradient as a whole agree within
1e-6. A few gradients of the tiny presets are ill-conditioned: eager fp32 itself is ~1.05e-6
away from fp64 on the last layer's wq/wk gradient, so for a single parameter the test also
accepts an error within twice unfused fp32's own error (measured against an fp64 run). After
AdamW steps, fp32 training drifts from fp64 by ~2e-5 (Adam's normalisation amplifies the
rounding of near-zero gradient elements), so parameters after 3 steps are checked to stay within
4x the unfused run's own distance from fp64 (measured: 1.25x llama-tiny, 3.2x gpt-tiny, where
the last layer's q bias, whose gradient is tiny, moves most), and the losses of steps 2 and 3 within 5e-6
(measured: up to 1.1e-6 on gpt-tiny, whose unfused fp32 loss is itself 2.7e-7 from fp64).
GPT's key biases are frozen: their gradient is 0 in exact arithmetic (softmax ignores a
per-row shift), so in fp32 it is pure rounding noise that AdamW turns into +-lr steps.
"""
from __future__ import annotations

import copy

import pytest
import torch

import models
import mxgraph as mx
from tests.helpers import batch, rel_err
from tests.test_fuse_forms import TOL, dump_counts


def expected_counts(name: str, cfg) -> dict:
    """Fused ops per kind, from the model's structure."""
    layers = cfg.n_layers
    if name.startswith("llama"):
        gqa = layers if cfg.n_kv_heads < cfg.n_heads else 0
        return {"swiglu": layers, "rmsnorm": 2 * layers + 1, "rope": layers, "gqa": gqa,
                "linear_cross_entropy": 1}
    if name.startswith("moe"):
        moe_layers = layers - cfg.n_dense_layers
        experts = cfg.n_routed_experts if cfg.expert_impl == "loop" else 1  # grouped_mm: one
        swiglu = cfg.n_dense_layers + moe_layers * (experts + int(cfg.n_shared_experts > 0))
        norms_per_layer = 2 + (cfg.attention == "mla") * (1 + int(cfg.q_lora_rank > 0))
        counts = {"swiglu": swiglu, "rmsnorm": norms_per_layer * layers + 1, "rope": layers,
                  "linear_cross_entropy": 1}
        counts.update(moe_counts(cfg, moe_layers))
        return counts
    return {"bias_gelu": layers, "bias_dropout_add": 2 * layers, "linear_cross_entropy": 1}


def moe_counts(cfg, moe_layers: int) -> dict:
    """One router per MoE layer (the op takes the model's per-group score width as
    group_topk); permute and unpermute are two ops per dropless MoE layer."""
    return {"moe_router": moe_layers,
            "moe_permute": 2 * moe_layers * (cfg.capacity_factor is None)}


def _frozen_key_biases(model) -> None:
    for name, p in model.named_parameters():
        if name.endswith("attn.wk.bias"):
            p.requires_grad_(False)


def _grads(model):
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


# moe-tiny keeps 2 of its 4 layers (one dense, one MoE): its per-expert loop traces slowly
PRESETS = [("llama-tiny", {}), ("moe-tiny", {"n_layers": 2}), ("gpt-tiny", {})]


@pytest.mark.parametrize("name, overrides", PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_fusion_counts_and_parity(name, overrides, tmp_path):
    """Fusion on vs off (= eager: tests/test_compile.py holds the unfused step to it)."""
    torch.manual_seed(0)
    model = models.build_model(name, **overrides)
    _frozen_key_biases(model)
    unfused, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    args = batch(vocab=model.config.vocab_size, seq_len=16)
    on = mx.compile(model, mx.Plan(fusion=True, dump_dir=str(tmp_path)))
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    opts = [torch.optim.AdamW(params(m), lr=1e-2) for m in (model, unfused, exact)]
    for i in range(3):
        loss_on, loss_off, loss_exact = on(*args), unfused(*args), exact(*args)
        loss_off.backward()
        loss_exact.backward()
        err, own = rel_err(loss_on, loss_off), rel_err(loss_off, loss_exact)
        if i == 0:
            assert err <= TOL, (loss_on.item(), loss_off.item())
            g_on, g_off, g_exact = _grads(model), _grads(unfused), _grads(exact)
            assert rel_err(_flat(g_on.values()), _flat(g_off.values())) <= TOL
            for key in g_on:
                err = rel_err(g_on[key], g_off[key])
                own = rel_err(g_off[key], g_exact[key])
                assert err <= TOL or rel_err(g_on[key], g_exact[key]) <= 2 * own, (key, err, own)
        else:  # after AdamW steps the parameters differ by fp32 drift (see module docstring)
            assert err <= 5 * TOL or rel_err(loss_on, loss_exact) <= 2 * own, (i, err, own)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    drift_on = rel_err(_flat(params(model)), _flat(params(exact)))
    drift_off = rel_err(_flat(params(unfused)), _flat(params(exact)))
    assert drift_on <= max(4 * drift_off, TOL), (drift_on, drift_off)
    expected = {k: v for k, v in expected_counts(name, model.config).items() if v}
    assert dump_counts(tmp_path) == expected


def test_dropout_on_same_seed_same_loss(tmp_path):
    losses = []
    for run in range(2):
        torch.manual_seed(0)
        model = models.build_model("gpt-tiny", n_layers=2, dropout=0.1)
        step = mx.compile(model, mx.Plan(fusion=True, dump_dir=str(tmp_path / str(run))))
        torch.manual_seed(7)
        losses.append([step(*batch(seq_len=8)).item() for _ in range(2)])
        assert dump_counts(tmp_path / str(run))["bias_dropout_add"] == 4
    assert losses[0] == losses[1]
    assert losses[0][0] != losses[0][1]


def test_fusion_kinds_select_patterns(tmp_path):
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=1)
    mx.compile(model, mx.Plan(fusion="swiglu,rope", dump_dir=str(tmp_path)))(*batch(seq_len=8))
    assert dump_counts(tmp_path) == {"swiglu": 1, "rope": 1}


def test_fused_nodes_carry_values_and_provenance():
    from mxgraph.capture import capture
    from mxgraph.context import CompileContext
    from mxgraph.passes.fuse import fused_counts
    from mxgraph.passes.pipeline import FORWARD_PASSES
    from mxgraph.passes.runner import run_pass

    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=2)
    gm = capture(model, batch(seq_len=8), {}).gm
    ctx = CompileContext.for_plan(mx.Plan(fusion=True))
    for spec in FORWARD_PASSES:
        gm = run_pass(spec, gm, ctx)
    assert fused_counts(gm) == {"swiglu": 2, "rmsnorm": 5, "rope": 2, "gqa": 2, "linear_cross_entropy": 1}
    names = {n.name for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("created_by") != "fuse":
            continue
        assert "val" in node.meta, node.name
        custom = node.meta["custom"]
        assert any(t.startswith("fused:") for t in custom["tags"]) and "module" in custom
        assert "nn_module_stack" in node.meta
        if "fused_from" in custom:  # the fused op itself: the nodes it replaced are gone
            assert custom["fused_from"] and not names & set(custom["fused_from"])
    layers = {n.meta["custom"]["layer"] for n in gm.graph.nodes
              if n.target is torch.ops.mxgraph.swiglu.default}
    assert layers == {0, 1}


def test_deepseek_v3_shape_fusion_counts():
    """The real DeepSeek-V3 preset (4 of its layers, on the meta device): group-limited sigmoid
    router with selection bias, grouped_mm experts, MLA."""
    from mxgraph.capture import capture
    from mxgraph.passes.cleanup import remove_noop_pass
    from mxgraph.passes.fuse import apply_patterns, fused_counts
    from mxgraph.plan import FUSION_KINDS

    model = models.build_model("deepseek-v3-671b", device="meta", dtype=torch.bfloat16, n_layers=4)
    tokens = torch.zeros(1, 16, dtype=torch.long, device="meta")
    gm = remove_noop_pass(capture(model, (tokens, tokens), {}).gm, None)  # the pass before fuse
    apply_patterns(gm, FUSION_KINDS)
    gm.graph.lint()
    assert fused_counts(gm) == expected_counts("moe", model.config)


def test_a_refused_rewrite_leaves_the_graph_as_it_was():
    from mxgraph.capture import capture
    from mxgraph.passes.fuse import fused_counts
    from mxgraph.passes.fuse_patterns import SwiGLU
    from mxgraph.passes.fuse_patterns_base import Rewriter

    class Refused(SwiGLU):
        def rewrite(self, rw, m):
            self.helper(rw, m, torch.ops.aten.neg.default, (m.parts["a"],))
            raise ValueError("refused")

    torch.manual_seed(0)
    gm = capture(models.build_model("llama-tiny", n_layers=1), batch(seq_len=8), {}).gm
    before = gm.code
    with pytest.warns(UserWarning, match="left .* unfused: ValueError: refused"):
        assert Refused().apply(Rewriter(gm)) == 0
    gm.graph.lint()
    assert gm.recompile() is not None and gm.code == before and not fused_counts(gm)
