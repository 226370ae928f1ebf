"""Slow-node detection: time step sections on every rank, compare ranks, name the slow one
(`slow_node.py`: `StepMonitor`, `MonitorConfig`, the timers compiled programs call).

May import: torch, `mxgraph.errors`, `runtime.collectives` (process groups by name). Never
the passes, codegen, or the driver.
"""
