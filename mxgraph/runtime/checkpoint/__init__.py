"""Flash checkpoint: snapshots in host shared memory in the step, persisted to disk behind it.

Owns: the checkpointer (`flash.py`: `FlashCheckpointer`), the shared-memory slots
(`shm.py`), the copies between live tensors and slots (`copies.py`), the on-disk DCP layout
(`disk.py`), the per-node saver process (`saver.py`, `python -m
mxgraph.runtime.checkpoint.saver`), what training state is captured (`state.py`), and the
check that a checkpoint fits the run that resumes from it (`match.py`).

May import: torch, `mxgraph.errors`. Never the passes, codegen, or the driver.
"""
