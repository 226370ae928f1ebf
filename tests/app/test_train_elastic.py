"""A node that does not come back: `mxgraph train --nnodes 1:2` goes on without it.

tests/resilience/elastic_shrink.sh starts two torchrun agents ("nodes", 1 worker each)
under one rendezvous and SIGKILLs the node that does not host the rendezvous store, with
its workers, after the checkpoint of step 10. The survivor must restart by itself, resume
from the newest committed disk checkpoint (the dead node's shared memory is gone with it)
at 1 process instead of 2, say that data parallelism shrank, and train to the last step.
"""
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "resilience"))
from drill import assert_clean  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "resilience", "elastic_shrink.sh")


@pytest.mark.slow(seconds=70)  # measured on 2 cores
def test_a_node_lost_for_good_shrinks_dp_and_training_goes_on(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=400,
                          check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "survivor exit status 0" in out, out
    run_id, checkpoints = re.search(r"\(run id (\S+), checkpoints in (\S+)\)", out).groups()
    # the newest committed disk checkpoint when the node died (--save-every 5): the kill
    # follows the log line of step 10's in-memory copy, and its disk write may still have
    # been under way (then step 5's) or later ones done
    resumed = re.search(r"restart 1 \(at most 3\): resumed at step (\d+) from disk", out)
    assert resumed and int(resumed.group(1)) % 5 == 0 and 5 <= int(resumed.group(1)) < 40, out
    assert "the job runs on 1 process(es) now, the checkpoint was saved on 2: data " \
           "parallelism is 1 now" in out, out
    final = re.search(r"train loss (\d+\.\d+) \| validation loss (\d+\.\d+)", out)
    assert final and float(final.group(1)) < 6.0, out  # a sane loss (random init: ln 256 = 5.5)
    assert_clean(run_id, checkpoints)  # the saver's command line names the checkpoints too
