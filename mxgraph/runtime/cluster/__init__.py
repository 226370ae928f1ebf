"""Where this process runs: the device layer (`device.py`: MetaX under MXMACA, NVIDIA, the
CPU; its collective backend and capabilities), the device mesh of a plan with one process
group per parallel axis (`mesh.py`), and joining the job torchrun started (`launch.py`).

May import: torch, `mxgraph.errors`, `mxgraph.plan`, `runtime.collectives` (paper group sizes),
`runtime.checkpoint` (the state a restarted worker resumes). Never the passes, codegen, or
the driver.
"""
