"""Shared test settings: hypothesis is derandomized under CI and kept small everywhere;
Triton kernels on CPU tensors run in Triton's interpreter, which must be switched on
before anything imports triton (test_kernels_compile.py runs its compile checks in a
subprocess without it)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

LONGEST_FIRST = (
    "test_benchmarks.py", "test_train_restart.py", "test_overlap.py", "test_remat.py",
    "test_pipeline_exec.py", "test_train.py", "test_checkpoint_resilience.py",
    "test_hf_parallel.py", "test_train_elastic.py", "test_compile.py", "test_memory_plan.py",
    "test_moe_capacity.py", "test_backend.py", "test_expert_parallel.py", "test_readme.py",
    "test_spmd.py",
)
"""The files that take longest (2 to 4.5 minutes each in a full run on 2 cores, measured
2026-12-03), longest first. `--dist loadfile` hands files to the two xdist workers in
collection order: with these at the end (alphabetically, the test_train* files are), one
worker ran them for minutes while the other stood idle."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable otherwise
