"""Communication report: bytes each collective kind moves, per parallel axis, per step and rank.

    report = comm_report(model, Plan(tp=8, dp=4), (tokens, targets))  # paper mesh, no run
    print(report.table())
    report.total(axis="tp", kind="all_reduce")                        # bytes

Everything is read from what the compiler produced, not from formulas:
* **graph** collectives: every call_function node whose target is an `mxgraph::` op with
  a non-None kind in `collectives.groups.KIND` (`comm_graph.py`), in each of this rank's stages'
  F/B/W programs (the joint graph after the joint passes, cut by the B/W split: the
  forward, and the backward AOTAutograd derived from each op's registered autograd; a
  value remat recomputes is a second node), once per action this rank's schedule runs
  (without pipelining: one stage, F and BW once per micro-batch); phase "forward" in F,
  "backward" in B and W.
* **runtime** collectives (phase "runtime") that `Step` runs outside the graphs: the
  data-parallel reduction, one collective per gradient bucket as `runtime/data_parallel/buckets.py`
  lays out this rank's parameters (an all-reduce over dp, expert buckets over edp; with
  cp > 1 over dp_cp and edp_cp, summing the sequence parts too; with `zero1` a
  reduce-scatter of the gradients plus an all-gather of the updated parameters), and of
  the loss; with pp > 1 the p2p sends of stage boundary values (kind "send"; receives
  are the peers' sends), the loss broadcast and the all-reduce of parameters held by
  several pipeline ranks.

Volume convention: see `comm_graph.py` (Megatron-LM's: the full tensor's bytes per call).
With pp > 1 the report is of one pipeline rank's stages (ranks differ).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from mxgraph.comm_graph import KINDS, CommEntry, graph_entries, tensor_bytes
from mxgraph.context import CompileContext
from mxgraph.driver import check_plan, compile_step, fake_model, paper_mesh
from mxgraph.runtime.data_parallel.buckets import Bucket, bucket_layout
from mxgraph.runtime.pipeline.executor import PipelineExecutor
from mxgraph.schedules import BW, SEND_B, SEND_F, B, F, W

AXIS_ORDER = ("tp", "cp", "ep", "dp", "edp", "dp_cp", "edp_cp", "pp")
PHASES = ("forward", "backward", "runtime")  # runtime: by Step, outside the graphs
_MiB = 2 ** 20


@dataclass
class CommReport:
    """The collectives of one training step on one rank (see module docstring)."""

    entries: list[CommEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Remarks on what the numbers cover, in words (printed under the table)."""

    def total(self, axis: str | None = None, kind: str | None = None,
              phase: str | None = None) -> int:
        return sum(e.bytes for e in self._select(axis, kind, phase))

    def calls(self, axis: str | None = None, kind: str | None = None,
              phase: str | None = None) -> int:
        return len(self._select(axis, kind, phase))

    def _select(self, axis, kind, phase) -> list[CommEntry]:
        return [e for e in self.entries if (axis is None or e.axis == axis) and
                (kind is None or e.kind == kind) and (phase is None or e.phase == phase)]

    def by_kind(self) -> dict[str, int]:
        """Bytes per collective kind, every kind of KINDS listed (0 when absent)."""
        return {kind: self.total(kind=kind) for kind in KINDS}

    def rows(self) -> list[dict]:
        """One row per (axis, kind) present: calls and bytes per phase."""
        keys = {(e.axis, e.kind) for e in self.entries}
        ordered = sorted(keys, key=lambda k: (_order(AXIS_ORDER, k[0]), _order(KINDS, k[1])))
        return [{"axis": axis, "kind": kind, "calls": self.calls(axis, kind),
                 **{phase: self.total(axis, kind, phase) for phase in PHASES},
                 "total": self.total(axis, kind),
                 "upper_bound": sum(e.worst_case for e in self._select(axis, kind, None))}
                for axis, kind in ordered]

    def table(self) -> str:
        header = (f"{'axis':<6} {'kind':<15} {'calls':>6} {'forward':>12} {'backward':>12} "
                  f"{'runtime':>12} {'total':>12}   (MiB per rank per step)")
        lines = [header]
        for row in self.rows():
            lines.append(f"{row['axis']:<6} {row['kind']:<15} {row['calls']:>6} " +
                         " ".join(f"{row[k] / _MiB:>12.2f}" for k in PHASES + ("total",)))
        lines.append(f"{'all':<6} {'':<15} {len(self.entries):>6} " +
                     " ".join(f"{self.total(phase=p) / _MiB:>12.2f}" for p in PHASES) +
                     f" {self.total() / _MiB:>12.2f}")
        worst = sum(e.worst_case for e in self.entries)
        if worst != self.total():
            lines.append(f"note: data-dependent sizes by the caller's rule; at their upper "
                         f"bound the total is {worst / _MiB:.2f} MiB")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _order(names: tuple, name: str) -> int:
    return names.index(name) if name in names else len(names)


