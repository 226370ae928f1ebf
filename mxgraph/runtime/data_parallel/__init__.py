"""Data parallelism at run time: gradient buckets reduced over dp (x cp) and ZeRO-1 shards
of the optimizer state (`buckets.py`), reductions started inside the backward as DDP does
(`overlap.py`, `Plan.overlap.dp_buckets`), and the transfer lane they run on in copy-engine
mode (`copy_engine.py`).

May import: torch, `mxgraph.errors`, `runtime.cluster` (the mesh's groups). Never the
passes, codegen, or the driver.
"""
