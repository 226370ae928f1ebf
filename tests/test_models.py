"""Reference models: sizes, initial loss, gradients, and blocks against plain-math references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

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
    assert all(p.is_meta for p in model.parameters())
    n = models.count_params(model)
    assert abs(n / models.PUBLISHED_PARAMS[name] - 1) < 0.02, (name, n)


def test_seeded_init_is_deterministic_and_overrides_apply():
    torch.manual_seed(3)
    a = models.build_model("llama-tiny", n_layers=2)
    torch.manual_seed(3)
    b = models.build_model("llama-tiny", n_layers=2)
    assert len(a.layers) == 2
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
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
