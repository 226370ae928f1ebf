"""Every benchmark runs end to end at tiny sizes and writes what it promises.

Each test runs one benchmark's `main` (in this process, or as the script where it starts
processes of its own that must not outlive it) on llama-tiny or moe-tiny, one or two steps,
and checks its JSON: the rows it names, positive times, and the relations the benchmark
reports (estimate = measured bytes, 1F1B's bubble, ...). Multi-process ones are `slow`; rank
counts are 2 and links the plain loopback (`--rates none`, `--rate none`). Not run here, to
keep the file near 3 minutes on 2 cores: bench_comm's MoE plans and part 2 (gloo timing),
bench_memory's estimator, bench_search's calibrate and scale steps (about a minute each at
their fixed sizes). bench_kernels' kernel suite is tests/kernels/test_bench.py."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def load(monkeypatch, tmp_path):
    """load(name): benchmarks/<name>.py as a module, benchmarks/ on sys.path (as when run as
    a script); the test runs in tmp_path (what a benchmark or `mxgraph train` writes to a
    relative path lands there) on one torch thread (the other xdist worker shares the cores;
    two spinning OpenMP threads on a busy core run many times slower); afterwards the bench_*
    modules are forgotten and the thread count (which some benchmarks set) is restored."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = set(sys.modules)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module

    yield load
    for name in set(sys.modules) - before:
        if name.startswith("bench_"):
            del sys.modules[name]
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_checkpoint(tmp_path):
    """The floor's copy (`copy(buf=buf)`), mxgraph's saves and restores, the torch and DCP
    baselines and the monitor overhead, 10 MB of state. As the script: its saver and DCP's
    checkpoint process must not outlive it."""
    out = tmp_path / "checkpoint.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_checkpoint.py"), "--sizes", "0.01",
                    "--dir", str(tmp_path / "ck"), "--json", str(out), "--monitor-steps", "1"],
                   check=True, timeout=600, cwd=tmp_path, env=env)
    data = json.loads(out.read_text())
    row = data["sizes"]["0.01"]
    for case in ("floor", "mxgraph cold", "mxgraph warm", "mxgraph background: blocking in all",
                 "mxgraph persist", "restore mxgraph memory", "restore mxgraph disk (page cache)",
                 "torch.save", "torch.save + fsync", "restore torch.load", "dcp.save",
                 "dcp.async_save thread", "dcp.async_save process"):
        assert row[case] > 0, case
    monitor = data["monitor"]
    assert monitor["step_ms"] > 0 and monitor["section_cost_us"] > 0


