"""Training metrics (mxgraph/train/metrics.py, mxgraph/train/flops.py): model FLOPs per token against a
hand count (dense, preset MoE, Hugging Face Mixtral: active experts only) and against the
compiler's cost from the same FLOP rules, MFU, periodic
validation that leaves training bitwise unchanged, the JSONL and TensorBoard records, and
rank 0 alone writing under 2 data-parallel ranks."""
import dataclasses
import json
import math
import resource
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import models
from mxgraph.cli.main import main as cli_main
from mxgraph.cost import graph_cost
from mxgraph.errors import UserError
from mxgraph.hf.models import TINY
from mxgraph.runtime.health import Verdict
from mxgraph.train.flops import ForwardFlops, mfu, model_flops_per_token
from mxgraph.train.loop import TrainConfig, build_training_model, lr_at, train
from mxgraph.train.metrics import RunMetrics, check_metrics_flags
from tests.distributed import run_ranks

FLOP_TOL = 1e-12
"""Relative: the count is exact in integers; the per-token division and the straight line
from two lengths round in float64."""
HF_GPT2 = ("hf:gpt2", "vocab_size=256,n_embd=32,n_layer=1,n_head=2,n_inner=64,n_positions=64,"
           "bos_token_id=0,eos_token_id=0")
"""A tiny GPT-2 with the family's default dropout (0.1 everywhere): the runs compared below
draw random numbers every step, so a validation that moved the random state would show."""
RUN = dict(model=HF_GPT2[0], model_config=HF_GPT2[1], steps=4, batch_size=2, seq_len=32,
           warmup=2, val_batches=2)


def tokens(n: int = 100) -> torch.Tensor:
    return torch.arange(n) * 7 % 256


# ---- FLOPs per token ----------------------------------------------------------------------
def llama_count(c, seq_len: int) -> int:
    """6 x the matmul parameters (q, k, v, o, the SwiGLU's three, the LM head; not the
    embedding lookup) + 12 x layers x width x seq_len."""
    kv = c.n_kv_heads * c.head_dim
    per_layer = 2 * c.dim * c.dim + 2 * kv * c.dim + 3 * c.dim * c.ffn_dim
    return 6 * (c.n_layers * per_layer + c.vocab_size * c.dim) + 12 * c.n_layers * c.dim * seq_len


@pytest.mark.parametrize("seq_len", [12, 64])  # measured at 12; from 8 and 16 to 64
def test_dense_flops_per_token_is_the_hand_count(seq_len):
    config = dataclasses.replace(models.preset_config("llama-tiny"), n_layers=2, dim=64,
                                 ffn_dim=128)
    model = models.build_from_config(config)
    flops, uncounted = model_flops_per_token(model, tokens(), seq_len)
    assert uncounted == []
    assert flops == pytest.approx(llama_count(config, seq_len), rel=FLOP_TOL)


def test_moe_preset_flops_count_active_experts_only():
    """moe-tiny (MLA attention, one dense layer, then routed top-2 of 8 experts + a shared
    expert), both expert implementations: a token meets topk experts, not all 8."""
    c = dataclasses.replace(models.preset_config("moe-tiny"), n_layers=2)
    seq_len = 64
    heads, qk = c.n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    attention = (c.q_lora_rank * c.dim + heads * qk * c.q_lora_rank
                 + (c.kv_lora_rank + c.qk_rope_head_dim) * c.dim
                 + heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
                 + c.dim * heads * c.v_head_dim)
    expert = 3 * c.dim * c.moe_ffn_dim
    moe = c.n_routed_experts * c.dim + c.n_shared_experts * expert + c.topk * expert
    dense = 3 * c.dim * c.ffn_dim
    matmul_params = (c.n_layers * attention + c.n_dense_layers * dense
                     + (c.n_layers - c.n_dense_layers) * moe + c.vocab_size * c.dim)
    hand = 6 * matmul_params + 6 * c.n_layers * heads * seq_len * (qk + c.v_head_dim)
    for impl in ("loop", "grouped_mm"):
        model = models.build_from_config(dataclasses.replace(c, expert_impl=impl))
        flops, uncounted = model_flops_per_token(model, tokens(), seq_len)
        assert uncounted == [] and flops == pytest.approx(hand, rel=FLOP_TOL), impl


