"""Remat: recompute chosen forward values in the backward instead of saving them.

`remat_pass(gm, ctx)` reads `plan.recompute` (per stage: `plan.recompute_stages`) or
`plan.memory_budget`, finds the units of those kinds (rules in memory/regions.py) and calls
`apply_remat(gm, nodes)`.

Mechanism (`apply_remat`): for every forward value in the recompute set R that a backward
node reads, clone its producer chain (its inputs in R, recursively; inputs outside R are
read as they are, so they stay saved) right before its first backward use, and rewire the
backward users to the clone. The original then dies at its last forward use. Clones get
`partitioner_tag="is_backward"` and `meta["recomputed_from"]`.

Random ops are never cloned: the mask (a getitem of `native_dropout`) stays saved and a
needed dropout output is replayed as `native_dropout_backward(x, mask, 1/(1-p))`, which
is bitwise `x * mask * scale` as the forward computed it for fp32/fp64 (checked in
tests); in other dtypes the output is saved instead.

Budget (`plan.memory_budget`, bytes of saved activations): greedy over all units, cheapest
recompute FLOPs (`mxgraph.cost.node_cost`) per saved byte first, re-evaluating the saved
set after each choice, until the estimate fits; PlanError when even recomputing every unit
does not fit.

Precondition: a joint graph (forward nodes before backward nodes). Guarantee: the same
outputs; numerics bitwise equal (the same ops on the same inputs). Returns `gm` itself
when nothing is recomputed.
"""
from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext
from mxgraph.cost import node_cost
from mxgraph.errors import PlanError
from mxgraph.ir import insert_call, is_alias, is_backward, is_random, storage_roots
from mxgraph.memory_saved import node_bytes, size_hints
from mxgraph.passes.memory.regions import Unit, all_units
from mxgraph.plan import RECOMPUTE_KINDS, parse_list

aten = torch.ops.aten
log = logging.getLogger(__name__)


def policy_for_stage(plan, stage: int) -> tuple[str, ...]:
    return parse_list(plan.recompute_stages.get(stage, plan.recompute))


