"""Shared test settings: hypothesis is derandomized under CI and kept small everywhere;
one torch thread per xdist worker where the workers fill the cores;
Triton kernels on CPU tensors run in Triton's interpreter, which must be switched on
before anything imports triton (test_kernels_compile.py runs its compile checks in a
subprocess without it); plans whose codegen is "auto" (the default) run Python codegen,
here and in every process a test starts: Inductor's compile (tens of seconds a program on
2 cores) under each of the suite's hundreds of compiles would not fit its 25 minutes; the
tests of Inductor codegen ask for it in their plans (test_codegen_inductor.py,
test_backend.py)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MXGRAPH_CODEGEN", "python")

import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
    # as many xdist workers as cores: one thread each (and for the processes a test starts),
    # as the ranks have; OpenMP threads spinning on a core another worker holds run many
    # times slower
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))



def pytest_collection_modifyitems(config, items):
    """Files with a `slow` test first, longest first, each file's tests in their order:
    xdist hands out whole files (`--dist loadfile`) in collection order, and a long file
    handed out last is the suite's tail while the other worker idles. A slow mark may say
    how long its test takes here (`@pytest.mark.slow(seconds=240)`); unsaid counts 60."""
    cost: dict = {}
    for item in items:
        for mark in item.iter_markers("slow"):
            cost[item.path] = max(cost.get(item.path, 0), mark.kwargs.get("seconds", 60))
    items.sort(key=lambda item: -cost.get(item.path, 0))
