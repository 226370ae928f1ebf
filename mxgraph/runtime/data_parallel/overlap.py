"""Data-parallel reductions during the backward (`Plan.overlap.dp_buckets`), as DDP's.

    overlap = BucketOverlap(dp, late={id(tied_weight)})
    overlap.begin()                     # before the step
    executor.grad_ready = overlap.grad_ready
    executor.step(...)                  # grad_ready(name) as each final gradient lands
    overlap.finish()                    # the remaining buckets, then wait and average

The executor calls `grad_ready(param)` when this rank's gradient of the parameter is
final for the step: accumulated from the last micro-batch's weight-gradient program of
every stage of this rank that reads it. A bucket whose parameters are all final starts its
collective (`DataParallel.start`) while the backward goes on. `finish` starts the rest (a
parameter without a gradient on this rank, one shared by several pipeline ranks, whose
gradient is summed over them after the schedule: `late`), then waits for every bucket in
bucket order and writes the averages (`DataParallel.complete`).

Under ZeRO-1 the all-gather of the updated shards overlaps the next step's forward:
`gather_start` starts every bucket's, and `gathered(param)` (the executor calls it right
before a program first reads the parameter) waits for that bucket's and copies it into
the parameters; `gather_finish` completes the rest.

The collectives reduce the same buffers as `DataParallel.reduce`: bitwise the same
gradients; the gathers copy the same values as `DataParallel.gather_parameters`. Every
data-parallel rank runs the same programs in the same order, so each issues the buckets'
collectives in the same order.
"""
from __future__ import annotations

from mxgraph.runtime.data_parallel.buckets import DataParallel


class BucketOverlap:
    """The reductions of one `DataParallel`'s buckets, started as their gradients land."""

    def __init__(self, dp: DataParallel, late: set[int] = frozenset()):
        """`late`: ids of parameters whose gradients are summed over pipeline ranks after
        the schedule."""
        self.dp = dp
        self.bucket_of = {id(p): i for i, b in enumerate(dp.buckets) for p in b.params}
        self.late = {i for i, b in enumerate(dp.buckets) if late & {id(p) for p in b.params}}
        self.waiting: dict[int, set[str]] = {}
        self.started: dict = {}
        self.gathers: dict = {}  # bucket index -> (flat values, work) in flight
        self.early: list[int] = []
        """The buckets whose collectives started during the last step's backward, in the
        order they started (the others started in `finish`)."""

    def begin(self) -> None:
        self.waiting = {i: {id(p) for p in b.params} for i, b in enumerate(self.dp.buckets)}
        self.started = {}
        self.early = []

    def grad_ready(self, param) -> None:
        index = self.bucket_of.get(id(param))
        if index is None or index in self.started:
            return
        self.waiting[index].discard(id(param))
        if not self.waiting[index] and index not in self.late:
            self.started[index] = self.dp.start(self.dp.buckets[index])
            self.early.append(index)

    def finish(self) -> None:
        for index, bucket in enumerate(self.dp.buckets):
            if index not in self.started:
                self.started[index] = self.dp.start(bucket)
        for index, bucket in enumerate(self.dp.buckets):
            self.dp.complete(bucket, self.started.pop(index))

    # ---- ZeRO-1: the updated parameters, during the next forward -----------------------
    def gather_start(self) -> None:
        for index, bucket in enumerate(self.dp.buckets):
            self.gathers[index] = self.dp.gather_start(bucket)

    def gathered(self, param) -> None:
        index = self.bucket_of.get(id(param))
        if index in self.gathers:
            self.dp.gather_complete(self.dp.buckets[index], *self.gathers.pop(index))

    def gather_finish(self) -> None:
        for index in list(self.gathers):
            self.dp.gather_complete(self.dp.buckets[index], *self.gathers.pop(index))
