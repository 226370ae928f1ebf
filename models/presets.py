"""Named model recipes: ``PRESETS[name] = (family, config)``.

Real-size presets match the published shapes; their parameter counts (``device="meta"``)
are within 2% of the published totals, checked in tests/test_models.py.
"""

from __future__ import annotations

from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.moe import MoEConfig

PRESETS: dict[str, tuple[str, object]] = {}


def _add(name: str, family: str, config: object) -> None:
    PRESETS[name] = (family, config)


# --- small presets for tests and CPU development (byte-level vocab) -----------------------
_add("llama-tiny", "llama", LlamaConfig(
    vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256))
_add("moe-tiny", "moe", MoEConfig(
    vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=256, attention="mla",
    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    ffn_dim=384, n_dense_layers=1, moe_ffn_dim=64, n_routed_experts=8, n_shared_experts=1,
    topk=2, score_func="sigmoid", n_groups=4, topk_groups=2))
_add("gpt-tiny", "gpt", GPTConfig(
    vocab_size=256, dim=128, n_layers=4, n_heads=4, ffn_dim=512, max_seq_len=256))
_add("llama-20m", "llama", LlamaConfig(
    vocab_size=256, dim=384, n_layers=12, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=1024))
_add("moe-20m", "moe", MoEConfig(
    vocab_size=256, dim=256, n_layers=6, n_heads=4, max_seq_len=1024, attention="mla",
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    ffn_dim=768, n_dense_layers=1, moe_ffn_dim=256, n_routed_experts=16, n_shared_experts=1,
    topk=2, score_func="sigmoid", n_groups=4, topk_groups=2))
# TinyLlama-1.1B shape.
_add("llama-1b", "llama", LlamaConfig(
    vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
    max_seq_len=2048))

# --- published sizes ------------------------------------------------------------------------
_add("gpt2-124m", "gpt", GPTConfig(   # 124.4M (tied embeddings)
    vocab_size=50257, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_seq_len=1024))
_add("llama2-7b", "llama", LlamaConfig(   # 6.74B
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
    max_seq_len=4096))
_add("llama2-70b", "llama", LlamaConfig(  # 68.98B
    vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
    max_seq_len=4096))
_add("llama3-8b", "llama", LlamaConfig(   # 8.03B
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    max_seq_len=8192, rope_theta=500000.0))
_add("mixtral-8x7b", "moe", MoEConfig(  # 46.7B
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, max_seq_len=32768, rope_theta=1e6,
    norm_eps=1e-5, attention="gqa", n_kv_heads=8, n_dense_layers=0, moe_ffn_dim=14336,
    n_routed_experts=8, n_shared_experts=0, topk=2, score_func="softmax", n_groups=1,
    topk_groups=1, norm_topk_prob=True))
# Main model without the multi-token-prediction module (671B; 685B with it).
_add("deepseek-v3-671b", "moe", MoEConfig(
    vocab_size=129280, dim=7168, n_layers=61, n_heads=128, max_seq_len=4096, norm_eps=1e-6,
    attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, ffn_dim=18432, n_dense_layers=3, moe_ffn_dim=2048,
    n_routed_experts=256, n_shared_experts=1, topk=8, score_func="sigmoid", n_groups=8,
    topk_groups=4, norm_topk_prob=True, route_scale=2.5,
    expert_impl="grouped_mm"))  # static shapes: the per-expert loop traces too slowly at 256

PUBLISHED_PARAMS: dict[str, float] = {
    "gpt2-124m": 124.4e6,
    "llama2-7b": 6.74e9,
    "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9,
    "mixtral-8x7b": 46.7e9,
    "deepseek-v3-671b": 671e9,
}


def list_presets() -> list[str]:
    """Preset names, in definition order (small first)."""
    return list(PRESETS)
