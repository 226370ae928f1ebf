"""One runner wraps every pass: skip by name, time, provenance, invariants, dump.

`run_pass(spec, gm, ctx)`:
  * returns `gm` untouched when `spec.name` is in `plan.disable_passes`;
  * tags every node the pass created with meta["created_by"] = pass name;
  * checks invariants (fx lint; every functional collective has a wait_tensor user; the
    pass introduced no mutating op) and raises `PassError` naming the pass;
  * appends a record to `ctx.records` and, with a dump dir, writes the dump.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import GraphModule

from mxgraph.comm import graph_comm_bytes
from mxgraph.context import CompileContext
from mxgraph.cost import graph_cost
from mxgraph.dump import write_dump
from mxgraph.memory import estimate_peak


class PassError(RuntimeError):
    """A pass broke an invariant of the graph."""


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: Callable[[GraphModule, CompileContext], GraphModule]
    phase: str  # "forward" (before autograd) or "joint" (forward+backward graph)
    why: str  # why it sits where it does in the pipeline


def run_pass(spec: PassSpec, gm: GraphModule, ctx: CompileContext) -> GraphModule:
    if spec.name in ctx.plan.disable_passes:
        return gm
    before = set(gm.graph.nodes)
    start = time.perf_counter()
    result = spec.fn(gm, ctx)
    elapsed = time.perf_counter() - start
    for node in result.graph.nodes:
        if node not in before:
            node.meta.setdefault("created_by", spec.name)
    check_invariants(result, spec.name, new_nodes=[n for n in result.graph.nodes
                                                   if n not in before])
    result.recompile()
    record(ctx, spec.name, spec.phase, result, elapsed)
    return result


def record(ctx: CompileContext, name: str, phase: str, gm: GraphModule,
           elapsed: float) -> dict:
    """Summarise the graph after a pass (or after capture/grad) and dump it."""
    flops, moved, unknown = graph_cost(gm)
    peak, resident = estimate_peak(gm)
    comm = graph_comm_bytes(gm)
    rec = {"index": ctx.pass_index, "pass": name, "phase": phase,
           "nodes": len(gm.graph.nodes), "flops": flops, "bytes": moved,
           "peak_mem": peak, "resident": resident, "unknown_ops": unknown,
           "time_ms": round(elapsed * 1e3, 2), "comm": comm}
    ctx.records.append(rec)
    if ctx.dump_dir is not None:
        line = (f"{rec['index']:02d} {name} phase={phase} nodes={rec['nodes']} "
                f"flops={flops} bytes={moved} peak_mem={peak} resident={resident} "
                f"unknown_ops={','.join(unknown) or '-'} time_ms={rec['time_ms']} " +
                " ".join(f"comm_{kind}={value}" for kind, value in comm.items()))
        write_dump(ctx.dump_dir, ctx.pass_index, name, gm, line)
    ctx.pass_index += 1
    return rec


def is_collective(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "_c10d_functional" and
            target.overloadpacket is not torch.ops._c10d_functional.wait_tensor)


def check_invariants(gm: GraphModule, pass_name: str, new_nodes=()) -> None:
    try:
        gm.graph.lint()
    except Exception as error:  # noqa: BLE001 - re-raised with the pass name
        raise PassError(f"pass {pass_name} left a malformed graph: {error}") from error
    waits = torch.ops._c10d_functional.wait_tensor.default
    for node in gm.graph.nodes:
        if is_collective(node):
            users = [u for u in node.users]
            # multi-output collectives are read through getitem, each waited on
            leaves = [v for u in users for v in (u.users if u.target is not waits and
                                                 not isinstance(u.target,
                                                                torch._ops.OpOverload)
                                                 else [u])]
            if not any(getattr(u, "target", None) is waits for u in leaves):
                raise PassError(f"pass {pass_name}: collective {node.name} has no wait_tensor")
    for node in new_nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            raise PassError(f"pass {pass_name} introduced the mutating op {target} "
                            f"({node.name}); graphs stay functional until codegen")
