"""`CompileContext`: everything a pass may read, passed explicitly (no module globals)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mxgraph.plan import Plan


@dataclass
class CompileContext:
    """The plan, where dumps go, and what the runner recorded so far."""

    plan: Plan
    mesh: object | None = None
    """This rank's `runtime.cluster.mesh.Mesh` (None: one device)."""
    dump_dir: Path | None = None
    monitor_level: int = 0
    """The level of the step's slow-node monitor (`Step.set_monitor`): 1 or more makes
    `monitor_points` give the generated code timing points (`passes/monitor_points.py`)."""
    pass_index: int = 0
    """Number of the next dump entry (shared by forward and joint passes)."""
    records: list[dict] = field(default_factory=list)
    """One summary record per pass run (see passes/runner.py)."""
    findings: list[str] = field(default_factory=list)
    """What the pass running now reports for people (a sharding pass: each op it had to
    gather); the runner moves them into the pass's record and dump entry."""

    @classmethod
    def for_plan(cls, plan: Plan, tag: str = "", mesh=None) -> "CompileContext":
        root = plan.dump_dir or os.environ.get("MXGRAPH_DUMP")
        dump_dir = Path(root) / tag if root and tag else (Path(root) if root else None)
        if dump_dir is not None:
            dump_dir.mkdir(parents=True, exist_ok=True)
            (dump_dir / "summary.txt").write_text("")
        return cls(plan=plan, mesh=mesh, dump_dir=dump_dir)
