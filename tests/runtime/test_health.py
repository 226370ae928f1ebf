"""Non-finite losses and gradients (runtime/health.py, train.py, train_state.py).

The drill writes NaN into one rank's gradient after the backward of a chosen batch (the
test hook MXGRAPH_DRILL_NAN) and checks each policy against a reference run that reads the
same batches and trains on none of the dropped ones (MXGRAPH_DRILL_DROP):

* skip (NaN at batches 2 and 3): the parameters after the run equal, bitwise
  (`torch.equal`), those of the run with those batches left out; so do the train and
  validation losses;
* rollback (snapshot every 2 steps, NaN at batch 3, i.e. while step 4 is computed): back to
  step 2's snapshot from memory, batches 2 and 3 skipped; bitwise equal to the same
  reference;
* stop: NonFiniteError naming the step, the rank and the parameter; the checkpoint of
  step 2 is committed, intact and loadable.

On one process here; under dp2 and tp2 (2 gloo ranks, the NaN on rank 1) in
tests/runtime/test_health_ranks.py.
"""
import math

import pytest
import torch

from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.health import Guard, NonFiniteError
from mxgraph.train.loop import TrainConfig, train

BASE = dict(steps=5, batch_size=4, seq_len=32, warmup=2, val_batches=1,
            model_config="n_layers=1")  # one layer: each run compiles


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value)


def test_guard_stop_raises_before_the_update_with_the_step():
    guard = Guard("stop")
    assert guard.check(0, _scalar(2.0), _scalar(1.0)).action == "update"
    with pytest.raises(NonFiniteError, match=r"step 2: the gradient norm is nan .*rank 7"):
        guard.check(1, _scalar(2.0), _scalar(math.nan), locate=lambda: "rank 7")


def test_guard_skip_stops_after_max_skips_in_a_row():
    guard = Guard("skip", max_skips=2)
    assert guard.check(0, _scalar(math.inf), _scalar(1.0)).action == "skip"
    assert guard.check(0, _scalar(3.0), _scalar(1.0)).action == "update"  # the row breaks
    assert [guard.check(1, _scalar(math.nan), _scalar(1.0)).action for _ in range(2)] == \
        ["skip", "skip"]
    with pytest.raises(NonFiniteError, match="3 events in a row"):
        guard.check(1, _scalar(math.nan), _scalar(1.0))


def test_guard_rollback_row_holds_until_the_failed_step_is_passed():
    """A rollback replays healthy steps before the one that failed: they do not end the
    row, or a run that fails at the same step every time would never stop."""
    guard = Guard("rollback", max_skips=2)
    for _ in range(2):
        assert guard.check(0, _scalar(2.0), _scalar(1.0)).action == "update"
        assert guard.check(1, _scalar(2.0), _scalar(math.inf)).action == "rollback"
    assert guard.check(0, _scalar(2.0), _scalar(1.0)).action == "update"
    with pytest.raises(NonFiniteError):
        guard.check(1, _scalar(2.0), _scalar(math.inf))


def test_guard_loss_spike_against_the_running_median():
    guard = Guard("skip", spike_factor=3.0, spike_window=10)
    for step in range(10):
        assert guard.check(step, _scalar(2.0 + 0.01 * step), _scalar(1.0)).action == "update"
    verdict = guard.check(10, _scalar(9.0), _scalar(1.0))
    assert verdict.action == "skip" and "loss spike" in verdict.problem
    assert guard.check(10, _scalar(5.0), _scalar(1.0)).action == "update"  # under 3x


def _drill(monkeypatch, nan: str = "", drop: str = "", **cfg) -> dict:
    monkeypatch.setenv("MXGRAPH_DRILL_NAN", nan)
    monkeypatch.setenv("MXGRAPH_DRILL_DROP", drop)
    return train(TrainConfig(**{**BASE, **cfg}), progress=False)


def _same(run: dict, reference: dict) -> None:
    assert run["train_loss"] == reference["train_loss"]
    assert run["val_loss"] == reference["val_loss"]
    assert run["parameters"].keys() == reference["parameters"].keys()
    for name, value in run["parameters"].items():
        assert torch.equal(value, reference["parameters"][name]), name


