"""Communication report: bytes each collective kind moves, per parallel axis, per step and rank.

    report = comm_report(model, Plan(tp=8, dp=4), (tokens, targets))  # paper mesh, no run
    print(report.table())
    report.total(axis="tp", kind="all_reduce")                        # bytes

Everything is read from what the compiler produced, not from formulas:
* **graph** collectives: every call_function node whose target is an `mxgraph::` op with
  a non-None kind in `collectives.KIND`. Without pipelining, in the joint graph after the
  joint passes (the forward, and the backward AOTAutograd derived from each op's
  registered autograd; a value remat recomputes is a second node, so every node counts
  once per execution); phase from the node's `partitioner_tag`. With pipelining or
  micro-batches, in each stage's F/B/W programs, once per action this rank's schedule runs.
* **runtime** collectives (phase "runtime") that `Step` runs outside the graphs: the
  data-parallel reduction, one collective per gradient bucket as `runtime/data_parallel.py`
  lays out this rank's parameters (an all-reduce over dp, expert buckets over edp; with
  cp > 1 over dp_cp and edp_cp, summing the sequence parts too; with `zero1` a
  reduce-scatter of the gradients plus an all-gather of the updated parameters), and of
  the loss; with pp > 1 the p2p sends of stage boundary values (kind "send"; receives
  are the peers' sends), the loss broadcast and the all-reduce of parameters held by
  several pipeline ranks.

Volume convention (`collectives.py`): one call moves the full tensor's bytes (the
all-reduce's tensor, the all-gather's output, the reduce-scatter's and all-to-all's
input; an op's own rule in `collectives.VOLUME` where it has one), as Megatron-LM's
formulas count, not a ring's wire bytes. Data-dependent sizes (MoE token counts) count at
the upper bound their `torch._check`s give (`cost.concrete`), or by a caller's rule. With
pp > 1 the report is of one pipeline rank's stages (ranks differ).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from mxgraph.cost import concrete, schema_arg, tensor_meta
from mxgraph.runtime.collectives import KIND, VOLUME

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
AXIS_ORDER = ("tp", "cp", "ep", "dp", "edp", "dp_cp", "edp_cp", "pp")
PHASES = ("forward", "backward", "runtime")  # runtime: by Step, outside the graphs
_MiB = 2 ** 20


@dataclass(frozen=True)
class CommEntry:
    """One collective call (or one per scheduled action) on this rank."""

    axis: str
    kind: str
    phase: str
    bytes: int
    what: str  # the graph node's name, or what the runtime moves ("bucket0: ...", "loss")
    module: str = ""  # graph nodes: the module path the collective belongs to
    layer: int | None = None  # graph nodes: the layer index, None outside layers
    upper_bytes: int | None = None
    """`bytes` with data-dependent sizes at their upper bound (None: the same as bytes)."""

    @property
    def worst_case(self) -> int:
        return self.bytes if self.upper_bytes is None else self.upper_bytes


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


# ---- graph collectives ------------------------------------------------------------------
def size(value, unbacked=None) -> int:
    """An int for a dimension or a byte count: a data-dependent (unbacked) one counts at the
    upper bound its `torch._check`s give (`cost.concrete`), or at `unbacked(upper bound)`
    when given (e.g. an expected share of the worst case)."""
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except Exception:  # noqa: BLE001 - unbacked SymInt
        upper = concrete(value)
        return upper if unbacked is None else unbacked(upper)


def tensor_bytes(value, unbacked=None) -> int:
    """Bytes of the tensors in a meta value; unbacked sizes as in `size`."""
    return sum(math.prod(size(d, unbacked) for d in t.shape) * t.element_size()
               for t in tensor_meta(value))


def collective_call(node: torch.fx.Node, unbacked=None) -> tuple[str, str, int] | None:
    """(kind, group name, bytes) of a node that runs a KIND-listed mxgraph collective,
    else None. Bytes: `collectives.VOLUME`'s rule for the op if it has one, else per the
    convention (the all-gather's output, otherwise the tensor it is given); unbacked
    sizes as in `size`."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
            target.namespace != "mxgraph":
        return None
    name = target._schema.name.split("::", 1)[1]
    kind = KIND.get(name)
    if kind is None:
        return None
    if name in VOLUME:
        moved = size(VOLUME[name](node), unbacked)
    else:
        value = (node if kind == "all_gather" else node.args[0]).meta.get("val")
        moved = tensor_bytes(value, unbacked)
    return kind, schema_arg(node, "group_name"), moved


def graph_comm_bytes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Bytes per collective kind in one graph, over all groups (for dump summaries)."""
    totals = dict.fromkeys(KINDS[:4], 0)
    for node in gm.graph.nodes:
        call = collective_call(node)
        if call is not None:
            totals[call[0]] = totals.get(call[0], 0) + call[2]
    return totals


def graph_entries(gm: torch.fx.GraphModule, mesh, phase: str | None = None,
                  unbacked=None) -> list[CommEntry]:
    """One entry per collective node; `phase` None: from the node's partitioner_tag."""
    entries = []
    for node in gm.graph.nodes:
        call = collective_call(node, unbacked)
        if call is None:
            continue
        kind, group, moved = call
        upper = moved if unbacked is None else collective_call(node)[2]
        where = phase or ("backward" if node.meta.get("partitioner_tag") == "is_backward"
                          else "forward")
        custom = node.meta.get("custom") or {}
        entries.append(CommEntry(mesh.axis_of(group), kind, where, moved, node.name,
                                 custom.get("module", ""), custom.get("layer"), upper))
    return entries


# ---- runtime collectives ----------------------------------------------------------------
def data_parallel_entries(step) -> list[CommEntry]:
    """The data-parallel reduction `Step` runs after the graph, one collective per
    gradient bucket of this rank's parameters (`runtime/data_parallel.py`: expert
    buckets over "edp", others over "dp"; "edp_cp" and "dp_cp" with cp > 1): an all-reduce
    of the padded bucket, or with zero1 its reduce-scatter plus the all-gather of the
    updated parameters."""
    if step.mesh.sizes["dp_cp"] == 1:
        return []
    entries = []
    for i, bucket in enumerate(step._data_parallel().buckets):
        if bucket.group_size == 1:
            continue
        moved = bucket.padded_numel * bucket.params[0].element_size()
        what = f"bucket{i}: {len(bucket.names)} parameters"
        if step.plan.zero1:  # the all-gather runs at the next step's start: once per step
            entries.append(CommEntry(bucket.axis, "reduce_scatter", "runtime", moved, what))
            entries.append(CommEntry(bucket.axis, "all_gather", "runtime", moved, what))
        else:
            entries.append(CommEntry(bucket.axis, "all_reduce", "runtime", moved, what))
    return entries


def _joint_entries(step, compiled, unbacked) -> tuple[list[CommEntry], int]:
    """Graph entries and loss bytes of a single-graph step."""
    joint = compiled.joint
    outputs = joint.gm.graph.find_nodes(op="output")[0].args[0]
    return graph_entries(joint.gm, step.mesh, None, unbacked), tensor_bytes(outputs[0].meta.get("val"))


def _pipeline_entries(step, executor, unbacked) -> tuple[list[CommEntry], int]:
    """Collectives of this rank's F/B/W programs once per scheduled action, its p2p
    sends, the loss broadcast and the shared-parameter all-reduce over pp."""
    from mxgraph.schedules import B, BW, F, SEND_B, SEND_F, W
    mesh, rank = step.mesh, step.mesh.coords["pp"]
    programs = {}
    for stage, rt in executor.stages.items():
        for kind, program, phase in ((F, rt.programs.forward, "forward"),
                                     (B, rt.programs.backward_input, "backward"),
                                     (W, rt.programs.backward_weight, "backward")):
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
    params = dict(step.model.named_parameters(remove_duplicate=False))
    loss_bytes = torch.finfo(torch.float32).bits // 8  # the mean loss, fp32
    if mesh.sizes["pp"] > 1:
        entries.append(CommEntry("pp", "broadcast", "runtime", loss_bytes, "loss"))
        entries += [CommEntry("pp", "all_reduce", "runtime", tensor_bytes(params[name]),
                              f"shared {name}") for name, _ in executor.shared_params]
    return entries, loss_bytes


def report_of(step, compiled, unbacked=None) -> CommReport:
    """The report of one compiled signature of `step` (a `CompiledGraph` or a
    `PipelineExecutor`), for the rank at `step.mesh.coords`; `unbacked`: see `size`."""
    from mxgraph.runtime.pipeline import PipelineExecutor
    if isinstance(compiled, PipelineExecutor):
        entries, loss_bytes = _pipeline_entries(step, compiled, unbacked)
    else:
        entries, loss_bytes = _joint_entries(step, compiled, unbacked)
    entries += data_parallel_entries(step)
    if step.mesh.sizes["dp"] > 1:
        entries.append(CommEntry("dp", "all_reduce", "runtime", loss_bytes, "loss"))
    notes = [] if step.mesh.sizes["pp"] == 1 else [
        f"pipeline rank {step.mesh.coords['pp']} of {step.mesh.sizes['pp']} (ranks differ); "
        "receives are the peers' sends, not counted twice"]
    return CommReport(entries, notes)


def write_comm_dump(step, compiled, directory) -> None:
    """`comm.txt` in a dump directory: the report's table (see `mxgraph inspect DIR`)."""
    (directory / "comm.txt").write_text(report_of(step, compiled).table() + "\n")


def paper_mesh(plan):
    """A paper mesh (groups by name only) with the plan's axes; dp None counts as 1."""
    from mxgraph.runtime.mesh import Mesh
    return Mesh.on_paper(tp=plan.tp, pp=plan.pp, cp=plan.cp, dp=plan.dp or 1, ep=plan.ep)


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
    from mxgraph.compile import Step, _signature
    from mxgraph.passes.pipeline import check_pass_names
    from mxgraph.plan import require_built
    check_pass_names(plan.disable_passes)
    require_built(plan)
    model = copy.deepcopy(model)
    example_args, example_kwargs = _fake_cpu(model, example_args, example_kwargs or {})
    mesh = paper_mesh(plan)
    mesh.coords["pp"] = pp_rank
    step = Step(model, plan, mesh)
    step.prepare(*example_args, **example_kwargs)
    return report_of(step, step._compiled[_signature(example_args, example_kwargs)], unbacked)


def _fake_cpu(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Meta tensors (the model's and the inputs) become fake CPU tensors of one fake mode
    with a ShapeEnv, as `memory_plan` traces: kernels differ on the meta device (e.g. a
    sum-reduced nll_loss traced on meta lost its gradient, and so every gradient of the
    context-parallel llama above it)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    cpu = torch.device("cpu")

    def fake(value):
        is_meta = isinstance(value, torch.Tensor) and value.is_meta
        return FakeTensor(mode, value, cpu) if is_meta else value
    model._apply(fake)
    return torch.utils._pytree.tree_map(fake, (tuple(args), dict(kwargs)))
