"""The executor that runs a rank's programs: a stage's F, B and W programs and the data
between them (`programs.py`), run in schedule order (`executor.py`), with point-to-point
transfers posted ahead (`p2p.py`).

May import: torch, `mxgraph.errors`, `mxgraph.capture` (the model tensors by slot),
`mxgraph.schedules`, `runtime.cluster`, `runtime.monitor`. Never the passes, codegen, or
the driver.
"""
