"""The option groups of a `Plan`: `MoEOptions` (`Plan.moe`) and `OverlapOptions`
(`Plan.overlap`); `mxgraph.plan` re-exports them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class MoEOptions:
    """Mixture-of-Experts options."""

    capacity_factor: float | None = None
    """None = dropless. Else each routed expert takes at most C = ceil(N / E * c) of the
    N (token, choice) rows of this rank's micro-batch (Megatron-Core's capacity, applied
    before the all-to-all); the rest are dropped (their expert output is 0) and every
    expert is padded to exactly C rows, so shapes are static: the all-to-all moves equal
    blocks and needs no row counts on the host. Must be > 0."""
    drop_policy: str = "probs"
    """Which rows an over-full expert keeps: "probs" the highest routing weights (the value
    that multiplies the expert's output in the combine), "position" the earliest rows
    (token order). Used with capacity_factor."""
    batched_gemm: bool = False
    """Run the capacity-padded experts as batched GEMMs over [experts, C, ...] (one `bmm`
    per projection) instead of a grouped GEMM or a loop over experts. Needs
    capacity_factor."""
    hot_experts: int = 0
    """k > 0: each step the k most-loaded routed experts (by this micro-batch's token
    counts over the EP group) are replicated on every EP rank of the group: their owners
    broadcast the weights, rows routed to them are computed where they are (they skip the
    all-to-all), and the replicas' weight gradients are summed back to the owner. Needs
    ep > 1 and k < experts per EP rank."""
    hot_threshold: float = 1.5
    """Replication runs while max/mean of the per-expert counts is at least this; once on,
    it stays on until the ratio falls below 0.9 x this (hysteresis, so it does not flap).
    1.0 = always on. Must be >= 1."""
    hot_min_rows: int | None = None
    """Rows (group-wide, per micro-batch) a hot expert needs to be replicated. None = the
    cost rule (FasterMoE's): replicate only when the bytes of the rows kept off the
    all-to-all (dispatch and combine, forward and backward) at least match the bytes its
    weights' broadcast and its gradients' reduction move. 0 = replicate the k hottest
    whenever replication is on."""
    adaptive_recompute_threshold: int | None = None
    """Tokens routed to one EP rank above which MoE layers run their recompute variant."""
    a2a_overlap: bool = False
    """Overlap the expert all-to-alls with compute: each MoE block runs as two chunks so one
    chunk's dispatch/combine flies during the other's experts, the shared expert and the
    experts' weight gradients run inside the all-to-alls' windows. Needs ep > 1 and
    overlap (its asynchronous collectives)."""


DROP_POLICIES = ("probs", "position")


@dataclass(kw_only=True)
class OverlapOptions:
    """Communication-compute overlap (`Plan(overlap=OverlapOptions(...))`; `overlap=True`
    is `OverlapOptions()`; in TOML an `[overlap]` table or `overlap = true`). Every part is
    bitwise-equal to overlap off except `tp_chunks > 1` (partial GEMMs round differently)."""

    reorder: bool = True
    """The collectives the sharding passes insert run asynchronously (a start and a wait):
    each starts as early as its inputs allow and is waited as late as its first use."""
    max_in_flight_mb: float = 512.0
    """MiB of collective buffers (inputs and outputs) in flight at once: the reorder pass
    starts a collective later rather than exceed it."""
    dp_buckets: bool = True
    """Each data-parallel gradient bucket starts its all-reduce (reduce-scatter under
    ZeRO-1) as soon as its last gradient is produced, in the last micro-batch's backward;
    the ZeRO-1 all-gather of updated parameters overlaps the next step's forward."""
    tp_chunks: int = 1
    """Split each sequence-parallel all-gather->matmul and matmul->reduce-scatter into this
    many chunks, so the transfer of one chunk overlaps the GEMM of another; 1 = off. Needs
    sequence_parallel; must divide each rank's rows (batch x local sequence)."""
    p2p: bool = True
    """Pipeline executor: receives posted ahead of their use, sends batched, and
    DualPipeV's F&B pairs interleaved."""
    copy_engine: bool = False
    """The data-parallel buckets' reductions and ZeRO-1's gathers run off the compute lane
    (`runtime/data_parallel/copy_engine.py`): on the CPU a separate thread; on a GPU a dedicated stream,
    through the collective library (copy-engine kernels are not built yet: needs
    `fallback=True` there)."""
    fallback: bool = False
    """Where copy_engine cannot use copy engines (a GPU in this version, or a device
    without them): run the transfers through the collective library from the dedicated
    lane (True) or refuse the plan (False)."""
