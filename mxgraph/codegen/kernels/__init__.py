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
gradients or its training (``tests/passes/test_fuse.py``); a model written another way differs by
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
``grouped_mm``                         grouped_mm(x, w, offs); grouped_mm_wgrad(x, grad_out, offs)
                                       (reference only, not in ``KERNELS``: no Triton path)
=====================================  ============================================================

Each op has a *kind* (``mxgraph.ir.FUSED_KINDS``: norm, act, attn, rope, matmul, moe, residual,
loss), recorded in ``Kernel.kind`` and, as each op registers, in ``mxgraph.ir``'s table, so
rules that group nodes by role (the remat regions) ask ``ir.fused_kind(node)`` instead of
reading op names. The table lives in ``ir`` (the lowest layer, which imports no codegen);
an op is in a graph only once its module is imported, and importing it fills the table.

Module docstrings give the exact semantics. Tests run the Triton paths on CPU tensors in
Triton's interpreter (``TRITON_INTERPRET=1``); ``MXGRAPH_KERNEL_POISON=1`` fills outputs with
NaN first so unwritten elements show.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from mxgraph.ir import register_fused_kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernel:
    op: torch._ops.OpOverload
    """``torch.ops.mxgraph.<name>.default``."""
    reference: Callable
    """Plain torch; the CPU path and the test oracle."""
    triton: Callable
    """Triton launch; runs on CPU tensors under the Triton interpreter in tests."""
    kind: str
    """What the op computes (``mxgraph.ir.FUSED_KINDS``); a backward op has its forward's."""


from mxgraph.codegen.kernels import (  # noqa: E402
    bias_dropout_add,
    bias_gelu,
    gqa,
    grouped_mm,  # noqa: E402, F401 - registers mxgraph::grouped_mm*
    linear_cross_entropy,
    moe_permute,
    moe_router,
    rmsnorm,
    rope,
    swiglu,
)

KERNELS: dict[str, Kernel] = {}


_TABLE = [  # (op name, kind, module, implementation: <impl>_reference / <impl>_triton)
    ("swiglu", "act", swiglu, "swiglu"),
    ("swiglu_backward", "act", swiglu, "swiglu_backward"),
    ("bias_swiglu", "act", swiglu, "swiglu"),
    ("bias_swiglu_backward", "act", swiglu, "swiglu_backward"),
    ("bias_gelu", "act", bias_gelu, "bias_gelu"),
    ("bias_gelu_backward", "act", bias_gelu, "bias_gelu_backward"),
    ("bias_dropout_add", "residual", bias_dropout_add, "bias_dropout_add"),
    ("bias_dropout_add_backward", "residual", bias_dropout_add, "bias_dropout_add_backward"),
    ("rmsnorm", "norm", rmsnorm, "rmsnorm"),
    ("add_rmsnorm", "norm", rmsnorm, "add_rmsnorm"),
    ("rmsnorm_backward", "norm", rmsnorm, "rmsnorm_backward"),
    ("rope", "rope", rope, "rope"),
    ("rope_backward", "rope", rope, "rope_backward"),
    ("gqa_attention", "attn", gqa, "gqa_attention"),
    ("gqa_attention_backward", "attn", gqa, "gqa_attention_backward"),
    ("linear_cross_entropy", "loss", linear_cross_entropy, "linear_cross_entropy"),
    ("linear_cross_entropy_backward", "loss", linear_cross_entropy, "linear_cross_entropy_backward"),
    ("moe_permute", "moe", moe_permute, "moe_permute"),
    ("moe_permute_capacity", "moe", moe_permute, "moe_permute_capacity"),
    ("moe_permute_backward", "moe", moe_permute, "moe_permute_backward"),
    ("moe_unpermute", "moe", moe_permute, "moe_unpermute"),
    ("moe_unpermute_backward", "moe", moe_permute, "moe_unpermute_backward"),
    ("moe_router", "moe", moe_router, "moe_router"),
    ("moe_router_backward", "moe", moe_router, "moe_router_backward"),
]


def _register(name: str, kind: str, reference: Callable, triton: Callable) -> None:
    op = getattr(torch.ops.mxgraph, name).default
    KERNELS[name] = Kernel(op=op, reference=reference, triton=triton, kind=kind)
    register_fused_kind(op, kind, backward=name.endswith("_backward"))


for _name, _kind, _module, _impl in _TABLE:
    _register(_name, _kind, getattr(_module, f"{_impl}_reference"), getattr(_module, f"{_impl}_triton"))

# Reference-only ops (no Triton path, so not in KERNELS): their kind all the same.
register_fused_kind(torch.ops.mxgraph.grouped_mm.default, "matmul")
register_fused_kind(torch.ops.mxgraph.grouped_mm_wgrad.default, "matmul", backward=True)


def cpu_decompositions() -> dict:
    """Each fused op of `KERNELS` -> the op's own Python body. Traced on CPU values, that
    body is the plain-torch reference (the Triton path is taken on ``cuda`` only), so
    Inductor, given this as decompositions for a CPU program, fuses the reference into the
    neighbouring loops instead of calling the op opaque. On ``cuda`` the ops stay extern
    kernels: their Triton. The grouped GEMMs stay opaque everywhere: their reference loops
    over the groups' row counts, data a trace cannot hold. So do those of `OPAQUE_ON_CPU`."""
    modules = {name: module for name, _, module, _ in _TABLE if name not in OPAQUE_ON_CPU}
    return {KERNELS[name].op: getattr(module, name)._init_fn for name, module in modules.items()}


OPAQUE_ON_CPU = frozenset({"bias_dropout_add", "bias_dropout_add_backward"})
"""Fused ops whose reference Inductor's C++ codegen cannot take in reasonable time: the
dropout mask hashes each element's index (two rounds of an integer mix over an `arange`),
and Inductor simplifies those index expressions symbolically when it picks the loops'
vector tiling; gpt-tiny's step did not compile in 20 minutes. They run as their reference,
called between Inductor's loops."""
