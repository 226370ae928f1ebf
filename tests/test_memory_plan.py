"""Memory estimator: agrees with the measured compiled step on tiny presets, counts
parameters/optimizer states exactly, follows the schedule's in-flight micro-batches, and
runs real-size presets on the meta device; `mxgraph inspect --memory` prints and plots."""
import dataclasses

import pytest
import torch

import models
import mxgraph as mx
from mxgraph.cli.main import main as cli_main
from mxgraph.memory_plan import estimate_memory, in_flight
from mxgraph.memory_saved import measure_step
from tests.helpers import batch


@pytest.mark.parametrize("name,policy", [
    ("llama-tiny", ""), ("llama-tiny", "norm,act"), ("llama-tiny", "full"),
    ("gpt-tiny", "norm,act,attn"), ("moe-tiny", "moe_medium"),
])
def test_estimate_matches_measured_step(name, policy):
    plan = mx.Plan(recompute=policy)
    stage, = estimate_memory(name, plan, batch_size=2, seq_len=16, dtype=torch.float32,
                             flash_attention=False)  # as the CPU runs MLA: math attention
    torch.manual_seed(0)
    model = models.build_model(name)
    step = mx.compile(model, plan)
    args = batch(seq_len=16)
    step(*args)
    measured = measure_step(step, *args).device_bytes
    assert abs(stage.activations - measured) <= 0.10 * measured, (stage.activations, measured)
    params = sum(p.numel() for p in model.parameters())
    assert stage.params == stage.grads == params * 4
    assert stage.optimizer == params * 8  # fp32: two AdamW states, no master copy


def test_parameters_optimizer_and_sharding_on_meta():
    name = "llama2-70b"
    count = models.count_params(models.build_model(name, device="meta"))
    one, = estimate_memory(name, mx.Plan(precision="bf16-mixed"), seq_len=128)
    # bf16 parameters, fp32 main gradients, AdamW's two fp32 moments + the fp32 master
    assert one.params == 2 * count and one.grads == 4 * count and one.optimizer == 12 * count
    sharded, = estimate_memory(name, mx.Plan(zero1=True, dp=4, precision="bf16-mixed"),
                               seq_len=128)
    assert sharded.optimizer == 12 * count // 4 and sharded.params == one.params
    stages = estimate_memory(name, mx.Plan(pp=4, micro_batches=8, tp=8,
                                           sequence_parallel=True), seq_len=128)
    assert [s.layers for s in stages] == [20] * 4
    assert abs(sum(s.params for s in stages) * 8 - one.params) < 0.01 * one.params
    acts = [s.activations for s in stages]
    assert acts[1] > acts[2] > acts[3]  # 1F1B: stage s holds pp - s micro-batches


def test_in_flight_follows_the_schedule():
    assert in_flight(mx.Plan()) == {0: 1.0}
    assert in_flight(mx.Plan(pp=4, micro_batches=8)) == {0: 4.0, 1: 3.0, 2: 2.0, 3: 1.0}
    assert set(in_flight(mx.Plan(pp=4, micro_batches=8, schedule="gpipe")).values()) == {8.0}


def test_offload_moves_estimate_to_host():
    plan = mx.Plan(offload="all")
    stage, = estimate_memory("llama-tiny", plan, batch_size=2, seq_len=16, dtype=torch.float32)
    base, = estimate_memory("llama-tiny", mx.Plan(), batch_size=2, seq_len=16,
                            dtype=torch.float32)
    assert stage.offloaded > 0 and stage.activations < base.activations


def test_inspect_memory_cli(tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text('recompute = "norm,act"\n')
    png = tmp_path / "mem.png"
    assert cli_main(["inspect", "--memory", "--model", "llama-tiny", "--plan", str(plan),
                     "--seq-len", "16", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "params" in out and "acts" in out and png.stat().st_size > 1000


def test_flash_attention_drops_the_score_matrices():
    # experts as grouped GEMMs: this is about attention, and the loop form traces slowly
    cfg = dataclasses.replace(models.PRESETS["moe-tiny"][1], expert_impl="grouped_mm")
    args = dict(batch_size=1, seq_len=128, dtype=torch.float32)
    math, = estimate_memory(cfg, mx.Plan(), flash_attention=False, **args)
    flash, = estimate_memory(cfg, mx.Plan(), **args)
    heads, layers = cfg.n_heads, cfg.n_layers
    assert math.activations - flash.activations >= layers * heads * 128 * 128 * 4
