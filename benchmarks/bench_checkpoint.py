"""Flash checkpoint benchmark: how long a save blocks training, and restore times.

For each state size (GB of fp32 tensors in 64 MB pieces) it measures the time the caller
is blocked by one save with
  floor            a plain copy into pre-allocated, already-faulted /dev/shm
  mxgraph          FlashCheckpointer.save, saver process (cold = first use of a slot,
                   warm = slot reused; persist = warm save that also asks for a disk write;
                   background = save(background=True), as mxgraph train saves: the copy
                   runs in a thread while this thread computes for as long as a warm copy
                   takes (the next step's forward and backward), then wait_copied() - the
                   optimizer's fence; blocking in all = the two waits; the median of
                   REPEATS such saves)
  torch.save       to a file (page cache), and with fsync (durable, as a checkpoint must be)
  dcp.save         torch.distributed.checkpoint.save
  dcp.async_save   thread and process checkpointers, default staging
and the time to restore with mxgraph from memory and from disk (page cache warm), both
into the live tensors (`restore(into=state)`), and with torch.load (new tensors). Ratios are
against the floor. It also measures the level-0 monitor's overhead
as a % of llama-tiny's step time.

    python benchmarks/bench_checkpoint.py --sizes 0.1,1 --json bench_results/checkpoint.json

Memory: a size S needs about 3*S GB free (state, two shm slots) plus slack; sizes that do
not fit in MemAvailable are skipped with a note.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mxgraph.runtime.checkpoint import disk, saver  # noqa: E402
from mxgraph.runtime.checkpoint.flash import FlashCheckpointer  # noqa: E402
from mxgraph.runtime.monitor.slow_node import StepMonitor  # noqa: E402

CHUNK = 16 << 20  # fp32 elements per tensor (64 MB)
REPEATS = 5  # background saves per size; the median is reported


def make_state(gb: float) -> dict:
    n = int(gb * (1 << 30)) // 4
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    return {"model": {f"w{i}": torch.full((k,), float(i)) for i, k in enumerate(sizes)}}


def flat(state: dict) -> dict:
    return {f"model/{k}": v for k, v in state["model"].items()}


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / (1 << 20)
    return float("inf")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compute(seconds: float) -> None:
    """Keep this thread busy with matrix products for `seconds` (a training step's work)."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


def bench_floor(state: dict) -> float:
    tensors = list(state["model"].values())
    total = sum(t.numel() * 4 for t in tensors)
    path = f"/dev/shm/mxgraph-bench-floor-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, total)
        buf = torch.frombuffer(mmap.mmap(fd, total, flags=mmap.MAP_SHARED), dtype=torch.uint8)

        def copy(buf=buf):
            off = 0
            for t in tensors:
                nb = t.numel() * 4
                buf[off:off + nb].view(torch.float32).copy_(t)
                off += nb
        copy()  # fault the pages in
        return timed(copy)
    finally:
        del buf
        os.close(fd)
        os.unlink(path)


def bench_mxgraph(state: dict, root: str) -> dict:
    out = {}
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    ck = FlashCheckpointer(os.path.join(root, run_id), run_id=run_id, saver="process",
                           persist_every=1 << 30, keep=1)
    out["mxgraph cold"] = ck.save(1, state, persist=False).blocking_s
    out["mxgraph reserve (once, before training)"] = ck.reserve(state)
    out["mxgraph first save after reserve"] = ck.save(2, state, persist=False).blocking_s
    out["mxgraph warm"] = ck.save(3, state, persist=False).blocking_s
    busy_s = out["mxgraph warm"]
    returns, waits = [], []
    for _ in range(REPEATS):  # the median of several: one sample is at the mercy of the host
        res = ck.save(3, state, persist=False, background=True)
        compute(busy_s)  # the next step's forward and backward, as long as a copy
        waits.append(ck.wait_copied())
        returns.append(res.blocking_s)
    out["mxgraph background: save returns"] = statistics.median(returns)
    out["mxgraph background: wait after a step as long as a copy"] = statistics.median(waits)
    out["mxgraph background: blocking in all"] = statistics.median(
        r + w for r, w in zip(returns, waits, strict=True))
    while saver.saver_pid(run_id) is None:  # time the disk write, not the saver's start-up
        time.sleep(0.01)
    t0 = time.perf_counter()
    res = ck.save(4, state, persist=True)
    out["mxgraph persist"] = res.blocking_s
    ck.wait_persisted(timeout_s=3600)
    while not disk.is_committed(disk.step_dir(ck.directory, 4)):
        time.sleep(0.005)
    out["mxgraph to disk (async, not blocking)"] = time.perf_counter() - t0
    again = FlashCheckpointer(ck.directory, run_id=run_id, saver="none")  # a restarted rank
    t0 = time.perf_counter()
    got = again.restore(into=state)  # the trainer's way: fill the live tensors in place
    out["restore mxgraph memory"] = time.perf_counter() - t0
    assert got.source == "memory" and got.step == 4
    del got
    for s in again.slots:  # shares ck's files: close, do not unlink
        s.close()
    again.slots.clear()
    other = FlashCheckpointer(ck.directory, run_id=run_id + "-b", saver="none")
    t0 = time.perf_counter()
    got = other.restore(into=state)
    out["restore mxgraph disk (page cache)"] = time.perf_counter() - t0
    assert got.source == "disk" and got.step == 4
    del got
    other.close()
    ck.close()
    shutil.rmtree(ck.directory)
    return out


def bench_baselines(state: dict, root: str) -> dict:
    out = {}
    path = os.path.join(root, "torch_save.pt")
    out["torch.save"] = timed(lambda: torch.save(state, path))
    os.unlink(path)

    def durable():  # what a checkpoint that survives a crash of the node needs
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    out["torch.save + fsync"] = timed(durable)
    t0 = time.perf_counter()
    loaded = torch.load(path)
    out["restore torch.load"] = time.perf_counter() - t0
    del loaded
    os.unlink(path)
    gc.collect()
    out["dcp.save"] = timed(lambda: dcp.save(flat(state), checkpoint_id=os.path.join(root, "dcp")))
    shutil.rmtree(os.path.join(root, "dcp"))
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        cid = os.path.join(root, f"dcp_async_{kind.value}")
        t0 = time.perf_counter()
        fut = dcp.async_save(flat(state), checkpoint_id=cid, async_checkpointer_type=kind)
        out[f"dcp.async_save {kind.value}"] = time.perf_counter() - t0
        (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
        shutil.rmtree(cid)
        gc.collect()
    return out


def bench_monitor(steps: int, blocks: int) -> dict:
    import models
    torch.manual_seed(0)
    model = models.build_model("llama-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = StepMonitor()

    def run(monitored: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            if monitored:
                with mon.section("data"):
                    tok = torch.randint(0, 256, (4, 64))
                with mon.section("forward"):
                    loss = model(tok, torch.roll(tok, -1, 1))
                with mon.section("backward"):
                    loss.backward()
                with mon.section("optimizer"):
                    opt.step()
                    opt.zero_grad()
                mon.step()
            else:
                tok = torch.randint(0, 256, (4, 64))
                loss = model(tok, torch.roll(tok, -1, 1))
                loss.backward()
                opt.step()
                opt.zero_grad()
        return (time.perf_counter() - t0) / steps

    run(False)
    plain, monitored = [], []
    for _ in range(blocks):  # interleaved blocks: machine noise hits both alike
        plain.append(run(False))
        monitored.append(run(True))
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        with mon.section("x"):
            pass
    per_section = (time.perf_counter() - t0) / n
    step = statistics.median(plain)
    return {"step_ms": 1e3 * step, "monitored_step_ms": 1e3 * statistics.median(monitored),
            "overhead_pct_measured": 100 * (statistics.median(monitored) - step) / step,
            "section_cost_us": 1e6 * per_section,
            "overhead_pct_from_cost": 100 * (4 * per_section) / step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.1,1", help="state sizes in GB, comma-separated")
    p.add_argument("--dir", default=None, help="folder for disk checkpoints (default: a temp "
                   "folder under /tmp, removed at the end)")
    p.add_argument("--json", default="bench_results/checkpoint.json", help="where to write results")
    p.add_argument("--monitor-steps", type=int, default=20, help="steps per timing block "
                   "(0 skips the monitor overhead measurement)")
    p.add_argument("--skip-baselines", action="store_true", help="only mxgraph and the floor")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    root = args.dir or tempfile.mkdtemp(prefix="mxgraph-bench-")
    os.makedirs(root, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{root}/pgstore", rank=0, world_size=1)
    results: dict = {"sizes": {}, "threads": torch.get_num_threads()}
    try:
        for gb in [float(s) for s in args.sizes.split(",") if s]:
            free = mem_available_gb()
            if free < 3.5 * gb + 2:
                print(f"size {gb} GB skipped: {free:.1f} GB available, need ~{3.5 * gb + 2:.0f}")
                results["sizes"][str(gb)] = {"skipped": f"{free:.1f} GB available"}
                continue
            state = make_state(gb)
            row = {"floor": bench_floor(state)}
            row.update(bench_mxgraph(state, root))
            gc.collect()
            if not args.skip_baselines:
                row.update(bench_baselines(state, root))
            del state
            gc.collect()
            results["sizes"][str(gb)] = row
            print_table(gb, row)
        if args.monitor_steps:
            results["monitor"] = bench_monitor(args.monitor_steps, blocks=5)
            m = results["monitor"]
            print(f"\nmonitor level 0 on llama-tiny: step {m['step_ms']:.2f} ms, measured "
                  f"overhead {m['overhead_pct_measured']:+.2f}% (noise-bound), section cost "
                  f"{m['section_cost_us']:.1f} us -> {m['overhead_pct_from_cost']:.3f}% of a step")
    finally:
        dist.destroy_process_group()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.json}")
    return 0


def print_table(gb: float, row: dict) -> None:
    floor = row["floor"]
    save = row.get("torch.save")
    print(f"\nstate {gb} GB  (blocking seconds; x floor = seconds / the floor's, {gb / floor:.1f} "
          f"GB/s; torch.save / x = how many times faster than torch.save)")
    print(f"  {'case':56s} {'seconds':>9s} {'x floor':>8s} {'torch.save / x':>15s}")
    for name, sec in row.items():
        faster = f"{save / max(sec, 1e-6):15.1f}" if save else f"{'-':>15s}"
        print(f"  {name:56s} {sec:9.3f} {sec / floor:8.1f} {faster}")


if __name__ == "__main__":
    sys.exit(main())
