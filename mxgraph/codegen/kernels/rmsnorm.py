"""RMSNorm and residual-add + RMSNorm, fused, with a fused backward.

Ops:
  mxgraph::rmsnorm(x, weight, eps) -> (y, rstd)
  mxgraph::add_rmsnorm(x, residual, weight, eps) -> (y, new_residual, rstd)
  mxgraph::rmsnorm_backward(grad_y, h, weight, rstd, grad_residual?) -> (grad_h, grad_weight)

``x`` is ``[..., N]``, ``weight`` ``[N]``; ``rstd`` (fp32, ``x.shape[:-1]``) is saved for the
backward and has no gradient. ``y = h * rsqrt(mean(h^2) + eps) * weight`` computed in fp32 and
rounded once to ``x``'s dtype, where ``h = x`` (rmsnorm) or ``h = x + residual`` rounded to
``residual``'s dtype (add_rmsnorm; ``new_residual`` is that ``h``). In the backward,
``grad_residual`` (the gradient arriving at ``new_residual``) is added to ``grad_h``, which
is then the gradient of both ``x`` and ``residual``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxgraph.codegen.kernels import _common


# --------------------------------------------------------------------------- reference
def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float):
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
    return (h * rstd[..., None] * weight.float()).to(x.dtype), rstd


def add_rmsnorm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    h = (x.float() + residual.float()).to(residual.dtype)
    y, rstd = rmsnorm_reference(h, weight, eps)
    return y.to(x.dtype), h, rstd


def rmsnorm_backward_reference(grad_y: Tensor, h: Tensor, weight: Tensor, rstd: Tensor,
                               grad_residual: Tensor | None = None):
    """The ATen calls eager autograd makes for ``h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    * weight`` (see the package docstring), the residual's gradient arriving first."""
    h32, g, r = h.float(), grad_y.float(), rstd[..., None]
    grad_t = g * weight.float()
    dw = (g * (h32 * r)).reshape(-1, h.shape[-1]).sum(0)
    direct = grad_t * r
    grad_rstd = (grad_t * h32).sum(-1, keepdim=True)
    grad_mean = (-0.5 * grad_rstd * r.pow(3)).expand(h.shape) / h.shape[-1]
    if grad_residual is not None:
        direct = grad_residual.float() + direct
    dh = direct + grad_mean * (2.0 * h32)
    return dh.to(h.dtype), dw.to(weight.dtype)


# --------------------------------------------------------------------------- triton
@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, N, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * N + cols, h, mask=mask)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (h * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rmsnorm_bwd_kernel(g_ptr, h_ptr, w_ptr, rstd_ptr, gres_ptr, dh_ptr, dw_partial_ptr, M, N, rows_per_prog,
                        HAS_GRES: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    for i in range(0, rows_per_prog):
        row = start + i
        rmask = mask & ((cols * 0 + row) < M)  # broadcast first: the interpreter rejects a scalar mask term
        base = row * N
        g = tl.load(g_ptr + base + cols, mask=rmask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + base + cols, mask=rmask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, M - 1))  # rows past M are fully masked
        hhat = h * rstd
        wg = g * w
        dh = rstd * (wg - hhat * (tl.sum(wg * hhat, axis=0) / N))
        if HAS_GRES:
            dh += tl.load(gres_ptr + base + cols, mask=rmask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + base + cols, dh.to(dh_ptr.dtype.element_ty), mask=rmask)
        dw += g * hhat
    tl.store(dw_partial_ptr + pid.to(tl.int64) * N + cols, dw, mask=mask)


def _num_programs(device: torch.device, rows: int) -> int:
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


def _fwd(x, residual, weight, eps):
    x = x.contiguous()
    n = x.shape[-1]
    m = x.numel() // max(n, 1)
    y = _common.new_output_like(x)
    h = _common.new_output_like(residual) if residual is not None else x
    rstd = _common.new_output(x.shape[:-1], dtype=torch.float32, device=x.device)
    if m:
        _common.on(_rmsnorm_fwd_kernel, x.device)[(m,)](
            x, residual.contiguous() if residual is not None else x, weight.contiguous(), y, h, rstd, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=_common.block_for(n),
            num_warps=_common.num_warps_for(_common.block_for(n)))
    return y, h, rstd


def rmsnorm_triton(x: Tensor, weight: Tensor, eps: float):
    y, _, rstd = _fwd(x, None, weight, eps)
    return y, rstd


def add_rmsnorm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    return _fwd(x, residual, weight, eps)


def rmsnorm_backward_triton(grad_y: Tensor, h: Tensor, weight: Tensor, rstd: Tensor,
                            grad_residual: Tensor | None = None):
    grad_y, h, rstd = grad_y.contiguous(), h.contiguous(), rstd.contiguous()
    n = h.shape[-1]
    m = h.numel() // max(n, 1)
    dh = _common.new_output_like(h)
    progs = _num_programs(h.device, m)
    partial = _common.new_output((progs, n), dtype=torch.float32, device=h.device)
    _common.on(_rmsnorm_bwd_kernel, h.device)[(progs,)](
        grad_y, h, weight.contiguous(), rstd, grad_residual.contiguous() if grad_residual is not None else h,
        dh, partial, m, n, triton.cdiv(m, progs), HAS_GRES=grad_residual is not None,
        BLOCK_N=_common.block_for(n), num_warps=_common.num_warps_for(_common.block_for(n)))
    return dh, partial.sum(0).to(weight.dtype)


# --------------------------------------------------------------------------- custom ops
def _use(x):
    return _common.use_triton(x)


@torch.library.custom_op("mxgraph::rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns ``(y, rstd)``."""
    return _common.contiguous_outputs((rmsnorm_triton if _use(x) else rmsnorm_reference)(x, weight, eps))


@rmsnorm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("mxgraph::add_rmsnorm", mutates_args=())
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(y, new_residual, rstd)`` with ``new_residual = x + residual``."""
    fn = add_rmsnorm_triton if _use(x) else add_rmsnorm_reference
    return _common.contiguous_outputs(fn(x, residual, weight, eps))


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return (x.new_empty(x.shape), residual.new_empty(residual.shape),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("mxgraph::rmsnorm_backward", mutates_args=())
def rmsnorm_backward(grad_y: Tensor, h: Tensor, weight: Tensor, rstd: Tensor,
                     grad_residual: Tensor | None) -> tuple[Tensor, Tensor]:
    impl = rmsnorm_backward_triton if _use(h) else rmsnorm_backward_reference
    return _common.contiguous_outputs(impl(grad_y, h, weight, rstd, grad_residual))


@rmsnorm_backward.register_fake
def _(grad_y, h, weight, rstd, grad_residual):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _rmsnorm_bwd(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mxgraph.rmsnorm_backward(grad_y, x, weight, rstd, None)
    return dx, dw, None


rmsnorm.register_autograd(_rmsnorm_bwd, setup_context=_rmsnorm_setup)


def _add_rmsnorm_setup(ctx, inputs, output):
    x, _, weight, _ = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.x_dtype = x.dtype
    ctx.set_materialize_grads(False)  # an unused new_residual (the final norm's) gets None, not zeros


def _add_rmsnorm_bwd(ctx, grad_y, grad_h, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(h)
    dh, dw = torch.ops.mxgraph.rmsnorm_backward(grad_y, h, weight, rstd, grad_h)
    return dh.to(ctx.x_dtype), dh, dw, None


add_rmsnorm.register_autograd(_add_rmsnorm_bwd, setup_context=_add_rmsnorm_setup)
