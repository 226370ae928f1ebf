"""mxgraph/runtime/host_memory.py: on the CPU, blocks a step frees stay in the process, so
the next step does not take their page faults again. Each case runs in its own process
(glibc's settings are process-wide) and checks the mechanism through glibc's own
accounting (`mallinfo2`), which the machine's load does not change: with the setting, a
16 MiB block (under `MMAP_THRESHOLD`) comes from the heap and stays there once freed; a
64 MiB block (over it) gets a mapping of its own, given back on free. What that saves in
page faults and time is a measurement, so it is a benchmark
(`benchmarks/bench_host_memory.py`: llama-tiny on 8 x 256 tokens, 14k-34k faults over 4
steps under glibc's own settings against 0-1.7k kept)."""
import ctypes.util
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import ctypes, ctypes.util, json
from mxgraph.runtime import host_memory
kept = host_memory.keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def block(size):
    before = libc.mallinfo2()
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    during = libc.mallinfo2()
    libc.free(pointer)
    after = libc.mallinfo2()
    return {"mapped": during.hblkhd - before.hblkhd, "unmapped": during.hblkhd - after.hblkhd,
            "heap_kept": after.arena >= during.arena and after.fordblks >= size}
print(json.dumps({"kept": kept, "small": block(16 << 20), "large": block(64 << 20)}))
"""
GLIBC = ctypes.util.find_library("c") is not None and sys.platform.startswith("linux")


def _blocks(**env) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=True,
                         timeout=240, cwd=ROOT)
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings: Linux only")
def test_a_freed_block_under_the_threshold_stays_in_the_heap():
    found = _blocks()
    assert found["kept"] is True
    assert found["small"] == {"mapped": 0, "unmapped": 0, "heap_kept": True}, found
    assert found["large"]["mapped"] >= 64 << 20 and found["large"]["unmapped"] >= 64 << 20, found


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings: Linux only")
def test_the_users_own_malloc_settings_are_left_alone():
    assert _blocks(MALLOC_TRIM_THRESHOLD_="1000000")["kept"] is False
    assert _blocks(MXGRAPH_HOST_MALLOC="system")["kept"] is False


def test_the_benchmark_compares_both_settings(tmp_path):
    """bench_host_memory runs each setting in processes of its own and reports both."""
    spec = importlib.util.spec_from_file_location("bench_host_memory",
                                                  ROOT / "benchmarks" / "bench_host_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "host_memory.json"
    result = bench.main(["--batch-size", "2", "--seq-len", "32", "--steps", "2", "--repeats", "1",
                         "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(row["setting"], row["kept"]) for row in result["rows"]] == [("kept", True),
                                                                         ("system", False)]
    assert all(row["step_ms_median"] > 0 for row in result["rows"])
