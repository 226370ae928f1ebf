"""Fused kernels as ``torch.library`` custom ops (namespace ``mxgraph``).

Importing this package registers every op. ``KERNELS`` maps an op name (forward and fused
backward alike, e.g. ``"swiglu"`` and ``"swiglu_backward"``) to a :class:`Kernel`: the op
overload, its plain-torch reference and its Triton implementation. The op itself runs the
Triton implementation on ``cuda`` tensors (MXMACA included) and the reference elsewhere.

The references compute, in fp32, what eager torch computes for the pattern's textbook form:
a forward reference makes the same ATen calls as that form (``F.silu(a) * b``, ``F.gelu(x +
bias)``, ``F.scaled_dot_product_attention`` on repeated K/V, ``log_softmax`` + ``nll_loss``...)
and a backward reference makes the calls eager autograd makes for it (``aten.silu_backward``,
``aten._softmax_backward_data``, the rsqrt/mean/pow chain of RMSNorm...), summing in the same
order. So on the CPU, fusing a model written in those forms changes no bit of its loss, its
gradients or its training (``tests/test_fuse.py``); a model written another way differs by
rounding only. The Triton kernels match the references within the tolerances their tests state.

Each forward op has a fake implementation and an autograd formula whose backward is the
fused ``*_backward`` op (itself with reference, Triton and fake implementations):

=====================================  ============================================================
module                                 ops (``torch.ops.mxgraph.*``)
=====================================  ============================================================
``swiglu``                             swiglu(a, b); bias_swiglu(a, b, bias_a, bias_b)
``bias_gelu``                          bias_gelu(x, bias, approximate="none"|"tanh")
``bias_dropout_add``                   bias_dropout_add(x, bias?, residual, p, training, seed, offset)
``rope``                               rope(q, k, cos, sin, interleaved) -> (q, k)
``gqa``                                gqa_attention(q, k, v, causal, scale) -> (out, lse)
``rmsnorm``                            rmsnorm(x, w, eps) -> (y, rstd);
                                       add_rmsnorm(x, residual, w, eps) -> (y, new_residual, rstd)
``linear_cross_entropy``               linear_cross_entropy(x, weight, targets, chunk_size,
                                       ignore_index) -> (loss, lse)
``moe_permute``                        moe_permute(x, topk_ids, E) -> (rows, row_map, counts);
                                       moe_permute_capacity(x, topk_ids, E, C) -> (rows[E,C,D], slot_map,
                                       counts); moe_unpermute(rows, row_map, probs)
``moe_router``                         moe_router(logits, bias?, topk, score_func, num_groups,
                                       topk_groups, normalize, route_scale) -> (probs, ids, counts)
=====================================  ============================================================

Module docstrings give the exact semantics. Tests run the Triton paths on CPU tensors in
Triton's interpreter (``TRITON_INTERPRET=1``); ``MXGRAPH_KERNEL_POISON=1`` fills outputs with
NaN first so unwritten elements show.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernel:
    op: torch._ops.OpOverload
    """``torch.ops.mxgraph.<name>.default``."""
    reference: Callable
    """Plain torch; the CPU path and the test oracle."""
    triton: Callable
    """Triton launch; runs on CPU tensors under the Triton interpreter in tests."""


from mxgraph.codegen.kernels import (  # noqa: E402
    bias_dropout_add, bias_gelu, gqa, linear_cross_entropy, moe_permute, moe_router, rmsnorm, rope, swiglu)

KERNELS: dict[str, Kernel] = {}


def _register(name: str, reference: Callable, triton: Callable) -> None:
    KERNELS[name] = Kernel(op=getattr(torch.ops.mxgraph, name).default, reference=reference, triton=triton)


_register("swiglu", swiglu.swiglu_reference, swiglu.swiglu_triton)
_register("swiglu_backward", swiglu.swiglu_backward_reference, swiglu.swiglu_backward_triton)
_register("bias_swiglu", swiglu.swiglu_reference, swiglu.swiglu_triton)
_register("bias_swiglu_backward", swiglu.swiglu_backward_reference, swiglu.swiglu_backward_triton)
_register("bias_gelu", bias_gelu.bias_gelu_reference, bias_gelu.bias_gelu_triton)
_register("bias_gelu_backward", bias_gelu.bias_gelu_backward_reference, bias_gelu.bias_gelu_backward_triton)
_register("bias_dropout_add", bias_dropout_add.bias_dropout_add_reference, bias_dropout_add.bias_dropout_add_triton)
_register("bias_dropout_add_backward", bias_dropout_add.bias_dropout_add_backward_reference,
          bias_dropout_add.bias_dropout_add_backward_triton)
_register("rmsnorm", rmsnorm.rmsnorm_reference, rmsnorm.rmsnorm_triton)
_register("add_rmsnorm", rmsnorm.add_rmsnorm_reference, rmsnorm.add_rmsnorm_triton)
_register("rmsnorm_backward", rmsnorm.rmsnorm_backward_reference, rmsnorm.rmsnorm_backward_triton)
_register("rope", rope.rope_reference, rope.rope_triton)
_register("rope_backward", rope.rope_backward_reference, rope.rope_backward_triton)
_register("gqa_attention", gqa.gqa_attention_reference, gqa.gqa_attention_triton)
_register("gqa_attention_backward", gqa.gqa_attention_backward_reference, gqa.gqa_attention_backward_triton)
_register("linear_cross_entropy", linear_cross_entropy.linear_cross_entropy_reference,
          linear_cross_entropy.linear_cross_entropy_triton)
_register("linear_cross_entropy_backward", linear_cross_entropy.linear_cross_entropy_backward_reference,
          linear_cross_entropy.linear_cross_entropy_backward_triton)
_register("moe_permute", moe_permute.moe_permute_reference, moe_permute.moe_permute_triton)
_register("moe_permute_capacity", moe_permute.moe_permute_capacity_reference, moe_permute.moe_permute_capacity_triton)
_register("moe_permute_backward", moe_permute.moe_permute_backward_reference, moe_permute.moe_permute_backward_triton)
_register("moe_unpermute", moe_permute.moe_unpermute_reference, moe_permute.moe_unpermute_triton)
_register("moe_unpermute_backward", moe_permute.moe_unpermute_backward_reference,
          moe_permute.moe_unpermute_backward_triton)
_register("moe_router", moe_router.moe_router_reference, moe_router.moe_router_triton)
_register("moe_router_backward", moe_router.moe_router_backward_reference, moe_router.moe_router_backward_triton)
