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
