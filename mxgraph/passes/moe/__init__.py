"""MoE options that change how the routed experts run (`Plan.moe`): capacity-padded experts
with static shapes and equal-block all-to-alls (`capacity.py`, `moe.capacity_factor`).

May import: `mxgraph.ir`, `errors`, `plan`, `context`, the runtime ops it inserts
(`mxgraph.runtime.collectives`, `runtime.moe_stats`), and the public names of
`passes.sharding` (the MoE blocks it pads are the ones expert parallelism finds, and under
ep it shards them with the same sharder). Not the other pass packages.
"""
