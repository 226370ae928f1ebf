"""Copy-engine mode (`Plan.overlap.copy_engine`, the seed's SDMA): transfers with no compute
dependency inside the step run off the compute lane.

    lane = TransferLane(mesh.device)
    transfer = lane.submit(lambda: dist.all_reduce(flat, group=group))
    ...                                     # compute goes on
    transfer.wait()

One worker thread per lane runs the submitted transfers in submission order (so every rank
issues them in the same order). On the CPU that thread is the lane; on `cuda` each
transfer is also issued on a dedicated stream that first waits for the compute stream's
work so far, and `wait` makes the compute stream wait for it. What moves this way: the
data-parallel buckets' reductions and ZeRO-1's parameter gathers
(`runtime/data_parallel/buckets.py`). The transfers themselves are the collective library's (gloo;
NCCL/MCCL on a GPU, where copy-engine kernels — device-to-device copies within a node,
symmetric-memory puts — are not built yet: `runtime/cluster/device.py` asks for
`overlap.fallback` there). Values are those of the same collectives on the compute lane.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Transfer:
    """A submitted transfer; `wait()` returns when it is done."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> None:
        done = self.future.result()
        if done is not None:  # cuda: the compute stream waits for the transfer's stream
            torch.cuda.current_stream().wait_event(done)


class TransferLane:
    """A worker thread (and on cuda a stream) that runs transfers in submission order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxgraph-transfers")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.submitted = 0
        """Transfers run on this lane so far."""

    def submit(self, transfer) -> Transfer:
        """Run `transfer()` (a blocking collective call) on the lane."""
        self.submitted += 1
        if self.stream is None:
            return Transfer(self.pool.submit(_run_then_none, transfer))
        ready = torch.cuda.Event()
        ready.record()
        stream = self.stream

        def on_stream():
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                transfer()
                done = torch.cuda.Event()
                done.record(stream)
            return done
        return Transfer(self.pool.submit(on_stream))


def _run_then_none(transfer) -> None:
    transfer()
