"""Reference models: sizes, initial loss, gradients, and blocks against plain-math references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import models
from models.common import apply_rope, rope_tables

TINY = ["llama-tiny", "moe-tiny", "gpt-tiny"]


def _batch(vocab: int, B: int = 2, S: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    targets = torch.randint(0, vocab, (B, S), generator=g)
    return tokens, targets


@pytest.mark.parametrize("name", TINY)
def test_tiny_size_and_initial_loss(name):
    torch.manual_seed(0)
    model = models.build_model(name)
    assert models.count_params(model) < 2_000_000
    assert model.config.vocab_size == 256 and model.config.max_seq_len >= 256
    loss = model(*_batch(256))
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.5


@pytest.mark.parametrize("name", TINY)
def test_backward_finite_grads(name):
    torch.manual_seed(0)
    model = models.build_model(name)
    model(*_batch(256)).backward()
    for pname, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), pname
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(models.PUBLISHED_PARAMS))
def test_real_presets_on_meta_match_published(name):
    model = models.build_model(name, device="meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    n = models.count_params(model)
    assert abs(n / models.PUBLISHED_PARAMS[name] - 1) < 0.02, (name, n)


def test_seeded_init_is_deterministic_and_overrides_apply():
    torch.manual_seed(3)
    a = models.build_model("llama-tiny", n_layers=2)
    torch.manual_seed(3)
    b = models.build_model("llama-tiny", n_layers=2)
    assert len(a.layers) == 2
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na


@pytest.mark.parametrize("name", TINY)
def test_tied_embeddings_share_one_parameter(name):
    model = models.build_model(name, tie_embeddings=True, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.embed.weight
    assert sum(p is model.embed.weight for p in model.parameters()) == 1
    assert model.embed.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in model.buffers())
    assert model(*_batch(256)).dtype == torch.float32


def test_unknown_preset_and_bad_override_raise():
    with pytest.raises(KeyError):
        models.build_model("llama-3t")
    with pytest.raises(TypeError):
        models.build_model("llama-tiny", n_layer=2)
    assert set(models.list_presets()) == set(models.PRESETS)


def test_rope_matches_complex_reference():
    B, S, H, E = 2, 9, 3, 8
    x = torch.randn(B, S, H, E, dtype=torch.float64)
    cos, sin = rope_tables(E, 16, 10000.0)
    got = apply_rope(x, cos[:S].double(), sin[:S].double())
    # rotate-half pairs element i with i + E/2: treat them as one complex number.
    xc = torch.complex(x[..., : E // 2], x[..., E // 2:])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, E, 2, dtype=torch.float64) / E))
    rot = torch.polar(torch.ones(S, E // 2, dtype=torch.float64),
                      torch.outer(torch.arange(S, dtype=torch.float64), inv_freq))
    yc = xc * rot[None, :, None, :]
    want = torch.cat([yc.real, yc.imag], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _plain_attention(q, k, v, scale=None):
    """[B, S, H, E] math reference with explicit repeat of K/V heads and a causal mask."""
    H, K = q.shape[2], k.shape[2]
    k = k.repeat_interleave(H // K, dim=2)
    v = v.repeat_interleave(H // K, dim=2)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bshe,bthe->bhst", q, k) * scale
    S = q.shape[1]
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhst,bthe->bshe", scores.softmax(-1), v)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_gqa_attention_matches_plain_math(n_heads, n_kv_heads):
    from models.llama import GQAttention
    torch.manual_seed(0)
    dim, B, S = 48, 2, 7
    attn = GQAttention(dim, n_heads, n_kv_heads).double()
    x = torch.randn(B, S, dim, dtype=torch.float64)
    hd = dim // n_heads
    cos, sin = (t.double() for t in rope_tables(hd, S, 10000.0))
    got = attn(x, cos, sin)
    q = apply_rope(attn.wq(x).view(B, S, n_heads, hd), cos, sin)
    k = apply_rope(attn.wk(x).view(B, S, n_kv_heads, hd), cos, sin)
    v = attn.wv(x).view(B, S, n_kv_heads, hd)
    want = attn.wo(_plain_attention(q, k, v).reshape(B, S, dim))
    torch.testing.assert_close(got, want)


def test_mla_attention_matches_plain_math():
    from models.moe import MLAttention, MoEConfig
    torch.manual_seed(0)
    cfg = MoEConfig(dim=32, n_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6)
    attn = MLAttention(cfg).double()
    B, S, H = 2, 5, 4
    x = torch.randn(B, S, 32, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(4, S, 10000.0))
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(B, S, H, 12)
    q = torch.cat([q[..., :8], apply_rope(q[..., 8:], cos, sin)], -1)
    latent, k_pe = attn.wkv_a(x)[..., :8], attn.wkv_a(x)[..., 8:]
    kv = attn.wkv_b(attn.kv_norm(latent)).view(B, S, H, 14)
    k_pe = apply_rope(k_pe.view(B, S, 1, 4), cos, sin).expand(B, S, H, 4)
    k = torch.cat([kv[..., :8], k_pe], -1)
    want = attn.wo(_plain_attention(q, k, kv[..., 8:], scale=12 ** -0.5).reshape(B, S, H * 6))
    torch.testing.assert_close(attn(x, cos, sin), want)


def test_gpt_dropout_only_in_training_and_bias_gelu_pattern():
    torch.manual_seed(0)
    model = models.build_model("gpt-tiny", dropout=0.2, n_layers=2)
    batch = _batch(256)
    model.eval()
    assert torch.equal(model(*batch), model(*batch))
    model.train()
    torch.manual_seed(1)
    a = model(*batch)
    torch.manual_seed(2)
    assert not torch.equal(a, model(*batch))
    mlp = model.layers[0].mlp
    x = torch.randn(3, 128)
    y, b = mlp(x)
    torch.testing.assert_close(y + b, mlp.fc2(F.gelu(mlp.fc1(x))))


# --- MoE --------------------------------------------------------------------------------

def _moe_cfg(**kw):
    from models.moe import MoEConfig
    base = dict(dim=32, n_layers=2, n_heads=2, q_lora_rank=16, kv_lora_rank=8,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn_dim=48,
                n_dense_layers=1, moe_ffn_dim=16, n_routed_experts=8, n_shared_experts=1,
                topk=2, score_func="sigmoid", n_groups=4, topk_groups=2)
    base.update(kw)
    return MoEConfig(**base)


def _reference_gates(cfg, router, x_TD):
    """Dense [T, E] gate matrix, routing each token by hand (independent of Router.forward)."""
    logits = x_TD @ router.weight.T
    T, E = logits.shape
    gates = torch.zeros(T, E, dtype=torch.float64)
    per_group = E // cfg.n_groups
    for t in range(T):
        s = logits[t].double().softmax(-1) if cfg.score_func == "softmax" else logits[t].double().sigmoid()
        choice = s + router.expert_bias.double()
        allowed = list(range(E))
        if cfg.n_groups > 1:
            group_score = [sorted(choice[g * per_group:(g + 1) * per_group].tolist())[-2:]
                           for g in range(cfg.n_groups)]
            best = sorted(range(cfg.n_groups), key=lambda g: -sum(group_score[g]))[:cfg.topk_groups]
            allowed = [e for e in range(E) if e // per_group in best]
        chosen = sorted(allowed, key=lambda e: -choice[e].item())[:cfg.topk]
        w = s[chosen]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        gates[t, chosen] = w * cfg.route_scale
    return gates


def _check_moe_block_against_dense(cfg, seed=0):
    from models.moe import MoEBlock
    torch.manual_seed(seed)
    with torch.no_grad():
        block = MoEBlock(cfg)
        from models.common import init_normal_
        init_normal_(block, 0.3)
        # a selection bias that is large enough to change some choices
        block.router.expert_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.05)
        x = torch.randn(2, 8, cfg.dim)
        got, _ = block(x)
        xt = x.reshape(-1, cfg.dim)
        gates = _reference_gates(cfg, block.router, xt).float()
        weights, ids, _ = block.router(xt)
        torch.testing.assert_close(torch.zeros_like(gates).scatter(1, ids, weights), gates,
                                   atol=1e-6, rtol=1e-6)
        all_experts = torch.stack([block.experts.expert(e, xt) for e in range(cfg.n_routed_experts)], 1)
        want = (gates[:, :, None] * all_experts).sum(1)
        if block.shared is not None:
            want = want + block.shared(xt)
    torch.testing.assert_close(got.reshape(-1, cfg.dim), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expert_impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_moe_dispatch_matches_dense_reference(score_func, groups, expert_impl):
    _check_moe_block_against_dense(_moe_cfg(score_func=score_func, n_groups=groups[0],
                                            topk_groups=groups[1], expert_impl=expert_impl))


def test_grouped_mm_op_matches_loop_and_passes_opcheck():
    from mxgraph.codegen.kernels.grouped_mm import grouped_mm
    torch.manual_seed(0)
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 10])
    want = torch.cat([x[0:3] @ w[0], x[3:7] @ w[2], x[7:10] @ w[3]])
    torch.testing.assert_close(grouped_mm(x, w, offs), want)
    torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (x, w))
    torch.library.opcheck(grouped_mm, (x, w, offs))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(score_func=st.sampled_from(["softmax", "sigmoid"]),
       experts_groups=st.sampled_from([(4, 1, 1), (8, 2, 1), (8, 4, 2), (16, 4, 3)]),
       topk=st.integers(1, 3), shared=st.integers(0, 2), norm=st.booleans(),
       route_scale=st.sampled_from([1.0, 2.5]))
def test_moe_dispatch_sweep(score_func, experts_groups, topk, shared, norm, route_scale):
    E, G, TG = experts_groups
    topk = min(topk, TG * E // G)
    _check_moe_block_against_dense(_moe_cfg(
        score_func=score_func, n_routed_experts=E, n_groups=G, topk_groups=TG, topk=topk,
        n_shared_experts=shared, norm_topk_prob=norm, route_scale=route_scale))


def test_moe_capacity_dispatch():
    from models.moe import MoEBlock
    torch.manual_seed(0)
    block = MoEBlock(_moe_cfg())
    from models.common import init_normal_
    init_normal_(block, 0.3)
    x = torch.randn(2, 8, 32)
    dropless, _ = block(x)
    block.cfg = _moe_cfg(capacity_factor=4.0)   # C = T*k: nothing can be dropped
    torch.testing.assert_close(block(x)[0], dropless, atol=1e-5, rtol=1e-5)
    block.cfg = _moe_cfg(capacity_factor=0.5)   # C = 2 of 4 average rows: some dropped
    dropped, _ = block(x)
    assert not torch.allclose(dropped, dropless)
    # a token whose every assignment overflowed gets only the shared expert
    assert torch.isfinite(dropped).all()


def test_moe_forward_mutates_nothing_and_bias_update_is_explicit():
    torch.manual_seed(0)
    model = models.build_model("moe-tiny", n_layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _batch(256)
    model(*batch).backward()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    counts = model.expert_counts(batch[0])
    assert [int(c.sum()) for c in counts] == [2 * 32 * 2]
    model.update_expert_bias(counts, rate=1e-3)
    bias = model.moe_blocks()[0].router.expert_bias
    assert torch.equal(bias, 1e-3 * torch.sign(counts[0].float().mean() - counts[0].float()))


def test_moe_aux_loss_adds_to_loss():
    batch = _batch(256)
    torch.manual_seed(0)
    plain = models.build_model("moe-tiny", n_layers=2)
    torch.manual_seed(0)
    aux = models.build_model("moe-tiny", n_layers=2, aux_loss_coef=0.1)
    diff = (aux(*batch) - plain(*batch)).item()
    assert 0.05 < diff < 0.5   # coef * E * sum f*P is ~coef for a near-uniform router


@pytest.mark.parametrize("expert_impl", ["loop", "grouped_mm"])
def test_moe_export_runs_on_a_new_routing(expert_impl):
    torch.manual_seed(0)
    model = models.build_model("moe-tiny", n_layers=1, n_dense_layers=0, dim=64,
                               expert_impl=expert_impl)
    a, b = _batch(256, S=16, seed=1), _batch(256, S=16, seed=2)
    counts_a, counts_b = model.expert_counts(a[0])[0], model.expert_counts(b[0])[0]
    assert not torch.equal(counts_a, counts_b)
    ep = torch.export.export(model, a, strict=False)
    assert not ep.graph_signature.buffers_to_mutate
    exported = ep.module()
    for batch in (a, b):
        torch.testing.assert_close(exported(*batch), model(*batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expert_impl", ["loop", "grouped_mm"])
def test_moe_joint_graph_runs_on_a_new_routing(expert_impl):
    """With expert_impl="loop", aot_export_joint_with_descriptors needs fake inputs from a mode
    with a ShapeEnv: the per-expert counts become unbacked SymInts (a static fake mode cannot
    hold them). "grouped_mm" has static shapes and traces either way."""
    import contextlib

    from torch._functorch._aot_autograd.descriptors import BufferAOTInput, GradAOTOutput, ParamAOTInput, TangentAOTInput
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    torch.manual_seed(0)
    model = models.build_model("moe-tiny", n_layers=1, n_dense_layers=0, dim=64,
                               expert_impl=expert_impl)
    a, b = _batch(256, S=16, seed=1), _batch(256, S=16, seed=2)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = tuple(fake_mode.from_tensor(t, static_shapes=True) for t in a)
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, model, fake)
    gm = joint.graph_module
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    placeholders = gm.graph.find_nodes(op="placeholder")
    out_descs = gm.graph.find_nodes(op="output")[0].meta["desc"]
    for batch in (a, b):
        primals, tangents, user = [], [], iter(batch)
        for node in placeholders:
            desc = node.meta["desc"]
            if isinstance(desc, ParamAOTInput):
                primals.append(params[desc.target])
            elif isinstance(desc, BufferAOTInput):
                primals.append(buffers[desc.target])
            elif isinstance(desc, TangentAOTInput):
                tangents.append(torch.ones(()))
            else:
                primals.append(next(user))
        fw_outs, grads = gm(primals, tangents)
        model.zero_grad()
        loss = model(*batch)
        loss.backward()
        torch.testing.assert_close(fw_outs[0], loss)
        for desc, grad in zip(out_descs[1:], grads, strict=True):
            if isinstance(desc, GradAOTOutput):
                torch.testing.assert_close(grad, params[desc.grad_of.target].grad,
                                           atol=1e-6, rtol=1e-5)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 3)]), head_dim=st.sampled_from([8, 16]),
       n_layers=st.integers(1, 2), tie=st.booleans(), S=st.integers(1, 12))
def test_llama_config_sweep(heads, head_dim, n_layers, tie, S):
    n_heads, n_kv_heads = heads
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", dim=n_heads * head_dim, n_heads=n_heads,
                               n_kv_heads=n_kv_heads, n_layers=n_layers, tie_embeddings=tie,
                               ffn_dim=32, max_seq_len=16)
    loss = model(*_batch(256, S=S))
    assert abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
