"""`mxgraph train` on 2 ranks under every layout of the presets (and a Hugging Face Llama
under tp=2), and bf16-mixed under tp+SP with overlap, pp and ep+ZeRO-1, finishes and prints
its validation loss, which equals the one-process run's where both see the same batches.

Each case goes through the real entry point (`mxgraph.cli.main(["train", ...])`), the way
the torchrun child of `mxgraph train --nproc 2` runs it; all cases share one 2-rank process
group (start-up dominates), so the CLI's closing of the group is held until the end. The
`--nproc 2` path itself (torchrun starting the ranks) runs in tests/app/test_train_restart.py.
The one-process references run in the test process. Layouts whose data-parallel ranks draw
other batches (dp, zero1, ep: every dp rank reads its own stream) are checked to finish with
a finite loss.
"""
import contextlib
import io
import math

import pytest

from mxgraph.cli.main import main
from mxgraph.hf.models import TINY
from tests.distributed import run_ranks

HF_LLAMA = ("hf:llama", ",".join(f"{k}={v}" for k, v in TINY["llama"].items()))
COMMON = ["--steps", "2", "--batch-size", "4", "--seq-len", "32", "--val-batches", "1",
          "--no-progress"]
MIXED = 'precision = "bf16-mixed"\n'
LAYERS = "n_layers=2"  # two layers (one a pp stage; moe-tiny: its dense one and a MoE one)
# (model, --model-config, plan file text, same batches as one process?)
CASES = [("llama-tiny", LAYERS, "tp = 2\n", True),
         ("llama-tiny", LAYERS, "tp = 2\nsequence_parallel = true\n", True),
         ("llama-tiny", LAYERS, "cp = 2\n", True),
         ("llama-tiny", LAYERS, "pp = 2\nmicro_batches = 2\n", True),
         ("llama-tiny", LAYERS, "zero1 = true\n", False),
         ("moe-tiny", LAYERS, "ep = 2\n", False),
         (*HF_LLAMA, "tp = 2\n", True),
         ("llama-tiny", LAYERS, f"tp = 2\nsequence_parallel = true\noverlap = true\n{MIXED}", True),
         ("llama-tiny", LAYERS, f"pp = 2\nmicro_batches = 2\n{MIXED}", True),
         ("moe-tiny", LAYERS, f"ep = 2\nzero1 = true\n{MIXED}", False)]
LOSS_TOL = 2e-3
"""Validation losses, absolute, as printed (4 decimals): TP, CP and the pipeline sum in
another order than one process, over 2 AdamW steps; under bf16-mixed the one-process
reference is bf16-mixed too, and the same tolerance holds."""


def reference_key(model: str, config: str, plan: str) -> tuple[str, str, bool]:
    return model, config, MIXED in plan


def train_cli(model: str, config: str, plan: str | None, tmp: str) -> float:
    """Run `mxgraph train` in this process; return the validation loss it prints (NaN on
    a rank that prints nothing)."""
    argv = ["train", "--model", model, *COMMON]
    if config:
        argv += ["--model-config", config]
    if plan is not None:
        path = f"{tmp}/plan-{abs(hash(plan))}.toml"
        with open(path, "w") as f:
            f.write(plan)
        argv += ["--plan", path]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, f"mxgraph {' '.join(argv)} failed"
    lines = [line for line in out.getvalue().splitlines() if "validation loss" in line]
    return float(lines[0].split("validation loss")[1].split()[0]) if lines else math.nan


def _every_case(rank, world, tmp, references):
    import mxgraph.runtime.cluster.launch as launch
    launch.close_process_group = lambda: None  # the harness ends the group after the cases
    for model, config, plan, same_batches in CASES:
        loss = train_cli(model, config, plan, tmp)
        if rank != 0:
            assert math.isnan(loss), "only rank 0 prints the result"
            continue
        assert math.isfinite(loss), (model, plan)
        if same_batches:
            want = references[reference_key(model, config, plan)]
            assert abs(loss - want) <= LOSS_TOL, (model, plan, loss, want)


@pytest.mark.slow(seconds=55)  # measured on 2 cores
def test_every_preset_layout_trains_through_the_cli(tmp_path):
    keys = dict.fromkeys(reference_key(*case[:3]) for case in CASES if case[3])
    references = {(model, config, mixed): train_cli(model, config, MIXED if mixed else None,
                                                    str(tmp_path))
                  for model, config, mixed in keys}
    run_ranks(2, _every_case, str(tmp_path), references)
