"""Shared test settings: hypothesis is derandomized under CI and kept small everywhere."""
import os

import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
