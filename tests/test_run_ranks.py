"""tests/distributed.py's `run_ranks` reports a rank that a signal killed with the stacks
faulthandler wrote for it, at the top of its failure message (a CI log that cuts captured
output keeps it)."""
import os
import signal

import pytest

from tests.distributed import run_ranks


def _crash_in_here(rank, world):
    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_rank_killed_by_a_signal_is_reported_with_its_stacks():
    with pytest.raises(AssertionError) as failure:
        run_ranks(1, _crash_in_here)
    lines = str(failure.value).splitlines()
    assert lines[0] == f"exit codes by rank [{-signal.SIGSEGV}]"
    assert lines[1] == f"rank 0 killed by signal {int(signal.SIGSEGV)}; its threads' stacks:"
    assert "Fatal Python error: Segmentation fault" in lines[2]
    assert any("_crash_in_here" in line for line in lines[3:])
