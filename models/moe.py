"""DeepSeek-V3-style Mixture-of-Experts transformer (also Mixtral with ``attention="gqa"``).

Module paths (what passes key on):
``embed``, ``layers.{i}.attn_norm``, ``layers.{i}.attn`` (MLA: ``wq`` or ``wq_a``/``q_norm``/
``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``; GQA: ``wq``/``wk``/``wv``/``wo``),
``layers.{i}.mlp_norm``, ``layers.{i}.mlp`` (dense layers: SwiGLU ``gate``/``up``/``down``;
MoE layers: ``router`` (``weight`` [E, D] and buffer ``expert_bias`` [E]), ``experts``
(stacked ``w_gate``/``w_up`` [E, F, D] and ``w_down`` [E, D, F]), ``shared`` (a SwiGLU of
``n_shared_experts * moe_ffn_dim``, absent when 0)), ``norm``, ``lm_head``, ``rope``.

Routing (per token): ``scores = sigmoid|softmax(x @ router.weight.T)``; the choice uses
``scores + expert_bias`` (group-limited: keep the ``topk_groups`` groups whose top-2 biased
scores sum highest), the gate weights are the *unbiased* scores of the chosen experts,
optionally renormalised (``norm_topk_prob``), times ``route_scale``.

Dispatch is dropless by default: assignments are sorted by expert; with ``expert_impl="loop"``
per-expert counts become unbacked SymInts when traced (``torch._check`` bounds them), with
``"grouped_mm"`` they stay in an offsets tensor fed to the ``mxgraph::grouped_mm`` custom op;
either way one traced graph serves every routing. Tracing "loop" with
``aot_export_joint_with_descriptors`` needs fake inputs from a ``FakeTensorMode`` that has a
``ShapeEnv`` (a static fake mode cannot hold unbacked SymInts); ``torch.export`` works as is.
With ``capacity_factor`` set, each expert takes at most
``ceil(T * topk / E * capacity_factor)`` assignments (earlier tokens first, the rest dropped)
in a fixed-shape [E, C, D] batched GEMM.

``forward`` mutates nothing; the aux-loss-free balancing update runs outside it through
``MoEBlock.update_expert_bias(counts, rate)`` (or ``MoETransformer.update_expert_bias`` with
the per-block counts of ``MoETransformer.expert_counts(tokens)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, causal_attention, init_normal_, lm_loss
from models.llama import GQAttention
from mxgraph.codegen.kernels.grouped_mm import grouped_mm


@dataclass(kw_only=True)
class MoEConfig:
    vocab_size: int = 256
    """Vocabulary size (rows of the embedding and of the LM head)."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks (dense ones first, then MoE ones)."""
    n_heads: int = 4
    """Attention (query) heads."""
    max_seq_len: int = 256
    """Longest sequence; rows of the RoPE cos/sin tables."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share one Parameter between the token embedding and the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every weight matrix."""

    attention: Literal["mla", "gqa"] = "mla"
    """"mla": multi-head latent attention (DeepSeek-V2/V3); "gqa": grouped-query attention."""
    n_kv_heads: int | None = None
    """GQA only: key/value heads (None = n_heads); head_dim = dim // n_heads."""
    q_lora_rank: int = 64
    """MLA: rank of the low-rank query projection (0 = one full-rank wq)."""
    kv_lora_rank: int = 32
    """MLA: rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 32
    """MLA: per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 16
    """MLA: per-head query dims with RoPE; the key RoPE part is one head shared by all."""
    v_head_dim: int = 32
    """MLA: per-head value dim."""

    ffn_dim: int = 384
    """Hidden width of the dense SwiGLU MLP of the first n_dense_layers layers."""
    n_dense_layers: int = 1
    """How many leading layers use a dense MLP instead of an MoE block."""
    moe_ffn_dim: int = 64
    """Hidden width of each routed (and each shared) expert."""
    n_routed_experts: int = 8
    """Routed experts per MoE layer."""
    n_shared_experts: int = 1
    """Shared experts (always on), fused into one SwiGLU of n_shared * moe_ffn_dim."""
    topk: int = 2
    """Routed experts per token."""
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    """Router score function."""
    n_groups: int = 1
    """Expert groups for group-limited routing (1 = no groups)."""
    topk_groups: int = 1
    """Groups a token may route into (<= n_groups)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen gate weights to sum to 1."""
    route_scale: float = 1.0
    """Factor on the gate weights."""
    aux_loss_coef: float = 0.0
    """Load-balancing aux loss coefficient, added to the returned loss (0 = off)."""
    capacity_factor: float | None = None
    """None: dropless dispatch; else per-expert capacity ceil(T*topk/E*factor), rest dropped."""
    expert_impl: Literal["loop", "grouped_mm"] = "loop"
    """Dropless expert compute: "loop" runs each expert on its slice in plain ATen (per-expert
    counts become unbacked SymInts when traced: ~0.1 s of tracing per expert per layer);
    "grouped_mm" runs all experts in three ``mxgraph::grouped_mm`` custom ops with an offsets
    tensor (static shapes, any dtype: traces 256 experts x 58 layers quickly)."""

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.attention not in ("mla", "gqa"):
            raise ValueError(f"attention must be 'mla' or 'gqa', got {self.attention!r}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.attention == "gqa" and (self.dim % self.n_heads or self.n_heads % self.n_kv_heads):
            raise ValueError("gqa needs dim % n_heads == 0 and n_heads % n_kv_heads == 0")
        if self.n_routed_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError("need n_routed_experts % n_groups == 0 and "
                             "1 <= topk_groups <= n_groups")
        if self.topk > self.topk_groups * self.n_routed_experts // self.n_groups:
            raise ValueError("topk exceeds the experts in topk_groups groups")
        if self.expert_impl not in ("loop", "grouped_mm"):
            raise ValueError(f"expert_impl must be 'loop' or 'grouped_mm', "
                             f"got {self.expert_impl!r}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError("n_dense_layers must be in [0, n_layers]")


class MLAttention(nn.Module):
    """Multi-head latent attention (naive form: the latent is expanded to per-head K/V)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_heads = H = cfg.n_heads
        self.nope, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        if cfg.q_lora_rank > 0:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, H * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        self.scale = qk_dim ** -0.5

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H = self.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if hasattr(self, "wq_a") else self.wq(x_BSD)
        q = q.view(B, S, H, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], -1)
        q_pe = apply_rope(q_pe, cos, sin)
        kv, k_pe = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], -1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)                     # [B, S, 1, rope]
        kv = self.wkv_b(self.kv_norm(kv)).view(B, S, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, S, H, self.rope_dim)], dim=-1)
        out = causal_attention(q, k, v, scale=self.scale)
        return self.wo(out.reshape(B, S, H * self.v_dim))


class Router(nn.Module):
    """Top-k router with group limiting and an aux-loss-free selection bias (a buffer)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (gate weights [T, k] fp32, expert ids [T, k], scores [T, E] fp32)."""
        cfg = self.cfg
        logits = F.linear(x_TD, self.weight).float()
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias
        if cfg.n_groups > 1:
            T = x_TD.shape[0]
            grouped = choice.view(T, cfg.n_groups, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_scores.topk(cfg.topk_groups, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, keep, True)
            choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(T, -1)
        expert_ids = choice.topk(cfg.topk, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.route_scale, expert_ids, scores


class Experts(nn.Module):
    """Routed SwiGLU experts, stacked: ``w_gate``/``w_up`` [E, F, D], ``w_down`` [E, D, F]."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.n_experts = n_experts
        self.w_gate = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def expert(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its rows (the per-expert loop of the dropless path)."""
        return F.linear(F.silu(F.linear(x_ND, self.w_gate[e])) * F.linear(x_ND, self.w_up[e]),
                        self.w_down[e])

    def batched(self, x_ECD: torch.Tensor) -> torch.Tensor:
        """All experts on a capacity-padded [E, C, D] buffer (batched GEMM)."""
        gate = torch.bmm(x_ECD, self.w_gate.transpose(1, 2))
        h = F.silu(gate) * torch.bmm(x_ECD, self.w_up.transpose(1, 2))
        return torch.bmm(h, self.w_down.transpose(1, 2))


def sort_by_expert(expert_ids_TK: torch.Tensor, num_experts: int):
    """Rows (token, choice) sorted by expert: the sort order, each row's token, and the
    number of rows per expert."""
    K = expert_ids_TK.shape[1]
    flat_ids = expert_ids_TK.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat_ids.device).scatter_add(
        0, flat_ids, torch.ones_like(flat_ids))
    return order, order // K, counts


def dispatch_dropless(x_TD: torch.Tensor, weights_TK: torch.Tensor, expert_ids_TK: torch.Tensor,
                      experts: Experts) -> torch.Tensor:
    """Sort assignments by expert, run each expert on its rows, weight, and sum back per token.

    Per-expert row counts are data-dependent; under tracing they become unbacked SymInts,
    bounded with ``torch._check`` so the graph is valid for every routing.
    """
    T, K = expert_ids_TK.shape
    E = experts.n_experts
    order, token_of_row, counts = sort_by_expert(expert_ids_TK, E)
    sizes = counts.tolist()
    for c in sizes:
        torch._check(c >= 0)
        torch._check(c <= T * K)
    torch._check(sum(sizes) == T * K)
    x_rows = x_TD[token_of_row]
    outs = [experts.expert(e, chunk) for e, chunk in enumerate(x_rows.split(sizes, dim=0))]
    y_rows = torch.cat(outs, dim=0)
    w_rows = weights_TK.reshape(-1)[order].to(y_rows.dtype)
    return torch.zeros_like(x_TD).index_add(0, token_of_row, y_rows * w_rows[:, None])


def dispatch_grouped_mm(x_TD: torch.Tensor, weights_TK: torch.Tensor,
                        expert_ids_TK: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Dropless like ``dispatch_dropless``, but the experts run as three ``grouped_mm`` ops over
    the sorted rows; per-expert counts live in the ``offs`` tensor, so every shape is static."""
    T, K = expert_ids_TK.shape
    E = experts.n_experts
    order, token_of_row, counts = sort_by_expert(expert_ids_TK, E)
    offs = counts.cumsum(0)
    x_rows = x_TD[token_of_row]
    h = (F.silu(grouped_mm(x_rows, experts.w_gate.transpose(1, 2), offs))
         * grouped_mm(x_rows, experts.w_up.transpose(1, 2), offs))
    y_rows = grouped_mm(h, experts.w_down.transpose(1, 2), offs)
    w_rows = weights_TK.reshape(-1)[order].to(y_rows.dtype)
    return torch.zeros_like(x_TD).index_add(0, token_of_row, y_rows * w_rows[:, None])


def dispatch_capacity(x_TD: torch.Tensor, weights_TK: torch.Tensor, expert_ids_TK: torch.Tensor,
                      experts: Experts, capacity_factor: float) -> torch.Tensor:
    """Fixed-shape dispatch: each expert takes at most C rows (earlier tokens first)."""
    T, K = expert_ids_TK.shape
    E = experts.n_experts
    C = max(1, math.ceil(T * K / E * capacity_factor))
    flat_ids = expert_ids_TK.reshape(-1)
    one_hot = F.one_hot(flat_ids, E)                                       # [T*K, E]
    position = (one_hot.cumsum(0) - 1).gather(1, flat_ids[:, None]).squeeze(1)
    kept = position < C
    trash = E * C                                                          # overflow row
    slot = torch.where(kept, flat_ids * C + position, torch.full_like(position, trash))
    token_of_row = torch.arange(T * K, device=x_TD.device) // K
    buf = x_TD.new_zeros(E * C + 1, x_TD.shape[1]).index_add(0, slot, x_TD[token_of_row])
    y = experts.batched(buf[:trash].view(E, C, -1)).reshape(E * C, -1)
    y = torch.cat([y, y.new_zeros(1, y.shape[1])], dim=0)[slot]           # dropped rows -> 0
    w_rows = (weights_TK.reshape(-1) * kept).to(y.dtype)
    return torch.zeros_like(x_TD).index_add(0, token_of_row, y * w_rows[:, None])


class MoEBlock(nn.Module):
    """Shared experts + routed experts; ``forward`` returns (output, aux loss)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared = (SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.moe_ffn_dim)
                       if cfg.n_shared_experts > 0 else None)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, D = x_BSD.shape
        x = x_BSD.reshape(B * S, D)
        weights, expert_ids, scores = self.router(x)
        if self.cfg.capacity_factor is not None:
            y = dispatch_capacity(x, weights, expert_ids, self.experts, self.cfg.capacity_factor)
        elif self.cfg.expert_impl == "grouped_mm":
            y = dispatch_grouped_mm(x, weights, expert_ids, self.experts)
        else:
            y = dispatch_dropless(x, weights, expert_ids, self.experts)
        if self.shared is not None:
            y = y + self.shared(x)
        aux = (self._aux_loss(scores, expert_ids) if self.cfg.aux_loss_coef > 0
               else scores.new_zeros(()))
        return y.view(B, S, D), aux

    def _aux_loss(self, scores_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """Switch-style balance loss ``coef * E * sum_e f_e * P_e`` over the batch's tokens.

        f_e = share of assignments that went to e (scaled so uniform routing gives 1),
        P_e = mean over tokens of the per-token-normalised score of e.
        """
        E, K = self.cfg.n_routed_experts, self.cfg.topk
        T = scores_TE.shape[0]
        counts = torch.zeros(E, device=scores_TE.device).scatter_add(
            0, expert_ids_TK.reshape(-1), torch.ones(T * K, device=scores_TE.device))
        frac = counts / (T * K)
        prob = (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0)
        return self.cfg.aux_loss_coef * E * (frac * prob).sum()

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing (outside forward): raise the bias of under-loaded experts,
        lower it for over-loaded ones, by ``rate`` each (sign of mean - count)."""
        counts = counts.to(self.router.expert_bias.device, torch.float32)
        self.router.expert_bias.add_(rate * torch.sign(counts.mean() - counts))


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = (MLAttention(cfg) if cfg.attention == "mla"
                     else GQAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads))
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = layer_id >= cfg.n_dense_layers
        self.mlp = MoEBlock(cfg) if self.is_moe else SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if not self.is_moe:
            return x + self.mlp(self.mlp_norm(x)), None
        y, aux = self.mlp(self.mlp_norm(x))
        return x + y, aux


class MoETransformer(nn.Module):
    """``forward(tokens[B, S], targets[B, S]) -> scalar`` mean cross-entropy (fp32) + aux loss."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        rope_dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.dim // cfg.n_heads
        self.rope = RotaryEmbedding(rope_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(MoELayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        init_normal_(self, cfg.init_std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1])
        x = self.embed(tokens)
        aux_total = None
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            if aux is not None and self.config.aux_loss_coef > 0:
                aux_total = aux if aux_total is None else aux_total + aux
        loss = lm_loss(self.lm_head(self.norm(x)), targets)
        return loss if aux_total is None else loss + aux_total

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    @torch.no_grad()
    def expert_counts(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Assignments per routed expert ([E] long) for each MoE block, from an eager pass."""
        counts: list[torch.Tensor] = []

        def record(router, args, out):
            counts.append(torch.bincount(out[1].reshape(-1), minlength=router.cfg.n_routed_experts))

        handles = [block.router.register_forward_hook(record) for block in self.moe_blocks()]
        try:
            self(tokens, tokens)
        finally:
            for h in handles:
                h.remove()
        return counts

    @torch.no_grad()
    def update_expert_bias(self, counts: list[torch.Tensor], rate: float) -> None:
        """Aux-loss-free balancing step for every MoE block (call between training steps)."""
        for block, c in zip(self.moe_blocks(), counts, strict=True):
            block.update_expert_bias(c, rate)
