"""Built-in data and the training loop (a few steps; the full run is the README command)."""
import numpy as np
import pytest
import torch

import mxgraph as mx
from mxgraph.cli.main import main as cli_main
from mxgraph.data.batches import Batches, load_tokens, split, stdlib_bytes
from mxgraph.errors import TraceError
from mxgraph.train.loop import TrainConfig, train


def test_stdlib_data_is_fixed_and_split():
    a, b = stdlib_bytes(200_000), stdlib_bytes(200_000)
    assert a.dtype == np.uint8 and len(a) == 200_000 and np.array_equal(a, b)
    tr, va = split(a)
    assert len(va) == 10_000 and np.array_equal(np.concatenate([tr, va]), a)


def test_batches_are_shifted_windows_and_resumable():
    tokens = np.arange(1000) % 256
    batches = Batches(tokens, 4, 16, seed=1)
    x, y = batches.next()
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    state = batches.state_dict()
    after = batches.next()
    batches.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(after, batches.next(), strict=True))


def test_user_npy_and_text(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(50, dtype=np.int32))
    assert load_tokens(str(tmp_path / "ids.npy")).tolist() == list(range(50))
    (tmp_path / "t.txt").write_bytes(b"hello")
    assert load_tokens(str(tmp_path / "t.txt")).tolist() == list(b"hello")
    np.save(tmp_path / "bad.npy", np.zeros((2, 2)))
    with pytest.raises(ValueError, match="1-D integer"):
        load_tokens(str(tmp_path / "bad.npy"))


def test_short_training_lowers_loss_same_as_eager():
    cfg = TrainConfig(steps=8, batch_size=4, seq_len=32, warmup=2, val_batches=2)
    compiled = train(cfg, progress=False)
    eager = train(TrainConfig(**{**cfg.__dict__, "eager": True}), progress=False)
    assert compiled["val_loss"] < np.log(256)
    assert abs(compiled["train_loss"] - eager["train_loss"]) <= 1e-4 * eager["train_loss"]


def test_cli_help_and_run(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    assert "--batch-size" in capsys.readouterr().out
    assert cli_main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                     "--val-batches", "1", "--no-progress"]) == 0
    assert "validation loss" in capsys.readouterr().out


def test_launch_flags_are_dropped_for_the_torchrun_workers():
    from mxgraph.cli.main import build_parser
    from mxgraph.cli.train import torchrun_command, without_launch_flags
    assert without_launch_flags(["train", "--nproc", "2", "--steps", "3"]) == \
        ["train", "--steps", "3"]
    assert without_launch_flags(["train", "--nproc=4", "--max-restarts", "2", "--rdzv-id=j",
                                 "--plan", "p.toml"]) == ["train", "--plan", "p.toml"]
    argv = ["train", "--nproc", "2", "--max-restarts", "3", "--nnodes", "1:2",
            "--rdzv-endpoint", "h:29400", "--rdzv-id", "job", "--steps", "5"]
    command = torchrun_command(build_parser().parse_args(argv), argv)
    launcher = command[command.index("torch.distributed.run") + 1:command.index("mxgraph.cli")]
    assert launcher == ["--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--rdzv-id=job",
                        "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "-m"]
    assert command[command.index("mxgraph.cli") + 1:] == ["train", "--steps", "5"]


def test_nnodes_without_an_endpoint_is_a_one_line_error(capsys):
    from mxgraph.cli.main import main
    assert main(["train", "--nproc", "2", "--nnodes", "1:2", "--steps", "1"]) == 2
    assert "--nnodes 1:2 needs --rdzv-endpoint" in capsys.readouterr().err


def test_untraceable_model_names_module_and_line():
    class Gate(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # a Python branch on a tensor value
                return x * 2
            return x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.lin(x)).sum()

    with pytest.raises(TraceError) as info:
        mx.compile(Net())(torch.randn(2, 4))
    message = str(info.value)
    assert "gate (Gate)" in message and "test_train.py" in message and "x.sum() > 0" in message


def test_forward_must_return_loss():
    with pytest.raises(TraceError, match="scalar loss"):
        mx.compile(torch.nn.Linear(4, 4))(torch.randn(2, 4))


def test_save_and_resume_continue_bitwise(tmp_path, monkeypatch, caplog):
    """... and the resume says the loss and gradient norm of the step it resumes at."""
    monkeypatch.setenv("MXGRAPH_RUN_ID", f"test-resume-{tmp_path.name}")
    base = dict(batch_size=4, seq_len=32, warmup=2, val_batches=1,
                checkpoint_dir=str(tmp_path / "ck"))
    straight = train(TrainConfig(steps=6, **base), progress=False)
    train(TrainConfig(steps=3, save_every=3, **base), progress=False)
    resumed = train(TrainConfig(steps=6, resume=True, **base), progress=False)
    assert resumed["start_step"] == 3
    assert "resumed at step 3" in caplog.text and "that step's loss" in caplog.text
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]


def _tp2_save_resume_and_straight(rank, world, tmp):
    import os
    base = dict(plan=os.path.join(tmp, "tp2.toml"), batch_size=4, seq_len=32, val_batches=1,
                checkpoint_dir=os.path.join(tmp, "ck"))

    def run(run_id, **fields):
        os.environ["MXGRAPH_RUN_ID"] = f"{run_id}-{os.path.basename(tmp)}"
        return train(TrainConfig(**base, **fields), progress=False)

    run("save", steps=2, save_every=2)
    # another run id: the memory copy is not found, so the restore reads the disk
    resumed = run("resume", steps=4, resume=True)
    straight = run("straight", steps=4)
    assert resumed["start_step"] == 2
    assert resumed["train_loss"] == straight["train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]


@pytest.mark.slow(seconds=40)
def test_nproc_2_tp2_resume_from_disk_continues_exactly(tmp_path):
    """Each TP rank holds other parameter shards: a disk checkpoint must keep them per
    rank (restoring rank 0's shards everywhere would silently corrupt the model)."""
    from tests.distributed import run_ranks
    (tmp_path / "tp2.toml").write_text("tp = 2\n")
    run_ranks(2, _tp2_save_resume_and_straight, str(tmp_path))


def test_train_with_adaptive_moe_recompute(tmp_path, capsys):
    """`mxgraph train` on an AdaptiveMoEStep (it used to fail: the step had no .mesh)."""
    plan = tmp_path / "adaptive.toml"
    plan.write_text("[moe]\nadaptive_recompute_threshold = 64\n")
    assert cli_main(["train", "--model", "moe-tiny", "--model-config", "n_layers=2",
                     "--plan", str(plan), "--steps", "2",
                     "--batch-size", "2", "--seq-len", "16", "--val-batches", "1",
                     "--no-progress"]) == 0
    assert "validation loss" in capsys.readouterr().out