def test_hf_mixtral_flops_count_active_experts_only():
    """transformers' own Mixtral as `mxgraph train` builds it (its default grouped-GEMM
    experts, a custom op in fp32: counted through the ops inside it)."""
    overrides = TINY["mixtral"]
    cfg = TrainConfig(model="hf:mixtral",
                      model_config=",".join(f"{k}={v}" for k, v in overrides.items()))
    model = build_training_model(cfg)
    h, layers, seq_len = overrides["hidden_size"], overrides["num_hidden_layers"], 32
    kv = overrides["num_key_value_heads"] * h // overrides["num_attention_heads"]
    per_layer = (2 * h * h + 2 * kv * h + overrides["num_local_experts"] * h
                 + overrides["num_experts_per_tok"] * 3 * h * overrides["intermediate_size"])
    hand = 6 * (layers * per_layer + overrides["vocab_size"] * h) + 12 * layers * h * seq_len
    flops, uncounted = model_flops_per_token(model, tokens(), seq_len)
    assert uncounted == [] and flops == pytest.approx(hand, rel=FLOP_TOL)


def test_model_flops_and_the_compilers_cost_come_from_one_registry():
    """The telemetry's count of a running op and the compiler's of its traced node both come
    from `mxgraph.cost.FLOP_RULES`: a causal SDPA counts whole in model FLOPs, half in the
    compiler's; a matmul the same in both."""
    q = torch.randn(2, 4, 16, 8)
    attention = lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True)
    matmul = lambda q: q @ q.transpose(-1, -2)
    for fn, hand, ratio in ((attention, 2 * 2 * 4 * 16 * 16 * (8 + 8), 2),
                            (matmul, 2 * 2 * 4 * 16 * 16 * 8, 1)):
        with ForwardFlops() as counter:
            fn(q)
        compiled, _, unknown = graph_cost(make_fx(fn)(q))
        assert unknown == [] and counter.flops == hand == ratio * compiled


def test_mfu_is_model_flops_over_peak():
    assert mfu(6e9, 1000.0, 1.2e13) == 6e9 * 1000.0 / 1.2e13
    assert math.isnan(mfu(6e9, 1000.0, float("nan")))


def test_cpu_processes_share_one_machine_peak():
    """One process with every core and 2 or 4 processes sharing them are judged against
    the same machine (each process does not bring a peak of its own)."""
    import mxgraph.train.metrics
    from mxgraph.runtime.cluster.device import detect
    cpu = detect(torch.device("cpu"))
    machine = mxgraph.train.metrics.cpu_peak_flops()
    assert machine > 1e9  # any CPU that runs torch does a GFLOP/s of fp32 GEMM
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mxgraph.train.metrics, "cpu_peak_flops", lambda: 8e10)
        assert [mxgraph.train.metrics.device_peak(None, cpu, k) for k in (1, 2, 4)] == [
            ("measured fp32 GEMM", 8e10), ("measured fp32 GEMM", 4e10),
            ("measured fp32 GEMM", 2e10)]
    h100 = mxgraph.train.metrics.device_peak("h100-sxm", cpu, 4)  # a named profile: per process
    assert h100 == mxgraph.train.metrics.device_peak("h100-sxm", cpu, 1) and h100[1] > 1e14


