"""Grouped-query attention without repeating K/V ("Repeat-GQA" fused away), flash-style.

Ops:
  mxgraph::gqa_attention(q, k, v, causal, scale) -> (out, lse)
  mxgraph::gqa_attention_backward(grad_out, grad_lse?, q, k, v, out, lse, causal, scale)
      -> (grad_q, grad_k, grad_v)

``q`` is ``[B, Hq, Sq, D]``, ``k``/``v`` are ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0``; query
head ``h`` reads kv head ``h // (Hq // Hkv)``. ``out`` is ``[B, Hq, Sq, D]`` in ``q``'s dtype,
``lse`` the fp32 log-sum-exp of the scaled scores ``[B, Hq, Sq]`` (saved for the backward;
its gradient is honoured too). ``causal`` masks key ``j > i`` (top-left aligned, as
``F.scaled_dot_product_attention(is_causal=True)``).

Triton: a flash-attention forward (online softmax, one program per query block and head),
and a flash backward in two kernels with no atomics: one program per key block and kv head
accumulates dK/dV over every query head of its group and every query block; one program per
query block and head accumulates dQ. ``delta = rowsum(dO * O) - grad_lse`` is computed in
torch first. The reference on the CPU runs eager SDPA's own kernels on K/V repeated to every
query head (bitwise what the unfused model computes); with a gradient for ``lse`` (context
parallelism merges partial attentions through it) or off the CPU it writes the softmax out
over a broadcast group axis, K/V never repeated.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common


def _check(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"gqa_attention: want q [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or hkv == 0 or hq % hkv:
        raise ValueError(f"gqa_attention: q heads ({hq}) must be a multiple of kv heads ({hkv}) with equal "
                         f"batch and head_dim: q {tuple(q.shape)}, k {tuple(k.shape)}")
    return b, hq, hkv, sq, sk, d


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# --------------------------------------------------------------------------- reference
def _scores(q, k, causal, scale):
    b, hq, hkv, sq, sk, d = _check(q, k, k)
    qg = q.float().view(b, hkv, hq // hkv, sq, d)
    s = qg @ k.float()[:, :, None].transpose(-1, -2) * scale  # [B, Hkv, G, Sq, Sk]
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return qg, s


def _repeated(t: Tensor, hq: int) -> Tensor:
    b, hkv, sk, d = t.shape
    return t.float()[:, :, None].expand(b, hkv, hq // hkv, sk, d).reshape(b, hq, sk, d)


def _eager_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """What ``F.scaled_dot_product_attention`` runs on the CPU for K/V repeated to every query head."""
    hq = q.shape[1]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float(), _repeated(k, hq), _repeated(v, hq), 0.0, causal, attn_mask=None, scale=scale)


def gqa_attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """On the CPU, eager SDPA's own kernel on repeated K/V (see the package docstring); elsewhere a softmax
    over a broadcast group axis, K/V never repeated."""
    b, hq, hkv, sq, sk, d = _check(q, k, v)
    if q.device.type == "cpu":
        out, lse = _eager_attention(q, k, v, causal, scale)
        return out.to(q.dtype), lse
    _, s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse[..., None]) @ v.float()[:, :, None]
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def gqa_attention_backward_reference(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                                     out: Tensor, lse: Tensor, causal: bool, scale: float):
    """On the CPU without a gradient for ``lse``, eager SDPA's backward kernel on repeated K/V,
    summed over each group; otherwise the softmax Jacobian written out."""
    b, hq, hkv, sq, sk, d = _check(q, k, v)
    g = hq // hkv
    if q.device.type == "cpu" and grad_lse is None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.float(), q.float(), _repeated(k, hq), _repeated(v, hq), out.float(), lse, 0.0, causal,
            attn_mask=None, scale=scale)
        group_sum = lambda t: t.reshape(b, hkv, g, sk, d).sum(2)  # noqa: E731
        return dq.to(q.dtype), group_sum(dk).to(k.dtype), group_sum(dv).to(v.dtype)
    qg, s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.view(b, hkv, g, sq)[..., None])
    do = grad_out.float().view(b, hkv, g, sq, d)
    delta = (do * out.float().view(b, hkv, g, sq, d)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float().view(b, hkv, g, sq)
    dv = (p.transpose(-1, -2) @ do).sum(2)
    dp = do @ v.float()[:, :, None].transpose(-1, -2)
    ds = p * (dp - delta[..., None])
    dq = (ds @ k.float()[:, :, None]) * scale
    dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, Hq, Hkv, Sq, Sk, D, scale, CAUSAL: tl.constexpr,
                PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    hk = (bh % Hq) // (Hq // Hkv)
    q_base = bh.to(tl.int64) * Sq * D
    kv_base = (b * Hkv + hk).to(tl.int64) * Sk * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qmask = (offs_m < Sq)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + q_base + offs_m[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        kvmask = (n < Sk)[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_base + n[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        valid = (n < Sk)[None, :] & (offs_m >= 0)[:, None]
        if CAUSAL:
            valid = valid & (n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_base + n[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_base + offs_m[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=qmask)
    tl.store(lse_ptr + bh.to(tl.int64) * Sq + offs_m, m_i + tl.log(l_i), mask=offs_m < Sq)


@triton.jit
def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, Hq, Hkv, Sq, Sk, D, scale,
                     CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    group = Hq // Hkv
    kv_base = bhk.to(tl.int64) * Sk * D
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kvmask = (offs_n < Sk)[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv_base + offs_n[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
    v = tl.load(v_ptr + kv_base + offs_n[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        bh = b * Hq + hk * group + g
        q_base = bh.to(tl.int64) * Sq * D
        row_base = bh.to(tl.int64) * Sq
        for start_m in range(lo, Sq, BLOCK_M):
            m = start_m + offs_m
            qmask = (m < Sq)[:, None] & dmask[None, :]
            q = tl.load(q_ptr + q_base + m[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
            do = tl.load(do_ptr + q_base + m[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
            lse = tl.load(lse_ptr + row_base + m, mask=m < Sq, other=0.0)
            delta = tl.load(delta_ptr + row_base + m, mask=m < Sq, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            valid = (m < Sq)[:, None] & (offs_n < Sk)[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= m[:, None])
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    tl.store(dk_ptr + kv_base + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
             mask=kvmask)
    tl.store(dv_ptr + kv_base + offs_n[:, None] * D + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kvmask)


@triton.jit
def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, Hq, Hkv, Sq, Sk, D, scale,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    hk = (bh % Hq) // (Hq // Hkv)
    q_base = bh.to(tl.int64) * Sq * D
    kv_base = (b * Hkv + hk).to(tl.int64) * Sk * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qmask = (offs_m < Sq)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + q_base + offs_m[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
    do = tl.load(do_ptr + q_base + offs_m[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        kvmask = (n < Sk)[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_base + n[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_ptr + kv_base + n[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        valid = (offs_m < Sq)[:, None] & (n < Sk)[None, :]
        if CAUSAL:
            valid = valid & (n[None, :] <= offs_m[:, None])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + q_base + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=qmask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (a GPU would use TF32 otherwise); 16-bit inputs ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def _blocks(device: torch.device, d: int):
    # The interpreter runs one program at a time: small blocks keep CPU tests quick.
    bm = 64 if device.type == "cuda" else 16
    return bm, bm, _common.block_for(d)


def gqa_attention_triton(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    b, hq, hkv, sq, sk, d = _check(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = _common.new_output_like(q)
    lse = _common.new_output((b, hq, sq), dtype=torch.float32, device=q.device)
    bm, bn, bd = _blocks(q.device, d)
    if b * hq * sq:
        _common.on(_fwd_kernel, q.device)[(triton.cdiv(sq, bm), b * hq)](
            q, k, v, out, lse, hq, hkv, sq, sk, d, scale, CAUSAL=causal, PRECISION=_precision(q.dtype), BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_D=bd)
    return out, lse


def gqa_attention_backward_triton(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                                  out: Tensor, lse: Tensor, causal: bool, scale: float):
    b, hq, hkv, sq, sk, d = _check(q, k, v)
    q, k, v, do, lse = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous(), lse.contiguous()
    delta = (do.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    delta = delta.contiguous()
    dq, dk, dv = _common.new_output_like(q), _common.new_output_like(k), _common.new_output_like(v)
    bm, bn, bd = _blocks(q.device, d)
    # two [BLOCK_N, D] fp32 accumulators (dK, dV) per program: 8 warps keep them in registers
    args = dict(CAUSAL=causal, PRECISION=_precision(q.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=8)
    if b * hkv * sk:
        _common.on(_bwd_dkdv_kernel, q.device)[(triton.cdiv(sk, bn), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, hq, hkv, sq, sk, d, scale, **args)
    if b * hq * sq:
        _common.on(_bwd_dq_kernel, q.device)[(triton.cdiv(sq, bm), b * hq)](
            q, k, v, do, lse, delta, dq, hq, hkv, sq, sk, d, scale, **args)
    return dq, dk, dv


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::gqa_attention", mutates_args=())
def gqa_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` heads over fewer ``k``/``v`` heads; returns ``(out, lse)``."""
    impl = gqa_attention_triton if _common.use_triton(q) else gqa_attention_reference
    return _common.contiguous_outputs(impl(q, k, v, causal, scale))


@gqa_attention.register_fake
def _(q, k, v, causal, scale):
    b, hq, _, sq, _, _ = _check(q, k, v)
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("mxgraph::gqa_attention_backward", mutates_args=())
def gqa_attention_backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                           lse: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    impl = gqa_attention_backward_triton if _common.use_triton(q) else gqa_attention_backward_reference
    return _common.contiguous_outputs(impl(grad_out, grad_lse, q, k, v, out, lse, causal, scale))


@gqa_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # an unused lse gets None, not zeros: the cheaper backward


def _bwd(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.mxgraph.gqa_attention_backward(grad_out, grad_lse, q, k, v, out, lse, ctx.causal,
                                                          ctx.scale)
    return dq, dk, dv, None, None


gqa_attention.register_autograd(_bwd, setup_context=_setup)
