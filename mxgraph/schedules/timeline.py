"""`Timeline`: the result of `simulate` — events, bubbles, memory — and its exports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mxgraph.schedules.action import BW, OVERLAP_F_B, Action, B, F, W

COLOURS = {F: "#4c72b0", B: "#55a868", W: "#8c8c8c", BW: "#dd8452", OVERLAP_F_B: "#8172b3"}


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class Timeline:
    schedule: Any  # Schedule (not imported: avoids a cycle with simulate)
    costs: Any
    events: list[Event]
    total_time: float
    busy: dict[int, float]
    """Time each rank spends running actions."""
    peak_activations: dict[int, float]
    """Peak activation units per rank (memory model in simulate.py)."""
    param_copies: dict[int, float]
    memory_trace: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """Per rank: (time, activation units) after each compute action."""

    @property
    def idle(self) -> dict[int, float]:
        return {r: self.total_time - b for r, b in self.busy.items()}

    @property
    def bubble_ratio(self) -> dict[int, float]:
        """Idle / total time, per rank."""
        t = self.total_time or 1.0
        return {r: (t - b) / t for r, b in self.busy.items()}

    @property
    def overall_bubble_ratio(self) -> float:
        """Idle / total time, summed over ranks."""
        t = self.total_time or 1.0
        return sum(t - b for b in self.busy.values()) / (t * len(self.busy))

    @property
    def peak_activation_microbatches(self) -> dict[int, float]:
        """Peak activation per rank in microbatches' worth of that rank's layers (a stage
        is num_ranks / num_stages of a rank's layers), comparable across schedules."""
        scale = self.schedule.num_ranks / self.schedule.num_stages
        return {r: v * scale for r, v in self.peak_activations.items()}

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (no events)."""
        return {
            "schedule": self.schedule.name,
            "num_ranks": self.schedule.num_ranks,
            "num_stages": self.schedule.num_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "total_time": self.total_time,
            "bubble_ratio": self.overall_bubble_ratio,
            "bubble_ratio_per_rank": [self.bubble_ratio[r] for r in sorted(self.busy)],
            "peak_activations_per_rank": [self.peak_activations[r] for r in sorted(self.busy)],
            "peak_activation_microbatches": max(self.peak_activation_microbatches.values(), default=0.0),
            "param_copies_per_rank": [self.param_copies[r] for r in sorted(self.busy)],
        }

    def to_text(self, *, slot: float = 1.0) -> str:
        """Ranks x time slots of width `slot`: each cell shows the compute action running at
        the start of the slot ('.' when idle). Readable with unit costs."""
        num_slots = int(round(self.total_time / slot))
        cells = {r: ["."] * num_slots for r in self.busy}
        for e in self.events:
            if e.action.is_compute:
                for k in range(int(round(e.start / slot)), int(round(e.end / slot))):
                    cells[e.rank][k] = str(e.action)
        width = max([len(c) for row in cells.values() for c in row] + [1])
        lines = ["time    " + " ".join(f"{k:>{width}}" for k in range(num_slots))]
        lines += [f" rank {r:<2} " + " ".join(f"{c:>{width}}" for c in cells[r]) for r in sorted(cells)]
        return "\n".join(lines)

    def to_chrome_trace(self, path: str, *, us_per_unit: float = 1.0) -> None:
        """Chrome / Perfetto trace: one thread per rank, one complete event per action."""
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
                 for r in sorted(self.busy)]
        for e in self.events:
            if e.end == e.start and not e.action.is_compute:
                continue
            trace.append({"name": str(e.action), "cat": e.action.kind, "ph": "X", "pid": 0,
                          "tid": e.rank, "ts": e.start * us_per_unit,
                          "dur": (e.end - e.start) * us_per_unit,
                          "args": {"stage": e.action.stage, "microbatch": e.action.microbatch}})
        with open(path, "w") as fh:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, fh)

    def to_png(self, path: str, *, title: str | None = None) -> None:
        """Ranks as rows (rank 0 on top), compute coloured by kind, labelled by microbatch."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        num_ranks = len(self.busy)
        compute = [e for e in self.events if e.action.is_compute]
        fig, ax = plt.subplots(figsize=(min(4 + self.total_time * 0.15, 40), 1 + 0.45 * num_ranks))
        label = len(compute) <= 600
        first_stage = {r: min(self.schedule.stages_of(r), default=0) for r in self.busy}
        for e in compute:
            y = num_ranks - 1 - e.rank
            # a rank's later stages (interleaved chunks, DualPipeV's way back) are lighter
            alpha = 1.0 if e.action.stage == first_stage[e.rank] else 0.65
            ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8), alpha=alpha,
                           facecolors=COLOURS[e.action.kind], edgecolors="white", linewidth=0.5)
            if label:
                text = "/".join(str(p.microbatch) for p in e.action.compute_parts())
                ax.text((e.start + e.end) / 2, y, text, ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(num_ranks), [f"rank {r}" for r in reversed(range(num_ranks))])
        ax.set_xlim(0, self.total_time or 1.0)
        ax.set_xlabel("time")
        ax.set_title(title or f"{self.schedule.name}: {num_ranks} ranks, {self.schedule.num_microbatches} "
                     f"microbatches, bubble {self.overall_bubble_ratio:.1%}")
        kinds = sorted({e.action.kind for e in compute}, key=list(COLOURS).index)
        ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
