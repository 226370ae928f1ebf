"""Auto Search (`mxgraph/search/`): costs against analytical references, the schedule's bubble
against theory, every top plan compiles, the CLI's outputs and one-line errors, the
calibrated device TOML round trip."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import models
from mxgraph.cli.main import main
from mxgraph.context import CompileContext
from mxgraph.devices.catalog import load_device
from mxgraph.driver import check_plan, compile_step, fake_model, paper_mesh
from mxgraph.memory_plan import trace_layer_activations
from mxgraph.plan import Plan
from mxgraph.schedules import Costs, simulate
from mxgraph.search.enumerate import Space, search
from mxgraph.search.layer_cost import TraceCache, TraceKey, trace
from mxgraph.search.predict import predict
from mxgraph.search.schedule_time import pipeline, schedule_of
from mxgraph.search.setting import Setting

SMALL = Space(max_tp=2, schedules=("1f1b", "zbh1"), recompute=("",), offload=("",),
              max_mbs=2, sequence_parallel=(False,))


@pytest.fixture(scope="module")
def setting():
    config = models.preset_config("llama-tiny")
    return Setting(config, load_device("a100-80gb"), 4, 8, 128, models)


def test_flops_match_six_n_tokens(setting):
    """F + B + W FLOPs of one sequence from the graph vs 6 N T plus attention (QK^T and PV,
    causal: half; backward twice the forward), within 2%."""
    config = setting.config
    costs = setting.cache.layer_costs(config, TraceKey(), 128)
    graph = sum(config.n_layers * costs.part("dense", p).flops +
                costs.part("head", p).flops for p in "FBW")
    model = models.build_from_config(config, device="meta")
    matrices = sum(p.numel() for n, p in model.named_parameters()
                   if p.dim() == 2 and not n.startswith("embed"))
    tokens, head_dim = 128, config.dim // config.n_heads
    attention = 3 * config.n_layers * 2 * config.n_heads * tokens * tokens * 2 * head_dim / 2
    reference = 6 * matrices * tokens + attention
    assert graph == pytest.approx(reference, rel=0.02)


def test_bubble_of_equal_costs_is_theory():
    """1F1B with equal F and B: simulated bubble (p-1)/(m+p-1)."""
    for pp, m in ((2, 4), (4, 8)):
        plan = Plan(pp=pp, micro_batches=m, dp=1)
        timeline = simulate(schedule_of(plan), Costs(f=1, b=1, w=1))
        assert timeline.overall_bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1))


def test_top_plans_pass_every_check_and_compile(setting):
    result = search(setting, top_k=3, space=SMALL)
    assert len(result.best) == 3
    assert result.best[0].step_s <= result.best[-1].step_s
    assert result.pruned.get("pre-score", 0) > 0
    for prediction in result.best[:2]:
        plan = prediction.plan
        check_plan(plan, setting.gpus)
        model = models.build_from_config(setting.config, device="meta")
        tokens = torch.zeros(prediction.mbs * plan.micro_batches, 128, dtype=torch.long,
                             device="meta")
        model, (tokens,) = fake_model(model, (tokens,))
        mesh = paper_mesh(plan)
        compile_step(model, plan, mesh, CompileContext.for_plan(plan, mesh=mesh),
                     (tokens, tokens), {}, stop_after="split_bw")
        assert 0 <= prediction.bubble < 1 and prediction.peak_memory_gib > 0


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("zbh1", 1), ("interleaved", 2),
                                           ("dualpipev", 2)])
def test_pipeline_extrapolation_matches_simulation(setting, schedule, vpp):
    """Beyond 3 pp micro-batches `pipeline` extrapolates two short simulations: equal to the
    full simulation under equal costs, within 1% under unequal per-stage costs."""
    plan = Plan(pp=4, schedule=schedule, vpp=vpp, micro_batches=20)
    stages = schedule_of(plan).num_stages
    uneven = Costs(per_stage={s: {"F": 1 + s % 3 / 2, "B": 2 - s % 2 / 2, "W": 0.7}
                              for s in range(stages)}, comm=0.3)
    for costs in (Costs(), uneven):
        full = simulate(schedule_of(plan), costs)
        total, bubble, peak = pipeline(setting, plan, costs)
        assert total == pytest.approx(full.total_time, rel=0.01)
        assert bubble == pytest.approx(full.overall_bubble_ratio, abs=0.01)
        assert peak == full.peak_activations


def test_policy_variant_and_saved_bytes_match_own_compiles(setting):
    """A recompute variant derived from its strategy's compile equals its own compile;
    saved bytes per layer read from the traced graph equal `memory_plan`'s differences."""
    key = TraceKey(recompute="full")
    derived = setting.cache.layer_costs(setting.config, key, 128)
    own, _ = trace(models, setting.config, key, 128)
    for name in set(derived.parts) | set(own.parts):
        a, b = derived.part(*name), own.part(*name)
        assert sorted(a.gemms) == sorted(b.gemms) and sorted(a.memory) == sorted(b.memory)
    assert derived.saved == own.saved
    plain = setting.cache.layer_costs(setting.config, TraceKey(), 128).saved
    reference = trace_layer_activations(setting.config, Plan(), 1, 128)
    assert plain.device["dense"] == reference.dense
    assert plain.device.get("embed", 0) + plain.device["head"] == reference.other


