"""The collectives sharded graphs call, as differentiable `torch.library` custom ops.

Owns: the registry every collective op declares itself in and process groups by name
(`groups.py`: `KIND`, `VOLUME`, `GROUP_SIZES`), tensor and sequence parallelism's ops
(`tp.py`), context parallelism's (`cp.py`), expert parallelism's all-to-alls (`ep.py`;
asynchronous form `ep_async.py`; hot-expert replication `ep_hot.py`), the
vocabulary-parallel cross-entropy (`vocab_parallel.py`), and the layout ops around torch's
functional collectives (`async_layout.py`).

May import: torch, `mxgraph.errors`, `runtime.moe_stats`. Never the passes, codegen, or the
driver.
"""
