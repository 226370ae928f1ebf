"""mxgraph/runtime/host_memory.py: on the CPU, blocks a step frees stay in the process, so
the next step does not take their page faults again. Each case runs in its own process
(glibc's settings are process-wide): after a CPU step is compiled, a 40 MiB tensor is
allocated, filled and freed six times; the minor page faults of the last two fills are
counted, with the setting and without it (`MXGRAPH_HOST_MALLOC=system`, glibc's own
behaviour: a block over 32 MiB is always mapped on allocation and unmapped on free)."""
import ctypes.util
import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, torch
import mxgraph as mx
import models
mx.compile(models.build_model("llama-tiny", n_layers=1), mx.Plan())  # a step on the CPU
from mxgraph.runtime import host_memory
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(6):
    x = torch.empty(10 * 2**20); before = faults(); x.fill_(1.0); counts.append(faults() - before)
    del x
print(host_memory._done, sum(counts[4:]))
"""
GLIBC = ctypes.util.find_library("c") is not None and sys.platform.startswith("linux")


def _second_fill(**env) -> tuple[str, int]:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kept, faults = run.stdout.split()[-2:]
    return kept, int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings: Linux only")
def test_a_cpu_step_keeps_freed_blocks_for_the_next_allocation():
    kept, faults = _second_fill()
    system, system_faults = _second_fill(MXGRAPH_HOST_MALLOC="system")
    assert (kept, system) == ("True", "False")
    pages = 40 * 2**20 // 4096
    assert system_faults >= pages, system_faults  # unmapped on free: both fills faulted
    assert faults < pages // 16, faults           # kept: (almost) no fault


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings: Linux only")
def test_the_users_own_malloc_settings_are_left_alone():
    kept, _ = _second_fill(MALLOC_TRIM_THRESHOLD_="1000000")
    assert kept == "False"
