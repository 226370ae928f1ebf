"""Grouped matrix multiply over rows sorted by group (dropless MoE experts).

Ops (forward / weight gradient):
  mxgraph::grouped_mm(x, w, offs) -> out
  mxgraph::grouped_mm_wgrad(x, grad_out, offs) -> grad_w

Rows of ``x`` [N, I] are sorted by group; group g owns rows ``offs[g-1]:offs[g]`` (``offs``
[G], cumulative ends) and multiplies them by ``w[g]`` [I, O]. Rows past ``offs[-1]`` give 0.
The backward of ``grouped_mm`` is ``grouped_mm(grad_out, w.transpose(1, 2), offs)`` for the
input and ``grouped_mm_wgrad`` for the weights. Reference implementations only (a loop of
matmuls, the CPU path and the oracle), with the contract of ``torch._grouped_mm`` with
``offs``, which a codegen pass may substitute where it is supported (bf16 on CUDA). The
expert-parallel pass (``passes/sharding/ep.py``) and the remat regions (kind "matmul") key on
these ops.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("mxgraph::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]`` for each group g (see the module docstring)."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("mxgraph::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: torch.Tensor, grad_out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Weight gradient of ``grouped_mm``: [G, I, O] with ``x_g.T @ grad_out_g`` per group."""
    grad_w = x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            grad_w[g] = x[start:end].T @ grad_out[start:end]
        start = end
    return grad_w


@grouped_mm_wgrad.register_fake
def _grouped_mm_wgrad_fake(x, grad_out, offs):
    return x.new_empty(offs.shape[0], x.shape[1], grad_out.shape[1])


def _grouped_mm_setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _grouped_mm_backward(ctx, grad_out):
    x, w, offs = ctx.saved_tensors
    grad_x = grouped_mm(grad_out, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_wgrad(x, grad_out, offs) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)