def every_policy(monkeypatch, tmp, plan: str | None, rank: int, nan_rank: int,
                 checkpoints: bool = True) -> None:
    """The three drills and their reference under one layout, in this process; the stop
    with checkpoints (then the last good one is checked) or without."""
    cfg = {"plan": plan}
    reference = _drill(monkeypatch, drop="2,3", **cfg)
    skipped = _drill(monkeypatch, nan=f"2@{nan_rank},3@{nan_rank}", on_nonfinite="skip", **cfg)
    assert skipped["skipped"] == 2 and math.isfinite(skipped["train_loss"])
    _same(skipped, reference)

    rolled = _drill(monkeypatch, nan=f"3@{nan_rank}", on_nonfinite="rollback", save_every=2,
                    checkpoint_dir=f"{tmp}/rollback", **cfg)
    assert rolled["rollbacks"] == 1
    _same(rolled, reference)

    with pytest.raises(NonFiniteError) as stopped:
        _drill(monkeypatch, nan=f"3@{nan_rank}", save_every=2 if checkpoints else 0,
               checkpoint_dir=f"{tmp}/stop", **cfg)
    message = str(stopped.value)
    first = next(iter(skipped["parameters"]))  # the drill's NaN: the first gradient's
    assert "step 4: the gradient norm is nan" in message, message
    assert f"rank(s) {nan_rank}: 1 parameter(s) with a non-finite gradient, the first the " \
        f"backward reached: {first}" in message, message
    if not checkpoints:
        assert "no checkpoint is taken without --save-every" in message, message
        return
    good = disk.step_dir(f"{tmp}/stop", 2)
    assert f"the last good checkpoint, {good}, is intact" in message, message
    if rank == 0:
        assert [s for s, p in disk.list_steps(f"{tmp}/stop") if disk.is_committed(p)] == [2, 0]
        assert disk.verify(good) is None
        state = disk.load(good, source_rank=rank)
        assert math.isfinite(state["health"]["loss"])
        assert math.isfinite(state["health"]["grad_norm"])


def test_drill_every_policy_on_one_process(tmp_path, monkeypatch):
    monkeypatch.delenv("MXGRAPH_RUN_ID", raising=False)
    every_policy(monkeypatch, str(tmp_path), None, rank=0, nan_rank=0)


def test_rotation_keeps_the_good_checkpoints_when_nan_steps_follow(tmp_path, monkeypatch):
    """--keep 2: after good checkpoints at steps 2 and 4, every later batch is NaN; the run
    stops after --max-skips and the two good checkpoints are what is on disk."""
    monkeypatch.delenv("MXGRAPH_RUN_ID", raising=False)
    with pytest.raises(NonFiniteError, match="more than max_skips=3"):
        _drill(monkeypatch, nan=",".join(map(str, range(4, 12))), on_nonfinite="skip",
               max_skips=3, save_every=2, keep=2, checkpoint_dir=str(tmp_path))
    committed = [s for s, p in disk.list_steps(str(tmp_path)) if disk.is_committed(p)]
    assert committed == [4, 2]
    for step in committed:
        state = disk.load(disk.step_dir(str(tmp_path), step), source_rank=0)
        assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_a_stop_under_torchrun_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    """The workers of `--nproc 2` exit 0 after a stop (torchrun would restart a failure);
    rank 0 leaves the reason in the launcher's stop file, which the launcher prints as one
    error line with status 2."""
    import mxgraph.cli.train as train_cli
    from mxgraph.cli.main import main

    def torchrun(command, env):
        assert "--max-restarts=2" in command
        with open(env[train_cli.STOP_FILE], "w") as f:
            f.write("step 4: the gradient norm is nan (loss 4.1); stopped before the update")
        return 0
    monkeypatch.setattr(train_cli.subprocess, "call", torchrun)
    status = main(["train", "--nproc", "2", "--max-restarts", "2", "--save-every", "2",
                   "--checkpoint-dir", str(tmp_path), "--steps", "5"])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mxgraph: error: step 4: the gradient norm is nan (loss 4.1); stopped "
                   "before the update"]


def test_bad_policy_flags_are_one_line_errors(capsys):
    from mxgraph.cli.main import main
    assert main(["train", "--on-nonfinite", "ignore"]) == 2
    assert "'ignore' is not one of stop, skip, rollback" in capsys.readouterr().err
    assert main(["train", "--on-nonfinite", "rollback"]) == 2
    assert "set --save-every" in capsys.readouterr().err


def test_a_state_with_a_non_finite_parameter_is_never_saved(tmp_path, caplog):
    """Loss and gradient norm finite, yet the update made a parameter Inf: the snapshot is
    refused (the newest good one stays the newest)."""
    from mxgraph.plan import Plan
    from mxgraph.runtime.checkpoint.flash import FlashCheckpointer
    from mxgraph.train.checkpoints import RunCheckpoints

    class Position:
        def state_dict(self):
            return {"step": 0}
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight])
    checkpointer = FlashCheckpointer(str(tmp_path), run_id=f"nonfinite-{tmp_path.name}",
                                     saver="none")
    try:
        checkpoints = RunCheckpoints(checkpointer, Plan(), {"w": weight}, optimizer, Position())
        assert checkpoints.save(1, {"loss": 1.0, "grad_norm": 1.0}, background=False) is not None
        with torch.no_grad():
            weight[2] = math.inf
        assert checkpoints.save(2, {"loss": 1.0, "grad_norm": 1.0}, background=False) is None
        assert "step 2: a parameter is not finite" in caplog.text
        assert checkpointer.restore().step == 1
    finally:
        checkpointer.close()
