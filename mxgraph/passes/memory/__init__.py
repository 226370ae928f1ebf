"""Memory passes on joint graphs: recompute (`remat.py`, by the units `regions.py` finds from
graph structure and ops: norm, activation, attention, MLP, MoE, layer) and activation
offload to the host (`offload.py`).

May import: `mxgraph.ir`, `errors`, `plan`, `context`, the analyses (`memory_saved`,
`cost`), and the runtime ops it inserts (`mxgraph.runtime.offload`). Not the other pass
packages.
"""
