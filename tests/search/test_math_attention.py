"""Attention on a flash-attention device (`layer_cost`, `part_cost.fused_attention`): an SDPA
call that the CPU trace decomposes into math is priced as the fused kernel a GPU runs, and
the profiles' attention shares reproduce the published kernel figures they cite."""
from __future__ import annotations

import dataclasses

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

import models
from mxgraph.devices.catalog import A100, H100
from mxgraph.search.layer_cost import TraceCache, TraceKey


@pytest.mark.parametrize("recompute", ["", "full", "op_sac"])
def test_decomposed_sdpa_costs_what_the_sdpa_kernel_costs(recompute):
    """MLA with v's head dim equal to q/k's: the CPU runs SDPA as one flash kernel; forced
    to the math backend the same call decomposes into casts of q, k, v to fp32, their
    scaling, the S x S bmms and softmax, and the output's cast back, and the flash stand-in
    recomputes the attention unit in the backward. On a flash device both graphs must price
    the same: every GEMM, attention FLOP and memory-bound byte of every layer kind and
    program, exactly (the decomposition's casts, scaling, output copy and recompute are
    the kernel's own work) under no recompute, full recompute (the kernel runs again) and
    torchtitan's op policy (it keeps the kernel's output: none of the math is recomputed);
    the backward's attention is twice the forward's, as the cost rules count a flash
    backward, plus the forward again under full recompute. Without recompute the
    transient working set is the kernel's too (the values it keeps on chip count nothing:
    `FusedAttention.on_chip`)."""
    config = models.preset_config("moe-tiny")
    config = dataclasses.replace(config, v_head_dim=config.qk_nope_head_dim +
                                 config.qk_rope_head_dim)
    key, seq = TraceKey(dtype="bfloat16", recompute=recompute), 128
    kernel = TraceCache(models).layer_costs(config, key, seq)
    with sdpa_kernel(SDPBackend.MATH):
        math = TraceCache(models).layer_costs(config, key, seq)
    assert set(kernel.parts) == set(math.parts)
    for part in kernel.parts:
        a, b = kernel.parts[part], math.parts[part]
        assert (sum(a.gemms), sum(a.attention), sum(a.memory), len(a.memory)) == \
            (sum(b.gemms), sum(b.attention), sum(b.memory), len(b.memory)), part
    if not recompute:  # the working set: no S x S matrix, no fp32 copy of q, k, v
        assert math.saved.transient == kernel.saved.transient
    backward = 3 if recompute == "full" else 2  # (the forward again and) twice the forward
    assert sum(math.part("dense", "B").attention) == \
        backward * sum(math.part("dense", "F").attention)


def paper_rate(device, efficiency: float) -> float:
    """A causal forward+backward's FLOP/s as the FlashAttention benchmarks count them
    (backward = 2.5 x forward) from the profile's time for it (cost rules: 2 x)."""
    device = dataclasses.replace(device, attention_efficiency=efficiency)
    forward = 4 * 16 * 16 * 8192 ** 2 * 128 / 2  # batch 16, 16 heads, 8k, head dim 128
    seconds = device.attention_time(forward) + device.attention_time(2 * forward)
    return 3.5 * forward / seconds


@pytest.mark.parametrize("device, efficiency, low, high", [
    (H100, H100.attention_kernels["fa2"], 293e12, 326e12),  # FA3 paper: FA2 fwd+bwd
    (H100, H100.attention_efficiency, 465e12, 539e12),  # FA3 paper: cuDNN bwd to fwd
    (A100, A100.attention_efficiency, 0.50 * 312e12, 0.70 * 312e12),  # FA2 paper
])
def test_profiles_reproduce_the_published_attention_rates(device, efficiency, low, high):
    """Each profile's attention share, timed by the search's rules at a long causal shape,
    gives back the forward+backward TFLOPS of the paper it cites, in the paper's FLOP
    convention (the share is the paper's times 3 / 3.5)."""
    assert low <= paper_rate(device, efficiency) <= high
