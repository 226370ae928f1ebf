"""Named model recipes: ``PRESETS[name] = (family, config)``.

Real-size presets match the published shapes; their parameter counts (``device="meta"``)
are within 2% of the published totals, checked in tests/test_models.py.
"""

from __future__ import annotations

from models.llama import LlamaConfig

PRESETS: dict[str, tuple[str, object]] = {}


def _add(name: str, family: str, config: object) -> None:
    PRESETS[name] = (family, config)


# --- small presets for tests and CPU development (byte-level vocab) -----------------------
_add("llama-tiny", "llama", LlamaConfig(
    vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256))
_add("llama-20m", "llama", LlamaConfig(
    vocab_size=256, dim=384, n_layers=12, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=1024))
# TinyLlama-1.1B shape.
_add("llama-1b", "llama", LlamaConfig(
    vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
    max_seq_len=2048))

# --- published sizes ------------------------------------------------------------------------
_add("llama2-7b", "llama", LlamaConfig(   # 6.74B
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
    max_seq_len=4096))
_add("llama2-70b", "llama", LlamaConfig(  # 68.98B
    vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
    max_seq_len=4096))
_add("llama3-8b", "llama", LlamaConfig(   # 8.03B
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    max_seq_len=8192, rope_theta=500000.0))

PUBLISHED_PARAMS: dict[str, float] = {
    "llama2-7b": 6.74e9,
    "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9,
}


def list_presets() -> list[str]:
    """Preset names, in definition order (small first)."""
    return list(PRESETS)
