"""mxgraph/runtime/host_memory.py: on the CPU, blocks a step frees stay in the process, so
the next step does not take their page faults again. Each case runs in its own process
(glibc's settings are process-wide): a llama-tiny step on 8 x 256 tokens (blocks of
0.5-2 MiB) runs 8 times, and the minor page faults of the last 4 steps are counted with the
setting and without it (`MXGRAPH_HOST_MALLOC=system`: glibc's own thresholds, which unmap
and trim what a step freed; measured here 14k-34k faults against 0-1.7k)."""
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import resource, torch
import mxgraph as mx
import models
from mxgraph.runtime import host_memory
torch.manual_seed(0)
model = models.build_model("llama-tiny")
step = mx.compile(model, mx.Plan(codegen="python"))
x, y = torch.randint(0, 256, (8, 256)), torch.randint(0, 256, (8, 256))
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(8):
    before = faults(); step(x, y); counts.append(faults() - before)
    model.zero_grad(set_to_none=True)
print(host_memory._done, sum(counts[4:]))
"""
GLIBC = ctypes.util.find_library("c") is not None and sys.platform.startswith("linux")


def _last_steps_faults(**env) -> tuple[str, int]:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=True,
                         timeout=240, cwd=ROOT)
    kept, faults = run.stdout.split()[-2:]
    return kept, int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings: Linux only")
def test_a_cpu_step_keeps_what_it_freed_for_the_next_step():
    kept, faults = _last_steps_faults()
    system, system_faults = _last_steps_faults(MXGRAPH_HOST_MALLOC="system")
    assert (kept, system) == ("True", "False")
    assert system_faults > 4096, system_faults  # glibc gave pages back: steps fault again
    assert faults < system_faults / 4, (faults, system_faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings: Linux only")
def test_the_users_own_malloc_settings_are_left_alone():
    kept, _ = _last_steps_faults(MALLOC_TRIM_THRESHOLD_="1000000")
    assert kept == "False"