def test_tp_extrapolation_is_close_to_a_trace():
    """The pre-score's tp 4 costs (from traces at tp 1 and 2) vs a tp 4 trace: FLOPs per
    part and parameter bytes within 1%, saved bytes within 10% (tp 1 saves the residual
    stream in another form than tp > 1, so the split model is rougher there)."""
    config = dataclasses.replace(models.preset_config("llama-tiny"), n_kv_heads=4)
    cache = TraceCache(models)
    key = TraceKey(tp=4)
    estimated = cache.estimate(config, key, 64)
    traced = cache.layer_costs(config, key, 64)
    for name in traced.parts:
        assert estimated.part(*name).flops == pytest.approx(traced.part(*name).flops, rel=0.01)
    for kind, value in traced.param_bytes.items():
        assert estimated.param_bytes[kind] == pytest.approx(value, rel=0.01)
    assert sum(estimated.saved.device.values()) == pytest.approx(
        sum(traced.saved.device.values()), rel=0.1)


def test_predicted_time_grows_with_work(setting):
    """More recompute costs time and saves memory; a bigger batch takes longer."""
    base = predict(setting, Plan(dp=4), 2)
    full = predict(setting, Plan(dp=4, recompute="full"), 2)
    assert full.step_s > base.step_s and full.peak_memory_gib < base.peak_memory_gib
    bigger = Setting(setting.config, setting.device, 4, 16, 128, models, cache=setting.cache)
    assert predict(bigger, Plan(dp=4), 4).step_s > base.step_s


def test_memory_and_gradient_reduction_parts(setting):
    """Exact figures of the memory and reduction model: under pure bf16 a second micro-batch
    adds one gradient-sized buffer (the last micro-batch's gradients before they are added
    in), nothing else at the same micro-batch size; under bf16-mixed (the search's default)
    that buffer, the bf16 gradients before they are added into the fp32 main ones, is held
    at one micro-batch already; an MoE plan whose experts are split over all
    data-parallel ranks (ep = dp: no expert replicas) reduces only the dense gradients, as
    one all-reduce of their bytes per bucket over dp; W holds a share of one activation unit."""
    params = setting.cache.layer_costs(setting.config, TraceKey(dtype="bfloat16"), 128)
    total = sum(params.param_bytes[kind] * (setting.config.n_layers if kind == "dense" else 1)
                for kind in params.param_bytes)
    one, two = (predict(setting, Plan(dp=4, micro_batches=m, precision="bf16"), 1)
                for m in (1, 2))
    assert (two.peak_memory_gib - one.peak_memory_gib) * 2 ** 30 == pytest.approx(total)
    assert setting.precision == "bf16-mixed"
    one, two = (predict(setting, Plan(dp=4, micro_batches=m), 1) for m in (1, 2))
    assert two.peak_memory_gib == one.peak_memory_gib
    config = models.preset_config("moe-tiny")
    moe = Setting(config, setting.device, 4, 8, 128, models)
    plan = Plan(dp=4, ep=4, bucket_mb=1024)
    costs = moe.cache.layer_costs(config, TraceKey(expert_parallel=True, dtype="bfloat16"), 128)
    counts = {"dense": config.n_dense_layers, "moe": config.n_layers - config.n_dense_layers,
              "embed": 1, "head": 1}
    dense = sum(n * (costs.param_bytes.get(k, 0) - costs.expert_param_bytes.get(k, 0))
                for k, n in counts.items())
    # the search's precision on a bf16 device, bf16-mixed, reduces fp32 gradients: twice
    # the bytes of the bf16 parameters
    assert moe.precision == "bf16-mixed"
    reference = moe.device.collective_time("all_reduce", 2 * dense, 4, False, 4)
    assert predict(moe, plan, 2).parts_s["grad_sync"] == pytest.approx(reference)
    assert 0 < costs.w_retained <= 1


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_plans_and_evaluate(tmp_path, capsys):
    out, plans = tmp_path / "top.json", tmp_path / "plans"
    code, text, _ = _run(capsys, "search", "--model", "llama-tiny", "--gpus", "2", "--device",
                         "h100-sxm", "--global-batch", "4", "--seq-len", "64", "--top-k", "2",
                         "--schedules", "1f1b", "--max-mbs", "2", "--max-tp", "1",
                         "--recompute-levels", "none", "--offload-levels", "none",
                         "--json", str(out),
                         "--plans-dir", str(plans), "--explain")
    assert code == 0 and "tok/s/GPU" in text and "pruned:" in text
    assert "by component" in text and "not modelled:" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for row in rows:
        assert {"plan", "step_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "bubble",
                "exposed_comm_s", "breakdown_s"} <= set(row)
        assert sum(row["breakdown_s"].values()) == pytest.approx(row["step_s"], rel=1e-9)
    plan = Plan.from_toml(plans / "plan1.toml")
    assert plan.tp == rows[0]["plan"]["tp"] and plan.pp == rows[0]["plan"]["pp"]
    one = tmp_path / "one.json"
    code, _, _ = _run(capsys, "search", "--model", "llama-tiny", "--gpus", "2", "--device",
                      "h100-sxm", "--global-batch", "4", "--seq-len", "64", "--evaluate",
                      str(plans / "plan1.toml"), "--json", str(one))
    evaluated = json.loads(one.read_text())
    assert code == 0 and len(evaluated) == 1
    assert evaluated[0]["step_s"] == pytest.approx(rows[0]["step_s"], rel=1e-6)


