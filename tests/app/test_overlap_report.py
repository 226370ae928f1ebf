"""mxgraph/train/overlap_report.py: exposed and total communication time on a hand-written trace
(numbers computed by hand), on real 2-rank gloo traces (an async all-reduce hidden behind
matmuls exposes less than a synchronous one), and `mxgraph inspect --overlap`."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mxgraph.cli.main import main as cli_main
from mxgraph.train.overlap_report import format_table, overlap_summary, plot_timeline

ROOT = Path(__file__).resolve().parents[2]
MAIN, WORKER = 7, 8  # the main thread's tid is the pid; a gloo worker thread


def op(name, start, end, tid=MAIN, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": MAIN, "tid": tid, "ts": start,
            "dur": end - start, "args": {}}


def gloo(name, start, end, tid=WORKER):
    return op(name, start, end, tid=tid, cat="user_annotation")


HAND_TRACE = [  # times in µs
    op("ProfilerStep#2", 0, 600, cat="user_annotation"),  # spans everything: no compute
    op("aten::mm", 0, 100),
    # async all-reduce: issued at 100, on the worker 110-310, compute 110-250, idle 250-310
    op("c10d::allreduce_", 100, 110), gloo("gloo:all_reduce", 110, 310),
    op("aten::mm", 110, 250),
    # functional all-reduce: its clone is no compute; on a second worker 330-430; compute
    # 330-350, then wait_tensor blocks 350-430
    op("_c10d_functional::all_reduce", 320, 330), op("aten::clone", 321, 329),
    op("c10d::allreduce_", 329, 330), gloo("gloo:all_reduce", 330, 430, tid=WORKER + 1),
    op("aten::add", 330, 350), op("_c10d_functional::wait_tensor", 350, 430),
    # a reduce-scatter runs as a gloo:all_reduce, hidden behind a mul whose child is compute
    op("c10d::_reduce_scatter_base_", 440, 445), gloo("gloo:all_reduce", 445, 495),
    op("aten::mul", 445, 495), op("aten::empty", 446, 447),
    # a send: posted at 500, its gloo:send span on the main thread until 520, nothing else
    op("c10d::send", 500, 505), gloo("gloo:send", 502, 520, tid=MAIN),
]


def test_hand_written_trace_by_hand(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": HAND_TRACE, "distributedInfo": {"rank": 3}}))
    summary = overlap_summary(path)
    # all_reduce: 200 + 100 µs of transfer; exposed 60 (idle 250-310) + 80 (wait 350-430)
    assert summary["kinds"]["all_reduce"] == {"count": 2, "total_ms": 0.3, "exposed_ms": 0.14,
                                              "hidden_fraction": pytest.approx(1 - 140 / 300)}
    assert summary["kinds"]["reduce_scatter"] == {"count": 1, "total_ms": 0.05,
                                                  "exposed_ms": 0.0, "hidden_fraction": 1.0}
    # the send counts from its post (500) to the end of its gloo:send span (520), exposed
    assert summary["kinds"]["send/recv"] == {"count": 1, "total_ms": 0.02, "exposed_ms": 0.02,
                                             "hidden_fraction": 0.0}
    assert summary["all"]["count"] == 4
    assert summary["all"]["total_ms"] == pytest.approx(0.37)
    assert summary["all"]["exposed_ms"] == pytest.approx(0.16)
    # compute: 0-100, 110-250, 330-350, 445-495 (the clone inside the collective is not)
    assert summary["compute_ms"] == pytest.approx(0.31)
    assert (summary["rank"], summary["compute_lane"], summary["window_ms"]) == (3, "cpu", 0.6)
    assert summary["comm_wall_ms"] == pytest.approx(0.37)
    json.dumps(summary)  # JSON-able
    table = format_table(summary)
    assert "reduce_scatter" in table and "53.3%" in table  # all_reduce hidden 160/300
    plot_timeline([path], tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


def test_gpu_trace_uses_kernels():
    """On a cuda trace the lanes are GPU kernels: nccl*/mccl* ones are communication."""
    trace = [op("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 0, 100, tid=20, cat="kernel"),
             op("ampere_sgemm_128x64_nn", 50, 80, tid=21, cat="kernel"),
             op("mcclDevKernel_AllGather_RING(x)", 200, 240, tid=20, cat="kernel"),
             op("c10d::allreduce_", 0, 5)]  # the CPU side's busy time is no compute here
    from mxgraph.train.overlap_report import analyse
    transfers, compute, lane = analyse(trace)
    assert lane == "gpu" and compute == [(50.0, 80.0)]
    assert [(t.kind, t.exposed) for t in transfers] == [("all_reduce", 70.0),
                                                        ("all_gather", 40.0)]


# rank 0 profiles three phases of three 8 MB all-reduces each: synchronous, then matmuls;
# asynchronous, matmuls until it completes, then wait; functional, a few matmuls, then
# wait_tensor. Rank 1 only takes part (a synchronous all-reduce: no compute of its own
# competes with the transfer threads for this machine's cores)
SCRIPT = textwrap.dedent("""
    import contextlib
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, out = dist.get_rank(), sys.argv[1]
    x, a = torch.randn(2 * 2**20), torch.randn(256, 256)

    def compute_until(done, limit):
        for _ in range(limit):
            a @ a
            if done():
                return

    def synchronous():
        dist.all_reduce(x)
        compute_until(lambda: False, limit=5)

    def overlapped():
        work = dist.all_reduce(x, async_op=True)
        compute_until(work.is_completed, limit=5000)
        work.wait()

    def functional():
        c10d = torch.ops._c10d_functional
        y = c10d.all_reduce(x, "sum", dist.group.WORLD.group_name)
        compute_until(lambda: False, limit=5)
        c10d.wait_tensor(y)

    def take_part():
        dist.all_reduce(x)

    for phase in (synchronous, overlapped, functional):
        run = phase if rank == 0 else take_part
        run()  # warm-up
        dist.barrier()
        prof = profile(activities=[ProfilerActivity.CPU]) if rank == 0 else None
        with prof or contextlib.nullcontext():
            for _ in range(3):
                run()
        if rank == 0:
            prof.export_chrome_trace(f"{out}/{phase.__name__}.json")
        dist.barrier()
    dist.destroy_process_group()
    # the traces are written and the group is gone; leave without interpreter finalization,
    # where gloo's worker threads can still hold an async work's tensors and the GIL acquire
    # of their release aborts the process (torch issue 190489, PR 179291; seen once in CI)
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.slow
def test_async_all_reduce_exposes_less_than_a_synchronous_one(tmp_path):
    script = tmp_path / "overlap.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(script), str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {name: overlap_summary(tmp_path / f"{name}.json")["kinds"]["all_reduce"]
            for name in ("synchronous", "overlapped", "functional")}
    assert all(row["count"] == 3 and row["total_ms"] > 0 for row in rows.values()), rows
    assert rows["overlapped"]["exposed_ms"] < rows["synchronous"]["exposed_ms"], rows
    # unloaded, the asynchronous one hides well over half its transfer; a busy machine (the
    # suite's other worker running a multi-process drill) starves the matmul loop of a core,
    # and the gaps between matmuls count as exposed: the margin asked for is the robust part
    assert rows["synchronous"]["hidden_fraction"] < 0.5, rows
    assert rows["overlapped"]["hidden_fraction"] > rows["synchronous"]["hidden_fraction"] + 0.2, rows
    # the functional one runs its transfer under 100 matmuls, then waits in wait_tensor
    assert rows["functional"]["hidden_fraction"] > 0, rows


