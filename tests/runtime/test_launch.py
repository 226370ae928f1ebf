"""`mxgraph.runtime.cluster.launch.init_from_environment`: `mx.compile` under torchrun joins the job
itself, without the script calling `dist.init_process_group`."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch.distributed as dist

from mxgraph.runtime.cluster.launch import init_from_environment

ROOT = Path(__file__).resolve().parents[2]

# each rank builds the same model and batch (same seed), takes the eager loss, then
# compiles with tp=2 and never calls init_process_group
SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    import models
    import mxgraph as mx

    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=1)
    tokens = torch.randint(0, 256, (2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        eager = model(inputs, targets).item()
    assert not dist.is_initialized()
    step = mx.compile(model, mx.Plan(tp=2))
    assert dist.is_initialized() and dist.get_world_size() == 2
    loss = step(inputs, targets).item()
    assert abs(loss - eager) <= 1e-5 * abs(eager), (loss, eager)
    print(f"rank {dist.get_rank()}: loss {loss:.6f} = eager {eager:.6f}", flush=True)
    # no close: the group mx.compile made ends itself at exit (a bare destroy here, with
    # no barrier, let one rank tear its connections down under a peer: exit -6, once)
""")


def test_compile_under_torchrun_initialises_the_process_group(tmp_path):
    script = tmp_path / "tp2_without_init.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        assert f"rank {rank}: loss" in run.stdout, run.stdout + run.stderr


def test_one_process_makes_no_group(monkeypatch):
    for world_size in (None, "1"):
        if world_size is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world_size)
        init_from_environment()
        assert not dist.is_initialized()
