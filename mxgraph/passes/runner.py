"""One runner wraps every step of the driver: skip by name, time, provenance, invariants,
dump.

`run_pass(spec, gm, ctx)`, for a graph pass (`gm -> gm`):
  * returns `gm` untouched when `spec.name` is in `plan.disable_passes`;
  * tags every node the pass created with meta["created_by"] = pass name;
  * checks invariants (`invariants.py`: fx lint, collectives, new nodes' meta, random
    ops, aliasing) and raises `PassError` naming the pass;
  * appends a record to `ctx.records` and, with a dump dir, writes the dump;
  * skips the checks and the recompile when the pass left the graph as it was (same nodes,
    targets, args, names, in the same order: `graph_fingerprint`).
`run_step(spec, compilation, ctx)`, for a structural step (capture, grad, split, codegen:
`steps.py`): times it, lints the graphs it produced, records and dumps them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from torch.fx import GraphModule

from mxgraph.comm_graph import graph_comm_bytes
from mxgraph.context import CompileContext
from mxgraph.cost import graph_cost
from mxgraph.dump import write_dump
from mxgraph.memory import estimate_peak
from mxgraph.passes.invariants import PassError, aliased_outputs, check_aliases, check_graph, check_new_nodes

__all__ = ["PassError", "PassSpec", "record_graphs", "run_pass", "run_step"]


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: Callable
    """A graph pass `fn(gm, ctx) -> gm` (phase "forward" or "joint"), or a structural step
    `fn(compilation, ctx) -> [(label, gm), ...]` (phase "step")."""
    phase: str  # "forward" (before autograd), "joint" (forward+backward graph) or "step"
    why: str  # why it sits where it does in the pipeline
    adds_random: bool = False
    """The pass may create random ops (a fused dropout); others may not (`invariants.py`)."""

    @property
    def required(self) -> bool:
        """Structural steps build what later steps read: they cannot be disabled."""
        return self.phase == "step"


def run_step(spec: PassSpec, compilation, ctx: CompileContext) -> None:
    """Run a structural step; lint, record and dump the graphs it returns."""
    start = time.perf_counter()
    graphs = spec.fn(compilation, ctx)
    elapsed = time.perf_counter() - start
    for label, gm in graphs:
        check_graph(gm, f"{spec.name} ({label})")
    record_graphs(ctx, spec.name, spec.phase, graphs, elapsed)


def run_pass(spec: PassSpec, gm: GraphModule, ctx: CompileContext,
             label: str = "") -> GraphModule:
    """Run a graph pass on one graph (`label`: which one, e.g. "stage1" of a pipeline)."""
    if spec.name in ctx.plan.disable_passes:
        return gm
    before, aliased = graph_fingerprint(gm), aliased_outputs(gm)
    start = time.perf_counter()
    result = spec.fn(gm, ctx)
    elapsed = time.perf_counter() - start
    if result is not gm or not same_fingerprint(before, graph_fingerprint(result)):
        old = {entry[0] for entry in before[1:]}
        new_nodes = [n for n in result.graph.nodes if n not in old]
        for node in new_nodes:
            node.meta.setdefault("created_by", spec.name)
        where = f"{spec.name} ({label})" if label else spec.name
        check_graph(result, where)
        check_new_nodes(new_nodes, where, ctx.mesh, spec.adds_random)
        check_aliases(result, aliased, where)
        result.recompile()
    # else the pass changed nothing fx's code is made of: the graph keeps the invariants
    # and the code it had (most passes do nothing for a given plan; a recompile of a joint
    # graph costs 50-100 ms)
    findings, ctx.findings = ctx.findings, []
    extra = {"findings": len(findings)} if findings else {}
    record = record_graphs(ctx, spec.name, spec.phase, [(label, result)], elapsed, **extra)
    record["finding_lines"] = findings
    if findings and ctx.dump_dir is not None:
        entry = ctx.dump_dir / f"{record['index']:02d}_{spec.name}"
        (entry / "findings.txt").write_text("\n".join(findings) + "\n")
    return result


def graph_fingerprint(gm: GraphModule) -> list[tuple]:
    """What fx generates a graph's code from, per node in order (op, target, args,
    kwargs, name, type) and the graph's codegen, held by identity: fx replaces a node's
    args and kwargs tuples when it changes them."""
    graph = gm.graph
    return [(graph._codegen,)] + [(n, n.op, n.target, n._args, n._kwargs, n.name, n.type)
                                  for n in graph.nodes]


def same_fingerprint(a: list[tuple], b: list[tuple]) -> bool:
    """Whether two fingerprints are of the same graph, unchanged (identity, field by field)."""
    return len(a) == len(b) and all(len(p) == len(q) and all(x is y for x, y in zip(p, q, strict=True))
                                    for p, q in zip(a, b, strict=True))


def record_graphs(ctx: CompileContext, name: str, phase: str,
                  graphs: list[tuple[str, GraphModule]], elapsed: float,
                  **extra) -> dict:
    """Summarise the graphs a step left (sums over them; the largest peak) and dump them:
    one record and one dump entry per step run. `extra`: more summary fields. The cost
    fields (flops, bytes, peak, unknown ops, comm) are computed only for a dump: they read
    every node of every graph, a second of a 20M-parameter compile."""
    labels = [label for label, _ in graphs if label]
    rec = {"index": ctx.pass_index, "pass": name, "phase": phase,
           "graphs": ",".join(labels) or "-",
           "nodes": sum(len(gm.graph.nodes) for _, gm in graphs),
           "time_ms": round(elapsed * 1e3, 2), **extra}
    ctx.records.append(rec)
    if ctx.dump_dir is None:
        ctx.pass_index += 1
        return rec
    flops = moved = peak = resident = 0
    unknown: list[str] = []
    comm: dict[str, int] = {}
    for _, gm in graphs:
        cost = graph_cost(gm)
        flops, moved = flops + cost[0], moved + cost[1]
        unknown += [op for op in cost[2] if op not in unknown]
        graph_peak = estimate_peak(gm)
        peak, resident = max(peak, graph_peak[0]), max(resident, graph_peak[1])
        for kind, value in graph_comm_bytes(gm).items():
            comm[kind] = comm.get(kind, 0) + value
    rec.update(flops=flops, bytes=moved, peak_mem=peak, resident=resident, unknown_ops=unknown,
               comm=comm)
    line = (f"{rec['index']:02d} {name} phase={phase} graphs={rec['graphs']} "
            f"nodes={rec['nodes']} flops={flops} bytes={moved} peak_mem={peak} "
            f"resident={resident} unknown_ops={','.join(unknown) or '-'} "
            f"time_ms={rec['time_ms']} " +
            " ".join([f"{key}={value}" for key, value in extra.items()] +
                     [f"comm_{kind}={value}" for kind, value in comm.items()]))
    write_dump(ctx.dump_dir, ctx.pass_index, name, graphs, line)
    ctx.pass_index += 1
    return rec