def test_comm(load, tmp_path):
    """Part 1 (graph vs formula) for llama-tiny under tp2: the graph's bytes are the formula's."""
    out = tmp_path / "comm.json"
    assert load("bench_comm").main(["--models", "llama-tiny", "--plans", "tp2", "--seq-len", "32",
                                    "--no-timing", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (result,) = data["comm"]
    assert (result["model"], result["plan"], result["seq"]) == ("llama-tiny", "tp2", 32)
    (row,) = result["rows"]
    assert (row["axis"], row["kind"], row["ok"]) == ("tp", "all_reduce", True)
    assert row["graph_bytes"] == row["formula_bytes"] > 0
    assert data["differ"] == [] and data["timing"] == []


@pytest.mark.slow
def test_gpu_check_tiny_and_compile(load, tmp_path):
    """benchmarks/gpu_check.sh --tiny: the kernel table (each fused op checked against
    eager, fp32: within 1e-6 relative on the CPU, where the ops take their references,
    which sum a few values in another order) and bench_compile's eager
    and mxgraph runners (inductor left out: its C++ build takes minutes), one subprocess
    each, with --profile's top ops."""
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--tiny", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kernels = json.loads((tmp_path / "kernels.json").read_text())["results"]
    checked = [r for r in kernels if "err" in r]
    assert {r["kernel"] for r in checked} >= {"swiglu", "rmsnorm", "gqa_attention", "moe_router"}
    assert all(r["ok"] and r["err"] <= 1e-6 for r in checked), checked
    rows = json.loads((tmp_path / "compile.json").read_text())["rows"]
    assert [r["runner"] for r in rows] == ["eager", "mxgraph-python", "mxgraph-python-fusion"]
    assert all(r["step_ms"] > 0 and r["compile_s"] >= 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["params"] == rows[1]["params"] > 0
    for row in rows:  # --profile 5: the 5 ATen ops with the most self time a step
        assert len(row["top_ops"]) == 5 and row["ops_per_step"] >= 5, row
        times = [ms for _, ms, _ in row["top_ops"]]
        assert times == sorted(times, reverse=True) and all(name.startswith("aten::")
                                                            for name, _, _ in row["top_ops"])
    with pytest.raises(SystemExit):  # an unknown runner is named, not skipped
        load("bench_compile").main(["--runners", "eager,torch"])


def test_compile_side_by_side_pairs_the_runners_pass_by_pass(load):
    """bench_compile's one-process mode: every runner built on its own copy of the model
    (the same weights), P passes of one step each; a runner's ratio is the median of the
    base's step over its own in the same pass."""
    bench = load("bench_compile")
    times = bench.side_by_side("llama-tiny", ["eager", "mxgraph-python"], 3, batch_size=2,
                               seq_len=16, layers=1)
    assert sorted(times) == ["eager", "mxgraph-python"]
    assert all(len(ms) == 3 and min(ms) > 0 for ms in times.values())
    assert bench.paired(times, "eager", "eager") == 1.0
    assert bench.paired({"a": [2.0, 4.0, 9.0], "b": [1.0, 4.0, 3.0]}, "b", "a") == 2.0
    assert bench.paired(times, "eager", "inductor") is None


def test_kernels_llama_fusion(load, tmp_path):
    """The end-to-end suite (`run(step=step)`): llama-tiny on the CPU, fusion off and on."""
    out = tmp_path / "fusion.json"
    assert load("bench_kernels").main(["--smoke", "--suite", "llama1b_fusion", "--out",
                                       str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["unfused", "fused"]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["loss_gap"] < 1e-4  # the CPU runs the fused ops' reference code


def test_memory(load, tmp_path, monkeypatch):
    """The CPU part on llama-tiny: every policy's measured saved bytes equal its estimate,
    recompute and offload save less than none."""
    # bench_memory sets OMP_NUM_THREADS at import when unset: undone after the test
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    out = tmp_path / "memory.json"
    assert load("bench_memory").main(["--models", "llama-tiny", "--batch", "1", "--seq", "16",
                                      "--steps", "1", "--skip-estimator", "--json",
                                      str(out)]) == 0
    rows = {r["runner"]: r for r in json.loads(out.read_text())["cpu"]["llama-tiny"]}
    assert len(rows) == 9 and all(r["step_s"] > 0 for r in rows.values())
    compiled = [r for name, r in rows.items() if name.startswith("mxgraph")]
    assert all(r["saved"] == r["estimate"] for r in compiled)
    none = rows["mxgraph none"]["saved"]
    assert rows["mxgraph recompute=full"]["saved"] < rows["mxgraph recompute=norm,act"]["saved"] < none
    assert rows["mxgraph offload=all"]["host"] > 0.9 * none > rows["mxgraph offload=all"]["saved"]
    assert rows["eager+checkpoint(layers)"]["saved"] < rows["eager"]["saved"]


@pytest.mark.slow
def test_moe(load, tmp_path):
    """2 ranks (ep2) of moe-tiny, row "all together" under balanced and skewed routing
    (`train_step(opt=opt)`), the calibration, the expert kernels and the report."""
    out = tmp_path / "moe.json"
    result = load("bench_moe").main(["--rates", "none", "--model", "moe-tiny", "--nproc", "2",
                                     "--steps", "1", "--batch-size", "1", "--seq-len", "16",
                                     "--rows", "all together", "--kernel-reps", "1",
                                     "--calibration-steps", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert result["links"] == {"none": "unshaped loopback"}
    rows = result["rows"]
    assert [(r["routing"], r["row"]) for r in rows] == [("balanced", "all together"),
                                                        ("skewed", "all together")]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["step_s"] > 0 and r["comm_ms"] > 0 and r["a2a_bytes"] > r["a2a_off_rank_bytes"] > 0
        assert r["dropped"] is not None  # capacity_factor is on
    assert rows[1]["share_experts_0_1"] > rows[0]["share_experts_0_1"]
    kernels = result["expert_kernels"]
    assert kernels["N"] == 2 * 1 * 16 * 2  # nproc x batch x seq tokens, topk 2 each
    assert all(ms > 0 for routing in ("balanced", "skewed") for ms in kernels[routing]["ms"].values())
    assert len(result["reference"]) == 5 and (tmp_path / "moe_traces").is_dir()


def test_moe_worker_group_ends_before_exit(tmp_path):
    """bench_moe's rank joins its group with mxgraph already imported, so that
    `destroy_process_group` ends it: no gloo thread is left to be torn down during the
    interpreter's finalization (issue #47). One rank in a process of its own (this one has
    mxgraph imported long ago); its threads by name from /proc."""
    from tests.distributed import free_port
    port = free_port()
    code = ("import os, torch.distributed as dist, bench_moe\n"
            "bench_moe.join_group(60)\n"
            "import models, mxgraph  # what the rows import\n"
            "dist.destroy_process_group()\n"
            "print([open(f'/proc/self/task/{t}/comm').read().strip()"
            " for t in os.listdir('/proc/self/task')])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(BENCHMARKS)]),
           "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env, check=True)
    threads = done.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads and "pt_tcpstore" not in threads, threads


def test_moe_kernels(load):
    """moe-tiny's experts (E = 8) over 16 tokens x topk 2 rows, grouped GEMM, bmm and loop."""
    result = load("bench_moe_kernels").main(["--model", "moe-tiny", "--kernel-tokens", "16",
                                             "--kernel-reps", "1"])
    assert (result["E"], result["N"]) == (8, 32)
    for routing in ("balanced", "skewed"):
        assert set(result[routing]["ms"]) == {"grouped_mm", "bmm", "loop"}
        assert all(ms > 0 for ms in result[routing]["ms"].values())
        assert result[routing]["rows_computed"]["bmm"] == result["E"] * result["C"]


def test_moe_report(load):
    """compare() against hand-made rows: each reference's measured ratio."""
    report = load("bench_moe_report")

    def row(routing, name, step_s, a2a_exposed_ms=0.0):
        return {"rate": "none", "routing": routing, "row": name, "step_s": step_s,
                "a2a_exposed_ms": a2a_exposed_ms}
    rows = [row("skewed", "off", 2.0), row("skewed", "hot experts", 1.6),
            row("balanced", "off", 1.5), row("balanced", "capacity bmm", 1.2),
            row("balanced", "overlap only", 1.1, 40.0), row("balanced", "a2a overlap", 1.0, 10.0)]
    measured = {r["what"]: r["measured"] for r in report.compare(
        rows, {"balanced": {"grouped_over_bmm": 1.3}})}
    assert measured == pytest.approx({"hot experts": 0.25, "capacity bmm": 0.3,
                                      "capacity bmm, step": 0.25, "a2a overlap": 0.1,
                                      "a2a overlap hidden": 0.75})


def test_monitor(load, tmp_path):
    """Every variant, one report interval each: levels 1 and 2 time points, level 0 only
    sections."""
    out = tmp_path / "monitor.json"
    load("bench_monitor").main(["--model", "llama-tiny", "--steps", "1", "--report-every", "1",
                                "--batch-size", "1", "--seq-len", "16", "--device", "cpu",
                                "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["off", "off_again", "level0", "level1", "level2"]
    assert all(r["median_ms"] > 0 and r["cpu_median_ms"] > 0 for r in rows.values())
    assert rows["off"]["timing_points"] == rows["level0"]["timing_points"] == 0
    assert rows["level1"]["timing_points"] > 0 and rows["level2"]["timing_points"] > 0
    assert rows["level0"]["sections"] > 0 and rows["off"]["self_ms"] == 0
    assert data["call_costs_us"]["section_us"] > 0


def test_nonfinite(load, tmp_path):
    """Each variant times its steps; only the guard's has a self time (check_health)."""
    out = tmp_path / "nonfinite.json"
    load("bench_nonfinite").main(["--model", "llama-tiny", "--batch-size", "1", "--seq-len",
                                  "16", "--rounds", "1", "--steps-per-round", "1",
                                  "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["off", "off_again", "guard"]
    assert all(r["step_ms"] > 0 and r["steps"] == 1 for r in rows.values())
    assert rows["guard"]["self_ms"] > 0 and rows["off"]["self_ms"] == 0


@pytest.mark.slow
def test_overlap(load, tmp_path):
    """2 ranks on the plain loopback, pp2 1f1b with overlap off and on
    (`train_step(step=step, opt=opt)`), and torch's Schedule1F1B beside."""
    out = tmp_path / "overlap.json"
    rows = load("bench_overlap").main(["--rates", "none", "--model", "llama-tiny", "--layouts",
                                       "pp2 1f1b", "--steps", "1", "--batch-size", "4",
                                       "--seq-len", "16", "--micro-batches", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [(r["layout"], r["overlap"]) for r in rows] == [
        ("pp2 1f1b", "off"), ("pp2 1f1b", "on"), ("pp2 1f1b", "torch Schedule1F1B")]
    assert all(r["rate"] == "none" and r["step_s"] > 0 and r["comm_ms"] > 0 for r in rows)
    assert all(0 <= r["hidden"] <= 1 and "send/recv" in r["by_kind"] for r in rows)
    assert len(list((tmp_path / "overlap_traces").glob("*.rank[01].json"))) == 2 * len(rows)


def test_pipeline(load, tmp_path):
    """The simulated parts: 1F1B's bubble is (p - 1) / (m + p - 1), the DeepSeek-V3 layouts."""
    out = tmp_path / "pipeline.json"
    load("bench_pipeline").main(["--out", str(out)])
    data = json.loads(out.read_text())
    rows = data["simulated_schedules"]
    assert len(rows) == 3 * 3 * 5
    for r in rows:
        if r["schedule"] == "1f1b":
            p, m = r["pp"], r["microbatches"]
            assert r["bubble_ratio"] == pytest.approx((p - 1) / (m + p - 1))
        assert "skipped" in r or 0 <= r["bubble_ratio"] < 1
    layouts = data["deepseek_v3_layout"]["layouts"]
    assert set(layouts) == {"padded_64", "uneven_by_count_vpp2", "balanced_vpp2", "balanced_vpp1"}
    assert all(r["step_time"] > 0 for r in layouts.values())


@pytest.mark.slow
def test_pipeline_real(load, tmp_path):
    """2 ranks, llama-tiny's 4 layers: every mxgraph schedule (`mx_step`) and its torch peer
    (`torch_step`)."""
    out = tmp_path / "pipeline_real.json"
    rows = load("bench_pipeline_real").main(["--model", "llama-tiny", "--layers", "4", "--nproc",
                                             "2", "--microbatches", "4", "--batch-size", "4",
                                             "--seq-len", "16", "--steps", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [(r["schedule"], r["peer"]) for r in rows] == [
        ("1f1b", "Schedule1F1B"), ("interleaved", "ScheduleInterleaved1F1B"),
        ("zbh1", "ScheduleInterleavedZeroBubble"), ("dualpipev", "ScheduleDualPipeV")]
    assert all(r["mxgraph_s"] > 0 and r["torch_s"] > 0 for r in rows)


@pytest.mark.slow
def test_search(load, tmp_path):
    """Step 1 measures one plan (llama-tiny, 2 ranks, plain loopback); a second run reads it
    back from --out and predicts it with the built-in cpu profile."""
    out = tmp_path / "search.json"
    common = ["--rate", "none", "--nproc", "2", "--plans", "llama dp4", "--llama-model",
              "llama-tiny", "--steps", "3", "--warmup", "1", "--global-batch", "4", "--seq-len",
              "16", "--out", str(out)]
    bench = load("bench_search")
    assert bench.main(["--skip", "calibrate,predict,scale", *common]) == 0
    (measured,) = json.loads(out.read_text())["measured"]
    assert "error" not in measured, measured["error"]
    assert measured["model"] == "llama-tiny" and measured["batch_per_dp_rank"] == 2
    assert [r["rank"] for r in measured["ranks"]] == [0, 1]
    assert measured["step_s"] > 0 and measured["peak_bytes"] > 0
    assert bench.main(["--skip", "measure,calibrate,scale", "--device", "cpu", *common]) == 0
    results = json.loads(out.read_text())
    (row,) = results["measured"]
    assert row["predicted"]["step_s"] > 0 and row["predicted"]["peak_memory_gib"] > 0
    summary = results["summary"]
    assert summary["plans"] == 1 and summary["spearman"] is None  # one plan: no order
    top1 = summary["top1"]["llama-tiny"]
    assert top1["best_measured"] == "llama dp4" and top1["top1"]["step_s"] > 0


def test_published_runs_well_formed(load):
    """Every row of published_runs.toml: a built-in device, a model that builds (meta) at
    about its source's size, a layout whose axes divide the GPUs and the batch, a source
    and a positive published figure; row names unique (load_runs checks fields and types)."""
    import models
    from mxgraph.devices.catalog import BUILTIN
    bench = load("bench_search_published")
    runs = bench.load_runs()
    assert len(runs) >= 20
    assert {"DeepSeek-V3 pre-training", "Llama 2 7B pre-training"} <= {r["what"] for r in runs}
    for run in runs:
        assert run["device"] in BUILTIN, run["what"]
        model = models.build_from_config(bench.model_config(run, models), device="meta")
        assert models.count_params(model) > 1e9, run["what"]
        plan, mbs, dp = bench.plan_of(run)
        assert dp * plan.tp * plan.pp * plan.cp == run["gpus"], run["what"]
        passes = run["layout"].get("passes", 1)
        assert dp * mbs * plan.micro_batches * passes == run["global_batch"], run["what"]
        assert run["published_tokens_per_s_per_gpu"] > 0 and len(run["source"]) > 40
        assert run["precision"] in ("bf16", "fp16", "fp8"), run["what"]


def test_pipeline_passes_repeat_all_but_the_optimizer(load):
    """A row with `passes` (gradient accumulation around the pipeline schedule) is priced
    as that many steps of its batch / passes, the optimizer once: its tokens/s/GPU against
    the one-pass prediction of the same plan, from their step times."""
    import models
    bench = load("bench_search_published")
    run = next(r for r in bench.load_runs() if r["layout"].get("passes", 1) > 1)
    passes = run["layout"]["passes"]
    small = {**run, "model": "llama-tiny", "device": "h100-sxm", "gpus": 16,
             "global_batch": 16 * passes, "seq_len": 128, "fsdp": True,
             "layout": {"pp": 2, "zero1": True, "overlap": True, "mbs": 1, "passes": passes}}
    row = bench.predict_run(small, models)
    one = bench.predict_run({**small, "global_batch": 16, "layout": {
        k: v for k, v in small["layout"].items() if k != "passes"}}, models)
    optimizer = one["breakdown_s"]["optimizer"]
    assert optimizer > 0
    assert row["predicted_step_s"] == pytest.approx(
        passes * (one["predicted_step_s"] - optimizer) + optimizer, rel=1e-9)
    assert row["predicted_tokens_per_s_per_gpu"] == pytest.approx(
        16 * passes * 128 / row["predicted_step_s"] / 16, rel=1e-9)
    assert sum(row["breakdown_s"].values()) == pytest.approx(row["predicted_step_s"], rel=1e-9)
    assert row["layout"].endswith(f"x{passes}")


def test_search_published(load, tmp_path, capsys):
    """Three rows (one family of two): the printed table has each row's published and
    predicted figures and error, the summary and the family's order; the JSON the same."""
    out = tmp_path / "search_published.json"
    names = ["torchtitan Llama 3.1 8B, 8 H100", "torchtitan Llama 3.1 8B, 128 H100",
             "MPT-7B, 8 A100"]
    bench = load("bench_search_published")
    assert bench.main([arg for name in names for arg in ("--run", name)] + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["what"] for r in data["rows"]] == names
    for row in data["rows"]:
        assert row["predicted_tokens_per_s_per_gpu"] > 0
        assert row["error"] == pytest.approx(row["predicted_tokens_per_s_per_gpu"]
                                             / row["published_tokens_per_s_per_gpu"] - 1)
        line = next(line for line in printed.splitlines() if line.startswith(row["what"]))
        assert f"{row['published_tokens_per_s_per_gpu']:.1f}" in line
        assert f"{row['predicted_tokens_per_s_per_gpu']:.1f}" in line and f"{row['error']:+.1%}" in line
    summary = data["summary"]
    errors = sorted(abs(r["error"]) for r in data["rows"])
    assert summary["rows"] == 3 and summary["median_abs_error"] == pytest.approx(errors[1])
    assert summary["max_abs_error"] == pytest.approx(errors[-1])
    assert f"median |error| {errors[1]:.1%}" in printed
    (family,) = summary["families"]  # MPT-7B alone in its family: not ordered
    assert family == "torchtitan-h100-llama3-8b" and f"family {family}: order" in printed
    assert summary["families"][family]["published_order"] == names[:2]


@pytest.mark.slow
def test_load_memory(load, tmp_path):
    """Two ranks load a small saved Llama under tp=2: each reports its memory, and holds
    about half the model (norms whole, every matrix and the embeddings halved)."""
    out = tmp_path / "load_memory.json"
    load("bench_load_memory").main(["--hidden", "256", "--layers", "1", "--vocab", "1024",
                                    "--intermediate", "512", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for row in data["ranks"]:
        assert 0.45 * data["model_mib"] < row["held_parameters_mib"] < 0.55 * data["model_mib"]
        assert row["peak_during_load_mib"] >= row["rss_after_compile_mib"] > 0


def test_bench_search_gpu_tiny(load, tmp_path):
    """bench_search_gpu (issue #31's check on a GPU) on the CPU: calibrate, search, predict
    and train one layout; the row holds a prediction and a measurement, and the plan run is
    the search's top plan with full recompute."""
    bench = load("bench_search_gpu")
    code = bench.main(["--model", "llama-tiny", "--layers", "1", "--global-batch", "2",
                       "--seq-len", "32", "--steps", "4", "--warmup", "2", "--quick",
                       "--layouts", "full", "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "search_gpu.json").read_text())
    assert code == 0 and [r["layout"] for r in rows] == ["full recompute"], rows
    assert rows[0]["predicted_s"] > 0 and rows[0]["measured_s"] > 0
    assert rows[0]["predicted_gib"] > 0 and rows[0]["measured_gib"] > 0
    plan = (tmp_path / "out" / "full_recompute.toml").read_text()
    assert 'recompute = "full"' in plan.splitlines()
    model = (tmp_path / "out" / "model.toml").read_text()
    assert 'family = "llama"' in model and "n_layers = 1" in model
