"""Reorder: start each asynchronous collective as early as its inputs allow and wait for
it as late as its first use, within a budget of bytes in flight.

Only starts and waits move; every other node keeps its place, so the values are bitwise
those of overlap off. Rules, per collective (a start and its `wait_tensor`, as
`overlap/async_collectives.py` writes them):

* the start goes right after the last of its inputs, but not before the first node of its
  part of the joint graph (a backward collective stays in the backward: a recomputed
  all-gather must not start in the forward and hold its buffer in between);
* the wait goes right before its first user, but not past the end of its part (a forward
  collective whose value only the backward reads is waited at the end of the forward);
* walking the new order, the bytes of the collectives in flight (inputs and outputs) stay
  within `Plan.overlap.max_in_flight_mb`: a start that would exceed it waits until earlier
  waits free enough (a collective larger than the budget runs alone).

Starts keep their relative order (every rank of a group issues its collectives in the same
order, so none waits on a peer that started a different one), and so do waits.

Why our own pass: torch's fx `schedule_overlap_bucketing` (torch 2.13) estimates every
compute node with a roofline that reads the GPU's memory bandwidth through triton's active
driver before it consults a custom estimate; on a machine without a GPU that raises, and
CI has none.
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from mxgraph import comm_graph
from mxgraph.context import CompileContext
from mxgraph.ir import is_backward
from mxgraph.passes.overlap.async_collectives import STARTS, WAIT

MiB = 2 ** 20


def tensor_bytes(node: Node) -> int:
    """Bytes of a node's tensor; a data-dependent size (the dropless expert all-to-alls'
    rows) counts at the upper bound its `torch._check`s give (`comm_graph.tensor_bytes`)."""
    value = node.meta.get("val")
    return comm_graph.tensor_bytes(value) if hasattr(value, "numel") else 0


def collective_bytes(start: Node) -> int:
    """Input and output bytes of the collective `start` starts."""
    return tensor_bytes(start) + tensor_bytes(start.args[0])


def overlap_reorder_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Move starts early and waits late (module docstring).

    Precondition: `overlap_async` ran (each wait follows its start). Guarantee: the same
    nodes, a valid topological order, starts and waits each in their original relative
    order, in-flight bytes within the budget. Numerics: bitwise equal.
    """
    if ctx.plan.overlap is None or not ctx.plan.overlap.reorder:
        return gm
    budget = int(ctx.plan.overlap.max_in_flight_mb * MiB)
    order = reorder(list(gm.graph.nodes), budget)
    _apply(gm, order)
    return gm


def reorder(nodes: list[Node], budget: int) -> list[Node]:
    """The new order of `nodes` (a graph's, in order)."""
    starts = [n for n in nodes if n.op == "call_function" and n.target in STARTS]
    waits = {s: next(u for u in s.users if u.target is WAIT) for s in starts}
    moved = set(starts) | set(waits.values())
    rest = [n for n in nodes if n not in moved and n.op != "output"]
    position = {n: i for i, n in enumerate(rest)}
    boundary = next((i for i, n in enumerate(rest) if is_backward(n)), len(rest))
    inputs = sum(n.op == "placeholder" for n in rest)

    def part_start(node: Node) -> int:
        return boundary if is_backward(node) else inputs

    def part_end(node: Node) -> int:
        return len(rest) if is_backward(node) else boundary

    # slot i: before rest[i] (len(rest) = at the end, before the output node)
    earliest, latest = {}, {}
    for start in starts:
        after_inputs = max((position[a] + 1 for a in start.all_input_nodes if a in position),
                           default=0)
        earliest[start] = max(after_inputs, part_start(start))
    for start, wait in waits.items():
        first_use = min((position[u] for u in wait.users if u in position), default=len(rest))
        latest[wait] = max(min(first_use, part_end(start)), earliest[start])
    # keep the relative order of starts, and of waits (a later start never jumps ahead)
    for a, b in zip(starts, starts[1:], strict=False):
        earliest[b] = max(earliest[b], earliest[a])
    wait_list = [waits[s] for s in starts]
    for a, b in zip(reversed(wait_list[:-1]), reversed(wait_list[1:]), strict=True):
        latest[a] = min(latest[a], latest[b])
    for start in starts:  # a wait never before its start
        latest[waits[start]] = max(latest[waits[start]], earliest[start])
    return _schedule(rest, starts, waits, earliest, latest, budget) + [
        n for n in nodes if n.op == "output"]


def _schedule(rest, starts, waits, earliest, latest, budget) -> list[Node]:
    """Lay out the nodes: at each slot, the waits due there, then the starts that fit."""
    out: list[Node] = []
    pending = list(starts)  # not started yet, in order
    in_flight: list[Node] = []  # started, not waited, in order
    held = 0

    def issue(start):
        nonlocal held
        pending.remove(start)
        in_flight.append(start)
        held += collective_bytes(start)
        out.append(start)

    def finish(start):
        nonlocal held
        if start in pending:  # deferred by the budget up to its own wait
            issue(start)
        in_flight.remove(start)
        held -= collective_bytes(start)
        out.append(waits[start])

    for slot in range(len(rest) + 1):
        for start in [s for s in in_flight + pending if latest[waits[s]] == slot]:
            finish(start)
        while pending and earliest[pending[0]] <= slot and (
                not in_flight or held + collective_bytes(pending[0]) <= budget):
            issue(pending[0])
        if slot < len(rest):
            out.append(rest[slot])
    return out


def _apply(gm: GraphModule, order: list[Node]) -> None:
    """Relink `gm`'s nodes in `order` (whose last node is the output)."""
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)
    gm.graph.lint()
    gm.recompile()
