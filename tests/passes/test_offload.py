"""Offload pass: saved activations move to the host pool and come back bitwise equal."""
import pytest
import torch

import models
import mxgraph as mx
from mxgraph.errors import PlanError
from mxgraph.ir import is_alias
from mxgraph.memory_saved import estimate_saved, measure_step
from mxgraph.plan import parse_offload
from mxgraph.runtime.offload import get_pool
from tests.helpers import batch

SMALL = {"llama-tiny": dict(n_layers=2), "gpt-tiny": dict(n_layers=2, dropout=0.1),
         "moe-tiny": dict(n_layers=2)}


def run(name, plan):
    torch.manual_seed(0)
    model = models.build_model(name, **SMALL[name])
    step = mx.compile(model, plan)
    args = batch(seq_len=16)
    torch.manual_seed(7)
    loss = step(*args)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gm = step.executors()[0].stages[0].joint.gm
    torch.manual_seed(7)
    return loss, grads, estimate_saved(gm), measure_step(step, *args), gm


_BASE = {}


def base(name, recompute=""):
    if (name, recompute) not in _BASE:
        # no auto_remat: under Inductor codegen the default plan recomputes (and a plan
        # that offloads does not), so the bytes would not add up to the baseline's
        _BASE[name, recompute] = run(name, mx.Plan(recompute=recompute,
                                                   disable_passes=["auto_remat"]))
    return _BASE[name, recompute]


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        assert torch.equal(a[1][key], b[1][key]), key


@pytest.mark.parametrize("name,offload,recompute", [
    ("llama-tiny", "all", ""), ("llama-tiny", "attn,mlp", ""), ("llama-tiny", "norm,act", "attn"),
    ("gpt-tiny", "all", ""), ("gpt-tiny", "attn", "norm"), ("moe-tiny", "moe", ""),
    ("moe-tiny", "all", "moe_light"),
])
def test_offload_is_bitwise_and_moves_bytes_to_host(name, offload, recompute):
    ref = base(name, recompute)
    result = run(name, mx.Plan(offload=offload, recompute=recompute))
    assert_same(result, ref)
    est, meas = result[2], result[3]
    assert (est.device_bytes, est.host_bytes) == (meas.device_bytes, meas.host_bytes)
    assert meas.host_bytes > 0
    # what left the device is what the host holds
    assert meas.device_bytes + meas.host_bytes == ref[3].device_bytes
    if offload == "all":
        assert meas.device_bytes <= 16  # the loss (and nothing else) stays


def test_scoped_offload_and_prefetch_placement():
    result = run("llama-tiny", mx.Plan(offload="layer1:all", offload_prefetch=3))
    assert_same(result, base("llama-tiny"))
    gm = result[4]
    nodes = list(gm.graph.nodes)
    offloads = [n for n in nodes if n.target is torch.ops.mxgraph.offload.default]
    assert offloads and all(n.meta["custom"]["layer"] == 1 for n in offloads)
    distances = []
    for fetch in [n for n in nodes if n.target is torch.ops.mxgraph.prefetch.default]:
        wait = next(iter(fetch.users))
        between = nodes[nodes.index(fetch) + 1:nodes.index(wait)]
        work = [n for n in between if n.target is not torch.ops.mxgraph.prefetch.default
                and n.target is not wait.target and not is_alias(n)]
        assert len(work) <= 3  # issued `offload_prefetch` backward nodes ahead (or fewer
        distances.append(len(work))  # when the use comes first in the backward)
    assert max(distances) >= 1
    pool = get_pool(gm.meta["offload_pool"])
    assert pool.bytes == result[3].host_bytes and pool.copies == 2 * len(offloads)
    stage = run("llama-tiny", mx.Plan(offload="stage0:all"))
    assert stage[3].device_bytes == run("llama-tiny", mx.Plan(offload="all"))[3].device_bytes


def test_offload_spec_validation():
    assert parse_offload("attn, stage0:all,layer2:mlp") == [
        (None, "attn"), ("stage0", "all"), ("layer2", "mlp")]
    with pytest.raises(PlanError, match="scope"):
        mx.Plan(offload="rank0:all")
    with pytest.raises(PlanError, match="'kv'"):
        mx.Plan(offload="stage1:kv")
