"""The drill of tests/runtime/test_health.py under dp2 and tp2 on 2 gloo ranks, the NaN written into
rank 1's gradient: skip and rollback bitwise equal to the run that leaves the batches out;
stop names step 4, rank 1 and the parameter (with the last good checkpoint checked under
tp2; without checkpoints under dp2, as a run without --save-every).
"""
import pytest
import torch

from tests.distributed import run_ranks
from tests.runtime.test_health import every_policy


def _every_policy_on_ranks(rank, world, tmp):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.delenv("MXGRAPH_RUN_ID", raising=False)
    for name, text in (("dp2", "dp = 2\n"), ("tp2", "tp = 2\n")):
        plan = f"{tmp}/{name}.toml"
        if rank == 0:
            with open(plan, "w") as f:
                f.write(text)
        torch.distributed.barrier()
        every_policy(monkeypatch, f"{tmp}/{name}", plan, rank=rank, nan_rank=1,
                     checkpoints=name == "tp2")


@pytest.mark.slow(seconds=53)  # measured on 2 cores
def test_drill_every_policy_under_dp2_and_tp2(tmp_path):
    run_ranks(2, _every_policy_on_ranks, str(tmp_path))
