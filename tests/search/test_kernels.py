"""Auto Search's kernel costs (issue #31): GEMMs by shape (tile and wave quantization, the
memory roofline), FP8 GEMMs, the shapes the trace records, the step's breakdown, and an
F&B pair hiding its collectives; each against a hand-computed reference."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import models
from mxgraph.devices.catalog import load_device
from mxgraph.devices.profile import DeviceProfile
from mxgraph.plan import Plan
from mxgraph.schedules import Costs, simulate
from mxgraph.schedules.action import BW, OVERLAP_F_B, Action, F
from mxgraph.schedules.schedule import Schedule
from mxgraph.search.part_time import kernel_times
from mxgraph.search.predict import plan_costs, predict
from mxgraph.search.setting import Setting

H100 = load_device("h100-sxm")


def test_large_gemm_runs_at_the_large_shape_rate():
    shape = (1, 8192, 8192, 8192, 1)  # 64 x 32 tiles of 128 x 256: 2048 tiles, 15.5 waves
    flops = 2 * 8192 ** 3
    waves = math.ceil(2048 / 132)
    expected = H100.op_overhead_s + flops * waves * 132 / 2048 / H100.gemm_rate()
    assert H100.gemm_shape_time(shape) == pytest.approx(expected, rel=1e-9)
    assert H100.gemm_shape_time(shape) == pytest.approx(flops / H100.gemm_rate(), rel=0.04)


def test_a_partial_wave_idles_sms_unless_stream_k():
    one_wave = (1, 128 * 12, 256 * 11, 4096, -1)  # 132 tiles: one full wave
    one_more = (1, 128 * 12 + 1, 256 * 11, 4096, -1)  # a 13th row of tiles: a second wave
    t1, t2 = H100.gemm_shape_time(one_wave), H100.gemm_shape_time(one_more)
    assert t2 - H100.op_overhead_s == pytest.approx(2 * (t1 - H100.op_overhead_s), rel=1e-9)
    spread = dataclasses.replace(H100, stream_k=True)
    ratio = (spread.gemm_shape_time(one_more) - H100.op_overhead_s) / (t1 - H100.op_overhead_s)
    assert ratio == pytest.approx(143 / 132, rel=1e-9)  # 11 more tiles, no idle SMs


DIMS = st.integers(1, 20000)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batch=st.integers(1, 16), m=DIMS, n=DIMS, k=DIMS, grows=st.sampled_from([-1, 0, 1, 3]),
       sequences=st.integers(1, 8), device=st.sampled_from(["h100-sxm", "a100-80gb"]))
def test_a_gemm_is_never_faster_than_its_roofline(batch, m, n, k, grows, sequences, device):
    """Over shapes: no GEMM beats its FLOPs at the large-shape rate nor its bytes at the
    memory rate, padding wastes at most a wave and a tile in each dimension, and more
    sequences never take less time."""
    profile = load_device(device)
    shape = (batch, m, n, k, grows)
    seconds = profile.gemm_shape_time(shape, sequences)
    dims = [batch, m, n, k]
    if grows >= 0:
        dims[grows] *= sequences
    b, mm, nn, kk = dims
    repeat = 1 if grows >= 0 else sequences
    flops = 2.0 * b * mm * nn * kk * repeat
    moved = b * (2 * (mm * kk + kk * nn) + 2 * mm * nn) * repeat
    overhead = profile.op_overhead_s * repeat
    assert seconds >= overhead + flops / profile.gemm_rate() * (1 - 1e-9)
    assert seconds >= overhead + moved / (profile.hbm_bw * profile.memory_efficiency) * (1 - 1e-9)
    rows, cols = profile.gemm_tile
    padded = 2.0 * (b * math.ceil(mm / rows) * math.ceil(nn / cols) + profile.sm_count) * \
        rows * cols * kk * repeat
    assert seconds <= overhead + max(padded / profile.gemm_rate(), moved / (
        profile.hbm_bw * profile.memory_efficiency)) * (1 + 1e-9)
    assert profile.gemm_shape_time(shape, sequences + 1) >= seconds * (1 - 1e-9)


def test_few_rows_are_memory_bound():
    m, n, k = 8, 4096, 4096  # a small expert's GEMM: the weight's bytes dominate
    moved = 2 * (m * k + k * n) + 2 * m * n
    expected = H100.op_overhead_s + moved / (H100.hbm_bw * H100.memory_efficiency)
    assert H100.gemm_shape_time((1, m, n, k, 1)) == pytest.approx(expected, rel=1e-9)


def test_more_sequences_lengthen_the_growing_dimension():
    shape = (1, 4096, 4096, 4096, 1)
    assert H100.gemm_shape_time(shape, sequences=4) == pytest.approx(
        H100.gemm_shape_time((1, 4 * 4096, 4096, 4096, 1)), rel=1e-12)
    fixed = (1, 4096, 4096, 4096, -1)  # no dimension grows: the GEMM runs once per sequence
    assert H100.gemm_shape_time(fixed, sequences=3) == pytest.approx(
        3 * H100.gemm_shape_time(fixed), rel=1e-12)


def test_fp8_gemms_run_at_the_fp8_rate():
    shape = (1, 8192, 8192, 8192, 1)
    bf16, fp8 = H100.gemm_shape_time(shape), H100.gemm_shape_time(shape, element=1, fp8=True)
    ratio = (bf16 - H100.op_overhead_s) / (fp8 - H100.op_overhead_s)
    assert ratio == pytest.approx(H100.gemm_rate(fp8=True) / H100.gemm_rate(), rel=1e-9)
    a100 = load_device("a100-80gb")  # no FP8 tensor cores: the bf16 rate
    assert a100.gemm_rate(fp8=True) == a100.gemm_rate()


def test_bad_gemm_tile_is_a_clear_error():
    from mxgraph.errors import UserError
    with pytest.raises(UserError, match="gemm_tile"):
        DeviceProfile(name="x", peak_flops=1e12, gemm_tile=[128])


@pytest.fixture(scope="module")
def setting():
    return Setting(models.preset_config("llama-tiny"), H100, 4, 8, 128, models)


def test_traced_gemm_shapes_hold_their_flops(setting):
    plan = Plan(tp=2, dp=2, sequence_parallel=True)
    costs = plan_costs(setting, plan, exact=True)
    checked = 0
    for part in costs.parts.values():
        assert len(part.gemm_shapes) == len(part.gemms)
        for flops, (batch, m, n, k, grows) in zip(part.gemms, part.gemm_shapes, strict=True):
            assert 2 * batch * m * n * k == pytest.approx(flops, rel=0.02)
            assert grows in (-1, 0, 1, 3)
            checked += 1
    assert checked > 10
    fp8 = kernel_times(H100, costs.part("dense", "F"), 2, fp8=True)
    bf16 = kernel_times(H100, costs.part("dense", "F"), 2)
    assert fp8["gemm"] < bf16["gemm"] and fp8["attention"] == bf16["attention"]


def test_breakdown_adds_up_to_the_step(setting):
    for plan in (Plan(tp=2, dp=2, zero1=True), Plan(pp=2, dp=2, micro_batches=4)):
        p = predict(setting, plan, 1)
        assert sum(p.breakdown_s.values()) == pytest.approx(p.step_s, rel=1e-9)
        assert p.breakdown_s["gemm"] > 0 and p.breakdown_s["memory"] > 0


def test_fb_pair_hides_collectives_behind_its_other_part():
    pair = Action(0, OVERLAP_F_B, 1, parts=(Action(0, F, 1), Action(0, BW, 0)))
    schedule = Schedule(name="pair", num_stages=1, num_microbatches=2, stage_to_rank=(0,),
                        actions={0: [Action(0, F, 0), pair, Action(0, BW, 1)]})
    plain = Costs(f=1.0, b=1.5, w=0.5)  # the pair lasts F + BW = 3
    assert simulate(schedule, plain, check=False).total_time == pytest.approx(1 + 3 + 2)
    hiding = Costs(f=1.0, b=1.5, w=0.5, hidden_in_pair={0: {F: 0.5, BW: 0.3}})
    assert simulate(schedule, hiding, check=False).total_time == pytest.approx(1 + 2.2 + 2)
    most = Costs(f=1.0, b=1.5, w=0.5, hidden_in_pair={0: {F: 5.0, BW: 5.0}})
    assert simulate(schedule, most, check=False).total_time == pytest.approx(1 + 2 + 2)


def test_calibration_recovers_the_tile_rate():
    from mxgraph.search.calibrate import tile_rate
    device = DeviceProfile(name="gpu", peak_flops=5e14, gemm_efficiency=1.0, op_overhead_s=5e-6,
                           hbm_bw=1e30, sm_count=132, gemm_tile=[128, 256])
    samples = [(n, device.gemm_shape_time((1, n, n, n, -1))) for n in (1024, 2048, 4096, 8192)]
    assert tile_rate(samples, 5e-6, 132, [128, 256]) == pytest.approx(5e14, rel=1e-9)


@pytest.mark.parametrize("schedule, pp, vpp", [("1f1b", 2, 1), ("interleaved", 2, 2),
                                               ("dualpipev", 2, 1)])
def test_stages_hold_the_layers_the_pipeline_split_gives_them(schedule, pp, vpp):
    """The search's layers per stage are the runtime's (`passes/split_stages`): balanced by
    forward FLOPs, the embedding on stage 0, the head on the last; under DualPipeV the two
    share a rank and each pays half of both."""
    import torch

    from mxgraph.context import CompileContext
    from mxgraph.driver import compile_step, fake_model, paper_mesh
    from mxgraph.search.schedule_time import stage_count, stage_parts
    config = dataclasses.replace(models.preset_config("llama-tiny"), n_layers=9)
    setting = Setting(config, H100, 2, 8, 128, models)
    plan = Plan(pp=pp, vpp=vpp, schedule=schedule, micro_batches=4, dp=1)
    costs = plan_costs(setting, plan, exact=True)
    searched = [stage["dense"] for stage in stage_parts(setting, plan, stage_count(plan), costs)]
    model = models.build_from_config(config, device="meta")
    tokens = torch.zeros(4, 128, dtype=torch.long, device="meta")
    model, (tokens,) = fake_model(model, (tokens,))
    mesh = paper_mesh(plan)
    compilation = compile_step(model, plan, mesh, CompileContext.for_plan(plan, mesh=mesh),
                               (tokens, tokens), {}, stop_after="split_stages")
    stage_of = {(n.meta.get("custom") or {}).get("layer"): n.meta["custom"]["stage"]
                for n in compilation.forward.gm.graph.nodes if n.op == "call_function"}
    split = [sum(1 for layer, s in stage_of.items() if layer is not None and s == stage)
             for stage in range(len(compilation.stage_graphs))]
    assert searched == split
    assert sum(split) == 9
