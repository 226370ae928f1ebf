"""GPT (GPT-2 / Megatron style): learned positions, LayerNorm, SDPA, bias-GELU MLP, biases on.

Module paths (what passes key on):
``embed``, ``pos_embed``, ``layers.{i}.ln1``, ``layers.{i}.attn.{wq,wk,wv,wo}``,
``layers.{i}.ln2``, ``layers.{i}.mlp.{fc1,fc2}``, ``norm``, ``lm_head`` (tied to ``embed``
by default).

Patterns written out for the fusion passes:
- bias-GELU: ``F.gelu(F.linear(x, fc1.weight) + fc1.bias)`` (``x @ W + b``, then GELU);
- bias-dropout-add (BDA): the output projections ``wo`` and ``fc2`` run without their bias,
  which is added in ``residual + F.dropout(y + bias, p)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common import causal_attention, init_normal_, lm_loss


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Vocabulary size (rows of the embedding and of the LM head)."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; head_dim = dim // n_heads."""
    ffn_dim: int = 512
    """Hidden width of the GELU MLP."""
    max_seq_len: int = 256
    """Longest sequence; rows of the learned position embedding."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    dropout: float = 0.0
    """Dropout on attention probabilities, in bias-dropout-add, and after the embeddings."""
    tie_embeddings: bool = True
    """Share one Parameter between the token embedding and the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every weight matrix."""

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")


def bias_dropout_add(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                     p: float, training: bool) -> torch.Tensor:
    """``residual + dropout(y + bias)`` (Megatron's BDA)."""
    return residual + F.dropout(y + bias, p=p, training=training)


class GPTAttention(nn.Module):
    """Multi-head causal attention with biased projections; returns (y, wo.bias) for BDA."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, D = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x_BSD).view(B, S, self.n_heads, self.head_dim)
        v = self.wv(x_BSD).view(B, S, self.n_heads, self.head_dim)
        out = causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return F.linear(out.reshape(B, S, D), self.wo.weight), self.wo.bias


class GPTMLP(nn.Module):
    """``fc2(gelu(x @ W1 + b1))``; returns (y, fc2.bias) for BDA."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(F.linear(x, self.fc1.weight) + self.fc1.bias)
        return F.linear(h, self.fc2.weight), self.fc2.bias


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, b = self.attn(self.ln1(x))
        x = bias_dropout_add(y, b, x, self.dropout, self.training)
        y, b = self.mlp(self.ln2(x))
        return bias_dropout_add(y, b, x, self.dropout, self.training)


class GPT(nn.Module):
    """``forward(tokens[B, S], targets[B, S]) -> scalar mean cross-entropy (fp32)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        init_normal_(self, cfg.init_std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        S = tokens.shape[1]
        pos = torch.arange(S, device=tokens.device)
        x = F.dropout(self.embed(tokens) + self.pos_embed(pos), p=self.config.dropout,
                      training=self.training)
        for layer in self.layers:
            x = layer(x)
        return lm_loss(self.lm_head(self.norm(x)), targets)
