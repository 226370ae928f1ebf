"""Sharding: where each value of the forward graph lives over the mesh, and the passes that
split the graph by it.

Owns: placements (`placement.py`: Replicate, Shard(dim), Partial), the propagation engine
(`propagate.py`) and its per-op rules (`rules.py`, two-operand einsums in `einsum.py`),
token-local regions (`token_local.py`: a routed-MoE block on token shards), in-place
writes through views kept in their storage (`writes.py`), tensor, context and expert
parallelism (`tp.py`, `cp.py`, `ep.py`, with the hot-expert frame
`ep_hot.py`), and the discovery of routed-MoE blocks by dataflow (`moe_blocks.py`, over
the op sets of `moe_dataflow.py`).

May import: `mxgraph.ir`, `errors`, `plan`, `context`, the analyses (`cost`,
`memory_saved`), and the runtime ops it inserts (`mxgraph.runtime.collectives`,
`runtime.moe_stats`). Not the other pass packages, nor the driver's modules of `passes/`.
"""
