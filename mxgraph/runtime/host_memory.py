"""Host memory for a step on the CPU: freed blocks stay in the process for the next step.

On a GPU, torch's caching allocator keeps the blocks a step frees and hands them to the next
step. On the CPU, tensors come from glibc's malloc, which gives memory back to the
operating system (`munmap` of a block over its mmap threshold, a trim of the heap's top over
its trim threshold). A training step frees most of what it allocated at its end, so the next
step takes every page fault again: an Inductor step of a 20M-parameter Llama (4 x 256
tokens, 2 cores) faulted 458 MiB, 117k pages, a step and ran 10-15% slower than with the
memory kept.

`keep_freed_memory()` sets glibc's malloc once per process to behave as a caching
allocator for a step's blocks: every block up to 32 MiB (glibc's largest mmap threshold)
comes from the heap, and the heap is trimmed only when over 1 GiB of its top is free. The
process's resident memory then stays at the step's peak between steps, as a GPU's reserved
memory does. A block over 32 MiB still gets a mapping of its own, given back on free: a
step's largest tensors (a big vocabulary's logits) fault again each step, and a checkpoint
load's large temporaries leave nothing behind (with every block on the heap, a 1 GiB load
at tp2 peaked 45 MiB higher).

Not done where glibc is not the C library, where malloc was replaced (`LD_PRELOAD` of
jemalloc or tcmalloc: their own settings rule), where the user set any `MALLOC_*`
threshold in the environment, and under `MXGRAPH_HOST_MALLOC=system`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")
_done = False


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks in the process (see the module's text);
    True when it is set (now or before), False where it is not done."""
    global _done
    if _done:
        return True
    if os.environ.get("MXGRAPH_HOST_MALLOC", "keep") == "system":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("jemalloc", "tcmalloc")):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl, BSD, macOS: not glibc
            return False
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    except OSError:
        return False
    _done = ok
    return ok


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]