# ---- runs with and without periodic validation ----------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(plain run, the same with --eval-every 2 --log-every 1 --log-dir, its log dir, the
    plain run without the FLOP count): compiled."""
    log_dir = str(tmp_path_factory.mktemp("metrics"))
    plain = train(TrainConfig(**RUN), progress=False)
    logged = train(TrainConfig(**RUN, eval_every=2, log_every=1, log_dir=log_dir), progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mxgraph.train.loop.count_flops", lambda *args: 1.0)
        uncounted = train(TrainConfig(**RUN), progress=False)
    return plain, logged, log_dir, uncounted


def test_the_flop_count_changes_nothing(runs):
    """The counted forward (eval mode, no gradients, random state put back) before the
    compile leaves the training as without it."""
    plain, _, _, uncounted = runs
    assert same_training(plain, uncounted) and plain["val_loss"] == uncounted["val_loss"]


def read_records(log_dir: str) -> list[dict]:
    with open(f"{log_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def same_training(a: dict, b: dict) -> bool:
    return a["train_loss"] == b["train_loss"] and a["parameters"].keys() == \
        b["parameters"].keys() and all(torch.equal(a["parameters"][k], b["parameters"][k])
                                       for k in a["parameters"])


def test_validation_during_training_changes_nothing(runs):
    plain, logged, log_dir, _ = runs
    assert same_training(plain, logged)
    assert plain["val_loss"] == logged["val_loss"]
    records = read_records(log_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [("val_loss" in r) for r in records] == [False, True, False, True]
    assert records[-1]["val_loss"] == logged["val_loss"]  # the last step's = the final evaluate


def test_records_hold_what_the_loop_computed(runs):
    _, logged, log_dir, _ = runs
    records = read_records(log_dir)
    with open(f"{log_dir}/run.json") as f:
        run = json.load(f)
    cfg = TrainConfig(**RUN)
    assert records[-1]["loss"] == logged["train_loss"]
    for r in records:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu",
                          "memory_peak_bytes", "memory_kind"}
        assert "dropped_fraction" not in r  # a dense model
        assert r["lr"] == lr_at(r["step"] - 1, cfg)
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        assert r["mfu"] == pytest.approx(run["flops_per_token"] * r["tokens_per_s"] * run[
            "data_parallel"] / (run["peak_flops_per_device"] * run["processes"]), rel=1e-12)
        assert r["memory_kind"] == "process_peak_rss"
        assert 0 < r["memory_peak_bytes"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert run["device_profile"] == "measured fp32 GEMM" and run["flops_per_token"] > 0
    assert logged["mfu"] == pytest.approx(run["flops_per_token"] * logged["tokens_per_s"] / run[
        "peak_flops_per_device"], rel=1e-12)


def test_tensorboard_holds_the_same_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, _, log_dir, _ = runs
    events = EventAccumulator(log_dir)
    events.Reload()
    records = read_records(log_dir)
    names = {k for r in records for k, v in r.items() if k != "step" and not isinstance(v, str)}
    assert set(events.Tags()["scalars"]) == names
    for name in names:
        logged = {r["step"]: r[name] for r in records if name in r}
        read = {e.step: e.value for e in events.Scalars(name)}
        assert read.keys() == logged.keys(), name
        for step, value in logged.items():  # TensorBoard keeps float32
            assert read[step] == pytest.approx(value, rel=1e-6), (name, step)


def test_eager_validation_changes_nothing(tmp_path):
    run = {**RUN, "steps": 2, "eager": True}
    plain = train(TrainConfig(**run), progress=False)
    logged = train(TrainConfig(**run, eval_every=1, log_dir=str(tmp_path), report_to="jsonl"),
                   progress=False)
    assert same_training(plain, logged)
    records = read_records(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["val_loss"] == logged["val_loss"]


def test_moe_records_the_dropped_fraction(tmp_path):
    """moe-tiny (2 layers, top-2 of 8 experts) drops nothing without a capacity: 0.0 in
    every record; under the plan's moe.capacity_factor a record holds the mean over the
    MoE blocks of what the step recorded (`Step.moe_stats()["dropped"]`, tested in
    tests/passes/test_moe_capacity.py)."""
    base = dict(model="moe-tiny", model_config="n_layers=2", steps=2, batch_size=2, seq_len=32,
                warmup=1, val_batches=1, log_every=1, eager=True)
    train(TrainConfig(**base, log_dir=str(tmp_path), report_to="jsonl"), progress=False)
    assert [r["dropped_fraction"] for r in read_records(str(tmp_path))] == [0.0, 0.0]
    metrics = RunMetrics(TrainConfig(**base), flops_per_token=1.0, peak=("cpu", 1.0), dp=1,
                         processes=1, device=torch.device("cpu"), moe="capacity",
                         evaluate=lambda: math.nan, rank=1, start_step=0)
    verdict = Verdict(action="update", step=0, loss=1.0, grad_norm=1.0)
    dropped = {"layers.1.mlp.experts": 0.5, "layers.2.mlp.experts": 0.25}
    record = metrics.train_record(1, verdict, 1, 1e-3, lambda: dropped)
    assert record["dropped_fraction"] == (0.5 + 0.25) / 2


def test_bad_flags_are_user_errors(monkeypatch, capsys, tmp_path):
    for flags, message in [({"eval_every": -1}, "--eval-every"), ({"log_every": 0}, "--log-every"),
                           ({"log_dir": "x", "report_to": "wandb"}, "--report-to"),
                           ({"device_profile": "tpu9"}, "tpu9"),
                           ({"log_dir": "/proc/no-such-dir", "report_to": "jsonl"}, "writable")]:
        with pytest.raises(UserError, match=message):
            check_metrics_flags(TrainConfig(**flags))
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed
    with pytest.raises(UserError, match=r"pip install mxgraph\[metrics\].*--report-to jsonl"):
        check_metrics_flags(TrainConfig(log_dir=str(tmp_path / "x")))
    check_metrics_flags(TrainConfig(log_dir=str(tmp_path / "j"), report_to="jsonl"))  # no TensorBoard
    assert cli_main(["train", "--log-dir", str(tmp_path / "m"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxgraph: error: --log-dir") and len(err.splitlines()) == 1
    assert not (tmp_path / "m").exists()  # nothing built, nothing written


# ---- 2 ranks --------------------------------------------------------------------------------
def _two_ranks(rank, world, tmp):
    """dp2 (the default plan on 2 processes), then pp2 (the loss lives on the last stage,
    rank 1; rank 0 writes what the pipeline broadcasts; each rank's stage trains bitwise as
    without the validations)."""
    base = dict(model="llama-tiny", model_config="n_layers=2,dim=64,ffn_dim=128", steps=2,
                batch_size=2, seq_len=32, warmup=1, val_batches=2, eval_every=1)
    with open(f"{tmp}/pp2.toml", "w") as f:
        f.write("pp = 2\nmicro_batches = 2\n")
    for name, plan, dp in (("dp2", None, 2), ("pp2", f"{tmp}/pp2.toml", 1)):
        cfg = TrainConfig(**base, plan=plan, log_dir=f"{tmp}/{name}-rank{rank}", log_every=1,
                          report_to="jsonl")
        result = train(cfg, progress=False)
        if rank != 0:
            continue
        records = read_records(cfg.log_dir)
        assert [r["step"] for r in records] == [1, 2], name
        assert records[-1]["loss"] == result["train_loss"], name
        assert records[-1]["val_loss"] == result["val_loss"], name
        with open(f"{cfg.log_dir}/run.json") as f:
            run = json.load(f)
        assert (run["data_parallel"], run["processes"]) == (dp, 2), name
    plain = TrainConfig(**{**base, "eval_every": 0}, plan=f"{tmp}/pp2.toml")
    assert same_training(train(plain, progress=False), result)  # result: pp2's, this rank's


@pytest.mark.slow
def test_two_ranks_only_rank_0_writes(tmp_path):
    run_ranks(2, _two_ranks, str(tmp_path))
    for name in ("dp2", "pp2"):
        assert (tmp_path / f"{name}-rank0" / "metrics.jsonl").exists()
        assert not (tmp_path / f"{name}-rank1").exists()
