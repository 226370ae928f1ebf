"""Activation offload at run time: a host pool, a side stream, and three graph ops.

The offload pass (passes/memory/offload.py) inserts, for each chosen saved activation `x`:

    h = mxgraph::offload(x, pool, key)            # right after x is produced
    d = mxgraph::prefetch(h, pool, key, device)   # a few backward nodes before first use
    d = wait_prefetch(d, pool, key)               # right before the first backward use

* On a GPU (`cuda`, MXMACA included) the pool's side stream first waits for the compute
  stream, then copies `x` into a pinned host buffer with `non_blocking=True` and records an
  event; `x.record_stream(side)` keeps its memory from being reused before the copy ends.
  `prefetch` copies back on the side stream (after the offload event) and records a ready
  event; `wait_prefetch` makes the compute stream wait for that event (no host sync), so
  the copy overlaps with the backward nodes between the prefetch and the use.
* On the CPU the same graph runs: `offload` copies into the pool's own host buffer (one per
  key, reused across steps), `prefetch` copies it back into a fresh tensor, `wait_prefetch`
  returns its input. `HostPool.bytes` is the host memory held.

Pools are looked up by an integer id because graph ops take plain values; `new_pool()`
creates one per compiled graph (the pass stores the id in the graph).
"""
from __future__ import annotations

import itertools

import torch

_POOLS: dict[int, "HostPool"] = {}
_pool_ids = itertools.count()


class HostPool:
    """Host buffers of one compiled graph, keyed by the offloaded value."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}
        self.offload_events: dict[int, object] = {}
        self.ready_events: dict[int, object] = {}
        self.copies = 0
        self._stream = None

    @property
    def bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers.values())

    def side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def buffer(self, key: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.stride() != like.stride() or \
                buf.dtype != like.dtype:
            buf = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="cpu",
                                      pin_memory=like.is_cuda)
            self.buffers[key] = buf
        return buf

    def offload(self, x: torch.Tensor, key: int) -> torch.Tensor:
        buf = self.buffer(key, x)
        self.copies += 1
        if not x.is_cuda:
            buf.copy_(x)
            return buf
        side = self.side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            buf.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        x.record_stream(side)
        self.offload_events[key] = event
        return buf

    def prefetch(self, h: torch.Tensor, key: int, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return h.clone()
        side = self.side_stream(device)
        out = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
        event = self.offload_events.pop(key, None)
        with torch.cuda.stream(side):
            if event is not None:
                side.wait_event(event)
            out.copy_(h, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        out.record_stream(side)
        self.ready_events[key] = ready
        return out

    def wait(self, x: torch.Tensor, key: int) -> torch.Tensor:
        ready = self.ready_events.pop(key, None)
        if ready is not None:
            torch.cuda.current_stream(x.device).wait_event(ready)
        return x


def new_pool() -> int:
    pool_id = next(_pool_ids)
    _POOLS[pool_id] = HostPool()
    return pool_id


def get_pool(pool_id: int) -> HostPool:
    return _POOLS[pool_id]


@torch.library.custom_op("mxgraph::offload", mutates_args=())
def offload(x: torch.Tensor, pool: int, key: int) -> torch.Tensor:
    """Copy `x` to the host pool `pool` under `key` (async on a side stream on GPUs)."""
    return get_pool(pool).offload(x, key)


@offload.register_fake
def _offload_fake(x, pool, key):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.custom_op("mxgraph::prefetch", mutates_args=())
def prefetch(h: torch.Tensor, pool: int, key: int, device: torch.device) -> torch.Tensor:
    """Copy an offloaded value back to `device` (async on a side stream on GPUs)."""
    return get_pool(pool).prefetch(h, key, torch.device(device))


@prefetch.register_fake
def _prefetch_fake(h, pool, key, device):
    return torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)


def wait_prefetch(x: torch.Tensor, pool: int, key: int) -> torch.Tensor:
    """Order the compute stream after the prefetch of `key`; returns `x` itself."""
    return get_pool(pool).wait(x, key)


wait_prefetch._mxgraph_alias = True  # memory analyses: the result is its input
