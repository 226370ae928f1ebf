"""A run's attention kernel (`Setting.attention_kernel`, `DeviceProfile.attention_kernels`):
FlashAttention-2 on a Hopper part prices attention at its own efficiency, against the
profile's default (cuDNN's); GEMMs and memory-bound kernels are unchanged; a kernel the
device does not list is a one-line error naming those it does; a device file keeps them."""
from __future__ import annotations

import pytest
import tomllib

import models
from mxgraph.devices.catalog import device_from_dict, load_device
from mxgraph.errors import UserError
from mxgraph.plan import Plan
from mxgraph.search.layer_cost import TraceCache
from mxgraph.search.part_time import kernel_times
from mxgraph.search.predict import plan_costs, predict
from mxgraph.search.setting import Setting

H100 = load_device("h100-sxm")
CACHE = TraceCache(models)


def setting(kernel: str = "") -> Setting:
    return Setting(models.preset_config("llama-tiny"), H100, 4, 8, 256, models, cache=CACHE,
                   attention_kernel=kernel)


def test_flash_attention_2_prices_attention_at_its_efficiency():
    default, fa2 = setting(), setting("fa2")
    assert default.device.attention_efficiency == H100.attention_efficiency
    assert fa2.device.attention_efficiency == H100.attention_kernels["fa2"] < \
        H100.attention_efficiency
    plan = Plan(dp=4)
    part = plan_costs(default, plan, True).part("dense", "F")
    assert part.attention
    times = {s.attention_kernel: kernel_times(s.device, part, 2) for s in (default, fa2)}
    overhead = H100.op_overhead_s * len(part.attention)
    assert (times["fa2"]["attention"] - overhead) == pytest.approx(
        (times[""]["attention"] - overhead) * H100.attention_efficiency /
        H100.attention_kernels["fa2"], rel=1e-9)
    assert times["fa2"]["gemm"] == times[""]["gemm"]
    assert times["fa2"]["memory"] == times[""]["memory"]
    slower, faster = predict(fa2, plan, 1), predict(default, plan, 1)
    assert slower.breakdown_s["attention"] > faster.breakdown_s["attention"]
    assert slower.breakdown_s["gemm"] == faster.breakdown_s["gemm"]


def test_an_unknown_kernel_is_a_one_line_error():
    with pytest.raises(UserError, match="no attention kernel 'fa9'.*default, fa2"):
        setting("fa9")
    assert H100.with_attention_kernel("default") is H100


def test_a_device_file_keeps_its_attention_kernels():
    back = device_from_dict(tomllib.loads(H100.to_toml()), "h100.toml")
    assert back.attention_kernels == H100.attention_kernels
    with pytest.raises(UserError, match="attention_kernels.fa2 = 'fast' must be a share"):
        device_from_dict({"name": "x", "peak_flops": 1e12,
                          "attention_kernels": {"fa2": "fast"}}, "x.toml")
