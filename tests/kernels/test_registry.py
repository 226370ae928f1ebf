"""The kernel registry lists every fused op, forward and backward, with both implementations."""

import torch

from mxgraph.codegen.kernels import KERNELS, Kernel

FORWARD_OPS = ["swiglu", "bias_swiglu", "bias_gelu", "bias_dropout_add", "rope", "gqa_attention", "rmsnorm",
               "add_rmsnorm", "linear_cross_entropy", "moe_permute", "moe_permute_capacity", "moe_unpermute",
               "moe_router"]


def test_every_forward_op_and_its_backward_is_registered():
    for name in FORWARD_OPS:
        assert name in KERNELS, name
    backward = {"add_rmsnorm": "rmsnorm_backward", "moe_permute_capacity": "moe_permute_backward"}
    for name in FORWARD_OPS:
        assert backward.get(name, f"{name}_backward") in KERNELS, name


def test_entries_point_at_registered_ops():
    for name, kernel in KERNELS.items():
        assert isinstance(kernel, Kernel)
        assert kernel.op is getattr(torch.ops.mxgraph, name).default
        assert kernel.op.namespace == "mxgraph"
        assert callable(kernel.reference) and callable(kernel.triton)
        assert kernel.reference.__name__.endswith("_reference"), name
        assert kernel.triton.__name__.endswith("_triton"), name