def test_inspect_overlap_prints_the_table_and_draws(tmp_path, capsys):
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": HAND_TRACE}))
    assert cli_main(["inspect", "--overlap", str(tmp_path), "--png", str(tmp_path / "o.png")]) == 0
    out = capsys.readouterr().out
    assert "all_reduce" in out and "exposed ms" in out and (tmp_path / "o.png").exists()


@pytest.mark.parametrize("content, message", [
    (None, "no trace at"),
    ("not json", "is not a profiler trace"),
    ('{"events": []}', "not a Chrome trace: it has no traceEvents"),
])
def test_inspect_overlap_errors_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    assert cli_main(["inspect", "--overlap", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_train_profile_skips_two_warm_up_steps(tmp_path, capsys):
    """`mxgraph train --profile DIR` records --profile-steps steps after 2 warm-up steps."""
    out = tmp_path / "prof"
    assert cli_main(["train", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
                     "--val-batches", "1", "--no-progress", "--model-config", "n_layers=1",
                     "--eager", "--profile", str(out), "--profile-steps", "1"]) == 0
    assert f"mxgraph inspect --overlap {out}" in capsys.readouterr().out
    events = json.loads((out / "rank0.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e["name"].startswith("ProfilerStep")} == \
        {"ProfilerStep#2"}
    summary = overlap_summary(out / "rank0.json")  # one process: no communication
    assert summary["kinds"] == {} and summary["all"]["count"] == 0
    assert summary["all"]["hidden_fraction"] is None and summary["compute_ms"] > 0
