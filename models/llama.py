"""Llama (2/3 style): RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, no biases.

Module paths (what passes key on):
``embed``, ``layers.{i}.attn_norm``, ``layers.{i}.attn.{wq,wk,wv,wo}``, ``layers.{i}.mlp_norm``,
``layers.{i}.mlp.{gate,up,down}``, ``norm``, ``lm_head`` (its weight is ``embed.weight``
when ``tie_embeddings``), ``rope`` (cos/sin buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from models.common import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    causal_attention,
    init_normal_,
    lm_loss,
    repeat_kv,
)


@dataclass(kw_only=True)
class LlamaConfig:
    vocab_size: int = 256
    """Vocabulary size (rows of the embedding and of the LM head)."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; head_dim = dim // n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None = n_heads, i.e. multi-head)."""
    ffn_dim: int = 384
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 256
    """Longest sequence; rows of the RoPE cos/sin tables."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share one Parameter between the token embedding and the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every weight matrix."""

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class GQAttention(nn.Module):
    """Grouped-query causal attention: K/V heads repeated for their query groups, then SDPA."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        v = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        num_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, num_rep), repeat_kv(v, num_rep)
        out = causal_attention(q, k, v)
        return self.wo(out.reshape(B, S, self.n_heads * self.head_dim))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = GQAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """``forward(tokens[B, S], targets[B, S]) -> scalar mean cross-entropy (fp32)``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        init_normal_(self, cfg.init_std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1])
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return lm_loss(self.lm_head(self.norm(x)), targets)
