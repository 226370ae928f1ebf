"""Fused linear + cross-entropy: the mean token loss without materialising ``[N, V]`` logits.

Ops:
  mxgraph::linear_cross_entropy(x, weight, targets, chunk_size, ignore_index) -> (loss, lse)
  mxgraph::linear_cross_entropy_backward(grad_loss, x, weight, targets, lse, chunk_size, ignore_index)
      -> (grad_x, grad_weight)

``x`` is ``[N, D]``, ``weight`` ``[V, D]`` (the LM head), ``targets`` ``[N]`` (int). ``loss`` is
the fp32 mean of ``logsumexp(logits_i) - logits_i[target_i]`` over tokens whose target is not
``ignore_index`` (NaN when every token is ignored, as ``F.cross_entropy``); ``lse`` (fp32,
``[N]``) is saved for the backward. Tokens are processed ``chunk_size`` at a time, so at most
``[chunk_size, V]`` logits exist at once; the backward recomputes each chunk's logits.

Triton path: each chunk's logits come from one GEMM (``x``'s dtype, fp32 accumulation inside
the GEMM); a Triton kernel then reduces each row to its log-sum-exp and target logit
(forward), or overwrites the logits in place with ``(softmax - onehot) * grad / n_valid``
(backward), which two more GEMMs turn into ``grad_x`` and the fp32-accumulated ``grad_weight``.
The reference does the same chunking in fp32 torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common


def _check(x: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or targets.shape != x.shape[:1]:
        raise ValueError(f"linear_cross_entropy: want x [N, D], weight [V, D], targets [N], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_size must be positive, got {chunk_size}")


_MEAN = 1  # ATen's reduction code for "mean"


def _chunks(n: int, chunk_size: int):
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


# --------------------------------------------------------------------------- reference
def linear_cross_entropy_reference(x: Tensor, weight: Tensor, targets: Tensor, chunk_size: int,
                                   ignore_index: int = -100):
    _check(x, weight, targets, chunk_size)
    w32 = weight.float()
    lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for s, e in _chunks(x.shape[0], chunk_size):
        logits = x[s:e].float() @ w32.T
        lse[s:e] = torch.logsumexp(logits, dim=-1)
        logp = F.log_softmax(logits, dim=-1)
        total = total + F.nll_loss(logp, targets[s:e], ignore_index=ignore_index, reduction="sum")
    return total / (targets != ignore_index).sum(), lse


def linear_cross_entropy_backward_reference(grad_loss: Tensor, x: Tensor, weight: Tensor, targets: Tensor,
                                            lse: Tensor, chunk_size: int, ignore_index: int = -100):
    """Per chunk, the ATen calls eager autograd makes for ``F.cross_entropy(x @ weight.T, targets)``
    (see the package docstring); with one chunk, the same result bit for bit."""
    _check(x, weight, targets, chunk_size)
    w32 = weight.float()
    grad = grad_loss.float()
    n_valid = (targets != ignore_index).sum().float()
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    for s, e in _chunks(x.shape[0], chunk_size):
        x32 = x[s:e].float()
        logp = F.log_softmax(x32 @ w32.T, dim=-1)
        grad_logp = torch.ops.aten.nll_loss_backward(grad, logp, targets[s:e], None, _MEAN, ignore_index, n_valid)
        dlogits = torch.ops.aten._log_softmax_backward_data(grad_logp, logp, 1, torch.float32)
        dx[s:e] = dlogits @ w32
        dw += dlogits.T @ x32
    return dx.to(x.dtype), dw.to(weight.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _ce_fwd_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, V, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    cols = tl.arange(0, BLOCK_V)
    # per-lane running max and sum; the finite start keeps padded lanes free of inf - inf
    m = tl.full([BLOCK_V], -1e30, dtype=tl.float32)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        lg = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, lg)
        acc = acc * tl.exp(m - m_new) + tl.exp(lg - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(acc * tl.exp(m - m_row), axis=0))
    t = tl.load(targets_ptr + row)
    valid = t != ignore_index
    picked = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(logits_ptr, dlogits_ptr, targets_ptr, lse_ptr, scale_ptr, V, ignore_index,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(targets_ptr + row)
    valid = t != ignore_index
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr)
    scale = tl.where(valid, scale, 0.0)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        lg = tl.load(logits_ptr + row * V + c, mask=c < V, other=0.0).to(tl.float32)
        d = (tl.exp(lg - lse) - tl.where(c == t, 1.0, 0.0)) * scale
        tl.store(dlogits_ptr + row * V + c, d.to(dlogits_ptr.dtype.element_ty), mask=c < V)


def _block_v(device, v):
    return _common.block_for(v, hi=4096 if device.type == "cuda" else 256)


def linear_cross_entropy_triton(x: Tensor, weight: Tensor, targets: Tensor, chunk_size: int,
                                ignore_index: int = -100):
    _check(x, weight, targets, chunk_size)
    x, weight, targets = x.contiguous(), weight.contiguous(), targets.contiguous()
    n, v = x.shape[0], weight.shape[0]
    loss_rows = _common.new_output((n,), dtype=torch.float32, device=x.device)
    lse = _common.new_output((n,), dtype=torch.float32, device=x.device)
    kernel = _common.on(_ce_fwd_kernel, x.device)
    block_v = _block_v(x.device, v)
    for s, e in _chunks(n, chunk_size):
        logits = x[s:e] @ weight.T
        kernel[(e - s,)](logits, targets[s:e], loss_rows[s:], lse[s:], v, ignore_index, BLOCK_V=block_v,
                         num_warps=_common.num_warps_for(block_v))
    return loss_rows.sum() / (targets != ignore_index).sum(), lse


def linear_cross_entropy_backward_triton(grad_loss: Tensor, x: Tensor, weight: Tensor, targets: Tensor,
                                         lse: Tensor, chunk_size: int, ignore_index: int = -100):
    _check(x, weight, targets, chunk_size)
    x, weight, targets, lse = x.contiguous(), weight.contiguous(), targets.contiguous(), lse.contiguous()
    n, v = x.shape[0], weight.shape[0]
    scale = (grad_loss.float() / (targets != ignore_index).sum()).reshape(1)
    dx = _common.new_output_like(x)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    dw_chunk = torch.empty_like(weight)  # one GEMM output buffer, reused by every chunk
    kernel = _common.on(_ce_bwd_kernel, x.device)
    block_v = _block_v(x.device, v)
    for s, e in _chunks(n, chunk_size):
        logits = x[s:e] @ weight.T
        # in place unless debugging: a poisoned buffer catches elements the kernel skips
        dlogits = _common.new_output_like(logits) if _common.poison_enabled() else logits
        kernel[(e - s,)](logits, dlogits, targets[s:e], lse[s:], scale, v, ignore_index, BLOCK_V=block_v,
                         num_warps=_common.num_warps_for(block_v))
        torch.mm(dlogits, weight, out=dx[s:e])
        torch.mm(dlogits.T, x[s:e], out=dw_chunk)
        dw += dw_chunk
    return dx, dw.to(weight.dtype)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("mxgraph::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, chunk_size: int,
                         ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """``F.cross_entropy(x @ weight.T, targets, ignore_index=...)`` in chunks; returns ``(loss, lse)``."""
    impl = linear_cross_entropy_triton if _common.use_triton(x) else linear_cross_entropy_reference
    return _common.contiguous_outputs(impl(x, weight, targets, chunk_size, ignore_index))


@linear_cross_entropy.register_fake
def _(x, weight, targets, chunk_size, ignore_index=-100):
    _check(x, weight, targets, chunk_size)
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.custom_op("mxgraph::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: Tensor, x: Tensor, weight: Tensor, targets: Tensor, lse: Tensor,
                                  chunk_size: int, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    impl = linear_cross_entropy_backward_triton if _common.use_triton(x) else linear_cross_entropy_backward_reference
    return _common.contiguous_outputs(impl(grad_loss, x, weight, targets, lse, chunk_size, ignore_index))


@linear_cross_entropy_backward.register_fake
def _(grad_loss, x, weight, targets, lse, chunk_size, ignore_index=-100):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, targets, chunk_size, ignore_index = inputs
    _, lse = output
    ctx.save_for_backward(x, weight, targets, lse)
    ctx.mark_non_differentiable(lse)
    ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index


def _bwd(ctx, grad_loss, _grad_lse):
    x, weight, targets, lse = ctx.saved_tensors
    dx, dw = torch.ops.mxgraph.linear_cross_entropy_backward(grad_loss, x, weight, targets, lse, ctx.chunk_size,
                                                             ctx.ignore_index)
    return dx, dw, None, None, None


linear_cross_entropy.register_autograd(_bwd, setup_context=_setup)
