"""Communication-compute overlap (`Plan.overlap`): collectives become a start and a wait
(`async_collectives.py`), starts move early and waits late (`reorder.py`), sequence-parallel
GEMMs run in chunks under their collectives (`tp_chunks.py`), and the expert all-to-alls'
windows fill with independent compute (`moe.py`).

May import: `mxgraph.ir`, `errors`, `plan`, `context`, `comm_graph`, and the runtime ops it
inserts (`mxgraph.runtime.collectives`). Not the other pass packages.
"""
