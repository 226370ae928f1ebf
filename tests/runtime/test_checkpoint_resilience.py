"""Flash checkpoint under torchrun: SIGKILLed saver and rank, dp=2 -> dp=1, a dead worker's snapshot.

Each case runs tests/resilience/train_dp.py (2 gloo ranks, llama-tiny) under
`torchrun --max-restarts 1` and compares final parameters bitwise with an uninterrupted
run of the same steps.
"""

import glob
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.checkpoint.flash import FlashCheckpointer
from mxgraph.runtime.checkpoint.shm import segment_prefix

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "resilience", "train_dp.py")
STEPS = 8


def _torchrun(tmp, *extra):
    run_id = f"test-{uuid.uuid4().hex[:10]}"
    out, events, ckpt = tmp / "final.pt", tmp / "events.jsonl", tmp / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", SCRIPT, "--ckpt-dir", str(ckpt), "--out", str(out),
           "--events", str(events), "--steps", str(STEPS), *extra]
    env = dict(os.environ, MXGRAPH_RUN_ID=run_id, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not glob.glob(f"/dev/shm/{segment_prefix(run_id)}*"), "shared memory left behind"
    with open(events) as f:
        evs = [json.loads(line) for line in f]
    return torch.load(out), evs, str(ckpt)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    params, evs, _ = _torchrun(tmp_path_factory.mktemp("ref"))
    assert all(e["source"] is None for e in evs)
    return params


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_killed_saver_and_rank_resume_from_memory_bitwise_and_reload_at_dp1(tmp_path, reference):
    """The saver and then a rank die: torchrun restarts both ranks, which start a new saver;
    it adopts the intact shared-memory snapshots, so the restore still comes from memory and
    the run ends bitwise equal to the uninterrupted one."""
    params, evs, ckpt = _torchrun(tmp_path, "--kill-at", "5", "--kill-saver")
    restarted = [e for e in evs if e["attempt"] == 1]
    assert len(restarted) == 2 and all(e["source"] == "memory" for e in restarted)
    assert len({e["start"] for e in restarted}) == 1 and restarted[0]["start"] in (4, 5)
    _assert_equal(params, reference)
    assert [s for s, p in disk.list_steps(ckpt) if disk.is_committed(p)][0] == STEPS

    # the final checkpoint, saved at dp=2, loads in one process (dp=1) with equal parameters
    ck = FlashCheckpointer(ckpt, run_id=f"reload-{uuid.uuid4().hex[:8]}", saver="none")
    got = ck.restore()
    ck.close()
    assert got.source == "disk" and got.step == STEPS and ck.restore_info.resharded
    _assert_equal(dict(got.state["model"]), params)


def test_saver_flushes_a_dead_workers_snapshot_and_cleans_up(tmp_path):
    """No restart: the worker dies after a memory-only save; the saver writes that snapshot
    to disk, then (after linger_s) unlinks the run's shared memory and exits."""
    run_id = f"test-{uuid.uuid4().hex[:10]}"
    code = (
        "import os, signal, torch\n"
        "from mxgraph.runtime.checkpoint.flash import FlashCheckpointer\n"
        f"ck = FlashCheckpointer({str(tmp_path)!r}, run_id={run_id!r}, linger_s=1.0)\n"
        "r = ck.save(7, {'model': {'w': torch.arange(10.0)}}, persist=False)\n"
        "assert r.status == 'copied'\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == -9
    deadline = time.monotonic() + 60
    while glob.glob(f"/dev/shm/{segment_prefix(run_id)}*") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not glob.glob(f"/dev/shm/{segment_prefix(run_id)}*"), "shared memory left behind"
    ck = FlashCheckpointer(str(tmp_path), run_id=f"{run_id}-b", saver="none")
    got = ck.restore()
    ck.close()
    assert got.source == "disk" and got.step == 7
    assert torch.equal(got.state["model"]["w"], torch.arange(10.0))
