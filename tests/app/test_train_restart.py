"""`mxgraph train` heals itself: restarts after SIGKILLed workers and saver, clean-up, bad
checkpoints.

The drill: 2 gloo ranks, `--max-restarts 5 --save-every 5`; three random workers and the
saver are SIGKILLed at random steps (tests/resilience/drill.py). Its final parameters and
optimizer state (the committed checkpoint of the last step) must equal an uninterrupted
run's bitwise, no shared-memory segment and no process of the run may be left, and each
restart reports the time it lost.
"""
import glob
import os
import re
import sys
import uuid

import pytest
import torch

from mxgraph.errors import UserError
from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.checkpoint.shm import segment_prefix
from mxgraph.train.loop import TrainConfig, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "resilience"))
from drill import Kill, assert_clean, run_drill  # noqa: E402

TINY = ["--model", "llama-tiny", "--model-config", "n_layers=1", "--batch-size", "2", "--seq-len",
        "16", "--val-batches", "1", "--lr", "1e-3", "--no-progress"]  # one layer: each start compiles


def _final_state(checkpoint_dir: str, step: int) -> dict:
    path = disk.step_dir(checkpoint_dir, step)
    assert disk.is_committed(path), f"the last step's checkpoint {path} was not committed"
    return disk.load(path, source_rank=0)


@pytest.mark.slow(seconds=125)  # measured on 2 cores (alone: 46 s)
def test_drill_three_workers_and_the_saver_killed_ends_bitwise_equal(tmp_path):
    # one layer: a step takes ~15 ms on 2 cores, and a kill's random delay (up to 0.3 s) may
    # pass 20 steps; the last kill follows the first checkpoint after the second restart (at
    # step 40 at the latest), and the steps after it outlast its delay
    steps, every = 80, 5
    common = ["--nproc", "2", "--steps", str(steps), "--save-every", str(every), *TINY]
    ref_dir, drill_dir = str(tmp_path / "ref"), str(tmp_path / "drill")
    ref_id, drill_id = f"ref-{uuid.uuid4().hex[:8]}", f"drill-{uuid.uuid4().hex[:8]}"
    ref = run_drill([*common, "--checkpoint-dir", ref_dir], kills=[], run_id=ref_id)
    assert ref.returncode == 0, ref.output[-4000:]
    assert_clean(ref_id, ref_dir)
    kills = [Kill("worker", 5), Kill("saver", 10), Kill("worker", 15), Kill("worker", 20)]
    got = run_drill([*common, "--max-restarts", "5", "--checkpoint-dir", drill_dir],
                    kills=kills, run_id=drill_id, seed=1)
    assert got.returncode == 0, got.output[-6000:]
    assert [k[0] for k in got.killed] == ["worker", "saver", "worker", "worker"], got.killed
    assert len(got.restarts) == 3, got.output[-6000:]  # the saver's death restarts nothing
    for restart, step, source, lost in got.restarts:
        print(f"restart {restart}: resumed at step {step} from {source}; {lost:.1f} s lost")
        assert source in ("memory", "disk") and lost > 0 or source == "none" and step == 0
    assert_clean(drill_id, drill_dir)
    want, have = _final_state(ref_dir, steps), _final_state(drill_dir, steps)
    assert want["model"].keys() == have["model"].keys()
    for name, tensor in want["model"].items():
        assert torch.equal(tensor, have["model"][name]), name
    for index, moments in want["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, have["optimizer"]["state"][index][key]), (index, key)


def _config(tmp_path, **kwargs) -> TrainConfig:
    base = dict(model="llama-tiny", model_config="n_layers=1", batch_size=2, seq_len=16,
                val_batches=1, steps=2, checkpoint_dir=str(tmp_path / "ckpt"))
    return TrainConfig(**{**base, **kwargs})


def test_resume_with_nothing_says_so_and_starts_at_step_0(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MXGRAPH_RUN_ID", f"nothing-{uuid.uuid4().hex[:8]}")
    with caplog.at_level("WARNING", logger="mxgraph.train"):
        result = train(_config(tmp_path, resume=True), progress=False)
    assert result["start_step"] == 0
    assert "nothing to resume in" in caplog.text and "starting at step 0" in caplog.text


def test_resume_from_another_model_names_the_tensor_and_loads_nothing(tmp_path, monkeypatch):
    run_id = f"other-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MXGRAPH_RUN_ID", run_id)
    train(_config(tmp_path, save_every=2), progress=False)
    with pytest.raises(UserError) as error:
        train(_config(tmp_path, resume=True, model_config="n_layers=1,dim=32,n_heads=2,n_kv_heads=1"),
              progress=False)
    message = str(error.value)
    assert "does not fit this model and plan" in message, message
    assert re.search(r": model/\S+ is \[\d+, \d+\] float32 in the checkpoint but \[\d+, 32\] "
                     r"float32 here", message), message
    assert not glob.glob(f"/dev/shm/{segment_prefix(run_id)}*"), "shared memory left behind"


def test_checkpoint_dir_that_is_not_writable_fails_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="is not a writable directory"):
        train(_config(tmp_path, save_every=1, checkpoint_dir=str(blocker / "ckpt")),
              progress=False)
