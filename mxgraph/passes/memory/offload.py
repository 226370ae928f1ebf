"""Offload: move chosen saved activations to the host between forward and backward.

`plan.offload` is a comma list of entries `[scope:]kind`: kind in `OFFLOAD_KINDS`
(all, attn, mlp, norm, act, moe) and an optional scope `stageN` or `layerN`, e.g.
"all", "attn,mlp", "stage0:all", "layer1:attn,layer2:all". A saved value (a storage root
alive across the forward/backward boundary, after remat) is offloaded when its producer
belongs to a unit of that kind (memory/regions.py rules; "moe" = the MoE block, "all" =
any producer) in that scope. Values used by the graph output are kept.

For each such value `x` (runtime/offload.py):
  h = mxgraph::offload(x, pool, key)            inserted right after x
  d = mxgraph::prefetch(h, pool, key, device)   `plan.offload_prefetch` backward nodes
                                                before the first backward use
  d = wait_prefetch(d, pool, key)               right before the first backward use
and the backward users of `x` (or of forward views of `x`, re-created on `d`) read `d`.

Precondition: a joint graph; runs after remat. Guarantee: the same outputs; numerics
bitwise equal (copies are exact). Returns `gm` itself when nothing is offloaded.
"""
from __future__ import annotations

import re

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext
from mxgraph.ir import insert_call, is_alias, is_backward, storage_roots
from mxgraph.memory_saved import saved_roots
from mxgraph.passes.memory.regions import all_units, layer_of, stage_of
from mxgraph.plan import parse_offload
from mxgraph.runtime.offload import new_pool, wait_prefetch

_UNIT_KIND = {"attn": "attn", "mlp": "mlp", "norm": "norm", "act": "act", "moe": "moe_full"}


def offload_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Offload saved activations by `plan.offload`; see the module docstring."""
    entries = parse_offload(ctx.plan.offload)
    if not entries:
        return gm
    chosen = choose_values(gm, entries)
    if not chosen:
        return gm
    apply_offload(gm, chosen, distance=ctx.plan.offload_prefetch)
    return gm


def _in_scope(node: Node, scope: str | None) -> bool:
    if scope is None:
        return True
    match = re.fullmatch(r"(stage|layer)(\d+)", scope)
    kind, index = match.group(1), int(match.group(2))
    return (stage_of(node) if kind == "stage" else layer_of(node)) == index


def choose_values(gm: GraphModule, entries) -> list[Node]:
    device, _ = saved_roots(gm)
    output = gm.graph.find_nodes(op="output")[0]
    roots = storage_roots(gm)
    kept = {roots[a] for a in output.all_input_nodes}
    kinds = {_UNIT_KIND[k] for _, k in entries if k != "all"}
    members: dict[str, set] = {}
    for unit in all_units(gm, kinds) if kinds else []:
        members.setdefault(unit.kind, set()).update(unit.nodes)
    chosen = []
    for value in device:
        if value in kept:
            continue
        for scope, kind in entries:
            if not _in_scope(value, scope):
                continue
            if kind == "all" or value in members.get(_UNIT_KIND[kind], ()):
                chosen.append(value)
                break
    return chosen


def apply_offload(gm: GraphModule, values: list[Node], distance: int = 1) -> int:
    graph = gm.graph
    pool = new_pool()
    gm.meta["offload_pool"] = pool
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    backward = [n for n in nodes if n.op == "call_function" and is_backward(n)]
    for key, value in enumerate(values):
        family = _forward_aliases(value)  # value and its forward views
        users = [u for member in family for u in member.users if is_backward(u)]
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        at = max(0, backward.index(first) - distance) if first in backward else 0
        fake = value.meta["val"]
        host = insert_call(graph, torch.ops.mxgraph.offload.default, (value, pool, key),
                           after=value, like=value,
                           val=torch.empty(fake.shape, dtype=fake.dtype, device="meta"))
        host.meta["partitioner_tag"] = value.meta.get("partitioner_tag", "is_forward")
        back = insert_call(graph, torch.ops.mxgraph.prefetch.default,
                           (host, pool, key, fake.device), before=backward[at], like=value,
                           val=fake)
        ready = insert_call(graph, wait_prefetch, (back, pool, key), before=first, like=value,
                            val=fake)
        for node in (back, ready):
            node.meta["partitioner_tag"] = "is_backward"
        with graph.inserting_before(first):
            copies = {value: ready}
            for member in family[1:]:  # re-create the forward views on the prefetched value
                copy = graph.node_copy(member, lambda a, copies=copies: copies.get(a, a))
                copy.meta["partitioner_tag"] = "is_backward"
                copies[member] = copy
        for member, replacement in copies.items():
            for u in list(member.users):
                if is_backward(u) and u is not replacement and u not in copies.values():
                    u.replace_input_with(member, replacement)
    graph.lint()
    gm.recompile()
    return len(values)


def _forward_aliases(value: Node) -> list[Node]:
    """`value` then its forward alias descendants, in an order where parents come first."""
    out, stack = [value], [value]
    while stack:
        n = stack.pop()
        for u in n.users:
            if not is_backward(u) and u.op == "call_function" and is_alias(u) and u not in out:
                out.append(u)
                stack.append(u)
    return out