# ---- runtime collectives ----------------------------------------------------------------
def data_parallel_entries(buckets: list[Bucket], zero1: bool) -> list[CommEntry]:
    """The data-parallel reduction `Step` runs after the graphs, one collective per
    gradient bucket of this rank's parameters (`runtime/data_parallel/buckets.py`: expert buckets
    over "edp", others over "dp"; "edp_cp" and "dp_cp" with cp > 1): an all-reduce of the
    padded bucket, or with zero1 its reduce-scatter plus the all-gather of the updated
    parameters."""
    entries = []
    for i, bucket in enumerate(buckets):
        if bucket.group_size == 1:
            continue
        moved = bucket.padded_numel * bucket.params[0].element_size()
        what = f"bucket{i}: {len(bucket.names)} parameters"
        if zero1:  # the all-gather runs at the next step's start: once per step
            entries.append(CommEntry(bucket.axis, "reduce_scatter", "runtime", moved, what))
            entries.append(CommEntry(bucket.axis, "all_gather", "runtime", moved, what))
        else:
            entries.append(CommEntry(bucket.axis, "all_reduce", "runtime", moved, what))
    return entries


def program_entries(executor: PipelineExecutor, unbacked=None) -> list[CommEntry]:
    """Collectives of this rank's F/B/W programs once per scheduled action, its p2p sends,
    and with pp > 1 the loss broadcast and the shared-parameter all-reduce over pp."""
    mesh, rank = executor.mesh, executor.mesh.coords["pp"]
    programs = {}
    for stage, rt in executor.stages.items():
        for kind, program in rt.programs.all():
            phase = "forward" if kind == F else "backward"
            programs[(stage, kind)] = graph_entries(program.gm, mesh, phase, unbacked)
    entries = []
    for action in executor.schedule.actions[rank]:
        for part in action.compute_parts() or (action,):
            rt = executor.stages.get(part.stage)
            kinds = (B, W) if part.kind == BW else (part.kind,)
            for kind in kinds:
                entries += programs.get((part.stage, kind), [])
            if part.kind in (SEND_F, SEND_B):
                metas = rt.output_meta if part.kind == SEND_F else rt.activation_meta
                entries.append(CommEntry("pp", "send", "forward" if part.kind == SEND_F
                                         else "backward", tensor_bytes(list(metas)),
                                         f"{part}"))
    if mesh.sizes["pp"] > 1:
        params = dict(executor.model.named_parameters(remove_duplicate=False))
        entries.append(CommEntry("pp", "broadcast", "runtime",
                                 tensor_bytes(executor.loss_meta), "loss"))
        entries += [CommEntry("pp", "all_reduce", "runtime", tensor_bytes(params[name]),
                              f"shared {name}") for name, _ in executor.shared_params]
    return entries


def report_of(executor: PipelineExecutor, buckets: list[Bucket], zero1: bool,
              unbacked=None) -> CommReport:
    """The report of one compiled input signature (its executor) for the rank at
    `executor.mesh.coords`, with this rank's gradient buckets; `unbacked`: see
    `comm_graph.size`."""
    mesh = executor.mesh
    entries = program_entries(executor, unbacked)
    if mesh.sizes["dp_cp"] > 1:
        entries += data_parallel_entries(buckets, zero1)
    if mesh.sizes["dp"] > 1:
        entries.append(CommEntry("dp", "all_reduce", "runtime",
                                 tensor_bytes(executor.loss_meta), "loss"))
    notes = [] if mesh.sizes["pp"] == 1 else [
        f"pipeline rank {mesh.coords['pp']} of {mesh.sizes['pp']} (ranks differ); "
        "receives are the peers' sends, not counted twice"]
    return CommReport(entries, notes)


def write_comm_dump(report: CommReport, directory) -> None:
    """`comm.txt` in a dump directory: the report's table (see `mxgraph inspect DIR`)."""
    (directory / "comm.txt").write_text(report.table() + "\n")


def comm_report(model: torch.nn.Module, plan, example_args: tuple,
                example_kwargs: dict | None = None, unbacked=None,
                pp_rank: int = 0) -> CommReport:
    """Compile `model`'s step under `plan` for one rank of a paper mesh (`Mesh.on_paper`;
    the first rank of pipeline rank `pp_rank`) and report its communication, running
    nothing. Build the model and the example inputs on the meta device for big configs
    (`models.build_model(name, device="meta")`). Data-dependent sizes (MoE all-to-all
    rows) count at their upper bound, or at `unbacked(upper bound)` when given.
    PlanError when the plan asks for something not built yet (`plan.NOT_BUILT`). `model`
    is left as it was (a copy is compiled: the passes shard parameters)."""
    check_plan(plan)
    model, (args, kwargs) = fake_model(copy.deepcopy(model), (tuple(example_args),
                                                               dict(example_kwargs or {})))
    mesh = paper_mesh(plan)
    mesh.coords["pp"] = pp_rank
    ctx = CompileContext.for_plan(plan, mesh=mesh)
    compilation = compile_step(model, plan, mesh, ctx, args, kwargs)
    buckets = bucket_layout(compilation.executor.model_parameters(),
                            compilation.layouts, plan, mesh)
    report = report_of(compilation.executor, buckets, plan.zero1, unbacked)
    if ctx.dump_dir is not None:
        write_comm_dump(report, ctx.dump_dir)
    return report
