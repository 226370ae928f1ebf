"""Expert all-to-all windows: fill the time between each expert all-to-all's start and its
wait with compute that does not depend on it (`Plan.moe.a2a_overlap`).

`overlap/async_collectives.py` lowers the expert all-to-alls to a start and a `wait_tensor`
(`EXPERT_STARTS`) and `overlap/reorder.py` starts each right after its inputs and waits
right before its first use; what lies between is only what the user's code happened to
place there. This pass moves independent compute into each window [start, wait]:

* sink: the nodes placed before the start, back to the previous barrier, that the start
  does not read (directly or not), e.g. the experts' weight-gradient GEMMs in the
  backward, move to right after the start, provided each of their users that lies before
  the start moves too;
* hoist: the nodes placed after the wait, up to the next barrier, that do not read the
  wait's output (directly or not), e.g. the shared expert, which user code runs after the
  routed experts, move to right before the wait, provided each of their inputs that lies
  after the wait moves too.

A barrier is a collective start or wait of any kind (functional starts, `wait_tensor`,
synchronous mxgraph collectives such as `ep_counts`), a placeholder, the output, or the
edge of the forward or backward part (`ir.is_backward`): no node crosses another
collective (every rank keeps issuing its collectives in the same order, against the same
compute) nor leaves its part. Never moved: collectives, placeholders, the output, random
ops (`ir.is_random`: the generator's draws keep their order), mutating ops and impure ones
(asserts). Moved nodes keep their relative order. Windows are filled in graph order, each
one's sink before its hoist, so a node between two all-to-alls that the second one does
not read goes to the first window when it does not read the first one's result either.

Precondition: `overlap_async` and `overlap_reorder` ran with `moe.a2a_overlap` (each expert
all-to-all a start of `EXPERT_STARTS` with its `wait_tensor`). Guarantee: the same nodes
in a valid topological order, moved only as above. Numerics: bitwise equal (only the
order of nodes changes, and no random draw's).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext
from mxgraph.ir import ancestors, descendants, is_backward, is_mutating, is_random
from mxgraph.passes.overlap.async_collectives import EXPERT_STARTS, STARTS, WAIT
from mxgraph.runtime.collectives.groups import KIND


def overlap_moe_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Fill each expert all-to-all's window by sinking and hoisting (module docstring).

    Precondition: `overlap_async` and `overlap_reorder` ran (each expert all-to-all is a
    start in `EXPERT_STARTS` with one `wait_tensor` user). Runs only with
    `Plan.moe.a2a_overlap`. Guarantee: the same nodes in a valid topological order; no
    node crossed a collective start or wait other than the one whose window it entered,
    nor left its part; collectives, random, mutating and impure ops in place. Numerics:
    bitwise equal (only the order changes). Returns `gm` itself when nothing moved.
    """
    if not getattr(ctx.plan.moe, "a2a_overlap", False):
        return gm
    starts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in EXPERT_STARTS]
    moved = 0
    for start in starts:
        wait = next(u for u in start.users if u.target is WAIT)
        moved += sink(start) + hoist(wait)
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm


def is_barrier(node: Node) -> bool:
    """A node nothing moves across: a collective start or wait, a synchronous mxgraph
    collective (`collectives.groups.KIND` names what it moves), a placeholder or the output."""
    if node.op in ("placeholder", "output", "root"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in STARTS or target is WAIT:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace in ("_c10d_functional", "c10d"):
        return True
    return target.namespace == "mxgraph" and KIND.get(target._schema.name.split("::")[1]) \
        is not None


def is_movable(node: Node) -> bool:
    """A compute node this pass may move (the part and dependencies aside)."""
    if node.op != "call_function" or is_barrier(node):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return not (is_random(node) or is_mutating(node) or node.is_impure())
    return not node.is_impure()


def _region(anchor: Node, forward: bool) -> list[Node]:
    """The nodes next to `anchor` (after it if `forward`, else before it, nearest first)
    up to the first barrier or the edge of anchor's part."""
    part, region = is_backward(anchor), []
    node = anchor.next if forward else anchor.prev
    while not is_barrier(node) and is_backward(node) == part:
        region.append(node)
        node = node.next if forward else node.prev
    return region


def sink(start: Node) -> int:
    """Move the nodes before `start` that it does not read to right after it; the count."""
    region = _region(start, forward=False)  # nearest first: users before their inputs
    inside = set(region)
    read = ancestors([start], keep=lambda n: n in inside)
    moving: set[Node] = set()
    for node in region:
        if node not in read and is_movable(node) and \
                all(u in moving or u not in inside for u in node.users):
            moving.add(node)
    anchor = start
    for node in reversed(region):  # graph order
        if node in moving:
            anchor.append(node)
            anchor = node
    return len(moving)


def hoist(wait: Node) -> int:
    """Move the nodes after `wait` that do not read its output to right before it; the
    count."""
    region = _region(wait, forward=True)  # graph order: inputs before their users
    inside = set(region)
    reading = descendants([wait], keep=lambda n: n in inside)
    moving: set[Node] = set()
    for node in region:
        if node not in reading and is_movable(node) and \
                all(a in moving or a not in inside for a in node.all_input_nodes):
            moving.add(node)
    for node in region:
        if node in moving:
            wait.prepend(node)
    return len(moving)
