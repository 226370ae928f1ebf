"""Building blocks shared by the reference models: norm, RoPE, SwiGLU, loss, init.

Shape legend used in names: B batch, S sequence, D model dim, H query heads,
K key/value heads, E head dim, V vocabulary, F feed-forward dim.

Every block is written in plain torch ops so the graph passes (fusion, sharding,
recompute) see the textbook pattern, e.g. ``F.silu(gate(x)) * up(x)`` for SwiGLU.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``; the reduction runs in float32 and the result is cast back."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, as non-persistent float32 buffers.

    The tables hold ``max_seq_len`` rows of ``head_dim`` columns; ``forward(seq_len)``
    slices the first ``seq_len`` rows (shape [S, E]).
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        cos, sin = rope_tables(head_dim, max_seq_len, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * theta**(-2i/E)``, each [max_seq_len, E] (the half repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_seq_len, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BSHE: torch.Tensor, cos_SE: torch.Tensor, sin_SE: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [B, S, H, E]: pairs (i, i + E/2) rotate as one complex number.

    Computed in float32, returned in the input dtype.
    """
    cos = cos_SE[None, :, None, :]
    sin = sin_SE[None, :, None, :]
    x32 = x_BSHE.float()
    return (x32 * cos + rotate_half(x32) * sin).type_as(x_BSHE)


def repeat_kv(x_BSKE: torch.Tensor, num_rep: int) -> torch.Tensor:
    """[B, S, K, E] -> [B, S, K*num_rep, E]; each KV head serves ``num_rep`` query heads."""
    if num_rep == 1:
        return x_BSKE
    B, S, K, E = x_BSKE.shape
    return x_BSKE[:, :, :, None, :].expand(B, S, K, num_rep, E).reshape(B, S, K * num_rep, E)


def causal_attention(q_BSHE: torch.Tensor, k_BSHE: torch.Tensor, v_BSHE: torch.Tensor,
                     *, dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Causal SDPA over [B, S, H, E] inputs (heads already repeated); returns [B, S, H, Ev]."""
    out = F.scaled_dot_product_attention(
        q_BSHE.transpose(1, 2), k_BSHE.transpose(1, 2), v_BSHE.transpose(1, 2),
        dropout_p=dropout_p, is_causal=True, scale=scale)
    return out.transpose(1, 2)


class SwiGLU(nn.Module):
    """``down(F.silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate = nn.Linear(dim, ffn_dim, bias=False)
        self.up = nn.Linear(dim, ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats per token, computed in float32 (targets of -100 ignored)."""
    V = logits_BSV.shape[-1]
    return F.cross_entropy(logits_BSV.float().reshape(-1, V), targets_BS.reshape(-1))


def init_normal_(module: nn.Module, std: float) -> None:
    """Reset every parameter of ``module`` in ``named_modules`` order (deterministic under a seed).

    Linear/Embedding weights and stacked expert weights ~ N(0, std); biases 0; norm weights 1.
    Tensors on the meta device are left alone (there is nothing to fill).
    """
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.is_meta:
                continue
            with torch.no_grad():
                if isinstance(sub, (RMSNorm, nn.LayerNorm)):
                    p.fill_(1.0 if name == "weight" else 0.0)
                elif name.endswith("bias") or name.startswith("b_"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)


def cast_params_(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters (not buffers: RoPE tables and router biases stay fp32) in place.

    Parameter objects are kept, so tied weights stay one Parameter.
    """
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def count_params(module: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once); works on meta."""
    return sum(p.numel() for p in module.parameters())