def test_model_file_and_device_file(tmp_path, capsys):
    model = tmp_path / "m.toml"
    model.write_text('family = "llama"\nvocab_size = 256\ndim = 64\nn_layers = 2\n'
                     'n_heads = 4\nffn_dim = 128\n')
    device = tmp_path / "d.toml"
    device.write_text(load_device("a100-80gb").to_toml())
    plan = tmp_path / "p.toml"
    plan.write_text("dp = 2\n")
    code, text, err = _run(capsys, "search", "--model", str(model), "--gpus", "2", "--device",
                           str(device), "--global-batch", "2", "--seq-len", "32", "--evaluate",
                           str(plan))
    assert code == 0, err
    assert "tp1 pp1 dp2" in text


@pytest.mark.parametrize("change, message", [
    ({"device": "b200"}, "neither a built-in profile"),
    ({"model": "MISSING"}, "misses the field 'ffn_dim'"),
    ({"gpus": "7"}, "no layout"),
    ({"evaluate": "PLAN", "global_batch": "2"}, "does not split over dp=4"),
    ({"model": "llama-99b"}, "unknown model preset"),
    ({"attention_kernel": "fa9"}, "no attention kernel 'fa9'"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, change, message):
    args = {"model": "llama-tiny", "gpus": "4", "device": "a100-80gb", "global_batch": "8",
                "seq_len": "64"}
    args.update(change)
    if args["model"] == "MISSING":
        path = tmp_path / "bad.toml"
        path.write_text('family = "llama"\nvocab_size = 256\ndim = 64\nn_layers = 2\n'
                        'n_heads = 4\n')
        args["model"] = str(path)
    if args.get("evaluate") == "PLAN":
        (tmp_path / "p.toml").write_text("dp = 4\n")
        args["evaluate"] = str(tmp_path / "p.toml")
    argv = ["search"] + [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", v)]
    if args["gpus"] == "7":
        argv += ["--max-tp", "1", "--schedules", "1f1b"]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--gpus", "--device", "--global-batch", "--seq-len", "--top-k",
                 "--json", "--plans-dir", "--explain", "--evaluate", "--calibrate", "--quick",
                 "--attention-kernel"):
        assert flag in text
    assert "GiB" in text and "seconds" in text


def test_calibrated_device_round_trip(tmp_path):
    from mxgraph.search.calibrate import measure, write_profile
    profile = measure("cpu", quick=True)
    path = tmp_path / "cpu.toml"
    write_profile(profile, str(path))
    loaded = load_device(str(path))
    assert loaded == profile
    assert loaded.peak_flops > 1e8 and loaded.hbm_bw > 1e7 and loaded.op_overhead_s > 0


def test_math_attention_is_priced_as_a_fused_kernel():
    """MLA's math attention (q/k head dim 48 against v's 32: no SDPA kernel on the CPU) on a
    flash-attention device: its two forward bmms are one causal attention's FLOPs, as
    SDPA's rule counts them (QK^T and PV over the lower triangle), and the memory-bound
    kernels over the S x S matrices (mask, softmax, casts: more than three matrices' bytes)
    are gone; on a math-attention device the same graph keeps them as GEMMs and
    elementwise kernels."""
    config = models.preset_config("moe-tiny")
    cache, seq = TraceCache(models), 128
    fused = cache.layer_costs(config, TraceKey(dtype="bfloat16"), seq).part("dense", "F")
    math = cache.layer_costs(config, TraceKey(dtype="bfloat16", flash_attention=False),
                             seq).part("dense", "F")
    heads, qk, v = config.n_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, \
        config.v_head_dim
    assert sum(fused.attention) == 2 * heads * seq * seq * (qk + v) // 2
    assert not math.attention and sum(math.gemms) == pytest.approx(
        sum(fused.gemms) + 2 * sum(fused.attention))
    scores = heads * seq * seq * 2  # one bf16 S x S matrix of every head
    assert sum(math.memory) - sum(fused.memory) > 3 * scores