def remat_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Recompute by policy (or budget); see the module docstring."""
    plan = ctx.plan
    if plan.memory_budget is not None:
        chosen = choose_for_budget(gm, plan.memory_budget)
        nodes = set().union(*(u.nodes for u in chosen)) if chosen else set()
    else:
        kinds = set(parse_list(plan.recompute))
        for policy in plan.recompute_stages.values():
            kinds |= set(parse_list(policy))
        if not kinds:
            return gm
        nodes = set()
        for unit in all_units(gm, kinds):
            if unit.kind in policy_for_stage(plan, unit.stage):
                nodes |= unit.nodes
    if not nodes:
        return gm
    apply_remat(gm, nodes)
    return gm


def _replayable(node: Node) -> bool:
    """A dropout output getitem that can be rebuilt bitwise from its saved mask."""
    if getattr(node.target, "__name__", "") != "getitem" or node.args[1] != 0:
        return False
    parent = node.args[0]
    val = node.meta.get("val")
    return (isinstance(parent, Node) and parent.target is aten.native_dropout.default
            and isinstance(val, torch.Tensor) and val.dtype in (torch.float32, torch.float64))


def recompute_set(gm: GraphModule, nodes: set) -> set:
    """The nodes of `nodes` that may be cloned: tensor-valued forward ops, not random ops
    (their dropout outputs are replayed), not the masks."""
    out = set()
    for n in nodes:
        if n.op != "call_function" or is_backward(n):
            continue
        if is_random(n):
            continue
        if getattr(n.target, "__name__", "") == "getitem" and isinstance(n.args[0], Node) \
                and is_random(n.args[0]) and not _replayable(n):
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and val and all(
                isinstance(v, torch.Tensor) for v in val)):
            out.add(n)
    for n in list(out):  # constants (ones, arange, scalar_tensor) are remade, not saved
        for a in n.all_input_nodes:
            if a.op == "call_function" and not a.all_input_nodes and not is_random(a) and \
                    not is_backward(a) and isinstance(a.meta.get("val"), torch.Tensor):
                out.add(a)
    return out


def apply_remat(gm: GraphModule, nodes: set) -> int:
    """Clone the chains of `nodes` used by backward nodes; returns the number of clones."""
    graph = gm.graph
    recompute = recompute_set(gm, nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use: dict[Node, Node] = {}
    for node in graph.nodes:
        if node.op == "call_function" and is_backward(node):
            for arg in node.all_input_nodes:
                if arg in recompute and arg not in first_use:
                    first_use[arg] = node
    memo: dict[Node, Node] = {}

    def clone(value: Node) -> Node:
        if value in memo:
            return memo[value]
        if _replayable(value):
            dropout = value.args[0]
            x, p = dropout.args[0], dropout.args[1]
            mask = _mask_of(graph, dropout)
            source = clone(x) if x in recompute else x
            new = graph.call_function(aten.native_dropout_backward.default,
                                      (source, mask, 1.0 / (1.0 - p) if p < 1 else 0.0))
            new.meta.update(value.meta)
        else:
            new = graph.node_copy(value, lambda a: clone(a) if a in recompute else a)
        new.meta["partitioner_tag"] = "is_backward"
        new.meta["recomputed_from"] = value.name
        memo[value] = new
        return new

    for value, user in sorted(first_use.items(), key=lambda item: order[item[1]]):
        with graph.inserting_before(user):
            new = clone(value)
        clones = set(memo.values())
        for u in list(value.users):
            if is_backward(u) and u not in clones:
                u.replace_input_with(value, new)
    graph.lint()
    gm.recompile()
    return len(memo)


def _mask_of(graph, dropout: Node) -> Node:
    for u in dropout.users:
        if getattr(u.target, "__name__", "") == "getitem" and u.args[1] == 1:
            return u
    mask = insert_call(graph, operator.getitem, (dropout, 1), after=dropout)  # val: [1]
    mask.meta["partitioner_tag"] = dropout.meta.get("partitioner_tag")
    return mask


# ---- saved bytes for a recompute set, without rewriting ------------------------------

def saved_bytes_after(gm: GraphModule, nodes: set, roots=None, hints=None) -> int:
    """Estimated device bytes saved if `nodes` were recomputed (graph left unchanged)."""
    roots = roots or storage_roots(gm)
    hints = size_hints(gm) if hints is None else hints
    recompute = recompute_set(gm, nodes)
    graph_nodes = list(gm.graph.nodes)
    saved: set[Node] = set()
    needed: set[Node] = set()
    stack = []
    for node in graph_nodes:
        if node.op == "call_function" and is_backward(node):
            for arg in node.all_input_nodes:
                if arg in recompute:
                    if arg not in needed:
                        needed.add(arg)
                        stack.append(arg)
                elif not is_backward(arg):
                    saved.add(roots[arg])
        elif node.op == "output":
            for arg in node.all_input_nodes:
                if not is_backward(arg):
                    saved.add(roots[arg])
    while stack:
        value = stack.pop()
        inputs = list(value.all_input_nodes)
        if _replayable(value):
            inputs = [value.args[0].args[0]]
            saved.add(roots[next((u for u in value.args[0].users if u.args[1] == 1), value)])
        for arg in inputs:
            if arg in recompute:
                if arg not in needed:
                    needed.add(arg)
                    stack.append(arg)
            else:
                saved.add(roots[arg])
    return sum(node_bytes(n, hints) for n in saved
               if n.op == "call_function" and not is_backward(n))


def recompute_flops(nodes) -> int:
    return sum(node_cost(n).flops for n in nodes if not is_alias(n))


def choose_for_budget(gm: GraphModule, budget: int) -> list[Unit]:
    """Greedy: the units with the fewest recompute FLOPs per saved byte until the saved
    activations fit `budget` bytes."""
    roots, hints = storage_roots(gm), size_hints(gm)
    units = [u for u in all_units(gm, RECOMPUTE_KINDS)]
    chosen: list[Unit] = []
    current: set = set()
    saved = saved_bytes_after(gm, current, roots, hints)
    while saved > budget:
        best, best_score, best_saved = None, None, None
        for unit in units:
            if unit.nodes <= current:
                continue
            after = saved_bytes_after(gm, current | unit.nodes, roots, hints)
            gain = saved - after
            if gain <= 0:
                continue
            score = recompute_flops(unit.nodes - current) / gain
            if best_score is None or score < best_score:
                best, best_score, best_saved = unit, score, after
        if best is None:
            raise PlanError(f"memory_budget={budget} bytes cannot be met: recomputing every "
                            f"unit still saves {saved} bytes of activations")
        chosen.append(best)
        current |= best.nodes
        saved = best_saved
    log.info("remat budget %d: %d units, %d bytes saved", budget, len(chosen), saved)
    return chosen

