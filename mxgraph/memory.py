"""Liveness-based peak-memory estimate of a graph, in bytes.

Nodes run in graph order. Placeholders (parameters, inputs) are resident for the whole
run. A node's outputs are allocated when it runs and freed after their last use; a view
allocates nothing and keeps its base alive until the view's own last use. The peak is
the largest sum of live bytes at any node, counting the node's inputs and outputs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import Node

from mxgraph.cost import value_bytes
from mxgraph.ir import IDENTITY_OPS


def storage_root(node: Node, roots: dict[Node, Node]) -> Node:
    """The node whose allocation keeps `node`'s value alive (itself unless it aliases).

    Views and `IDENTITY_OPS` alias their first input; a getitem aliases the multi-output
    op it reads, so all outputs of such an op live as long as the last one is used. This
    is a liveness model, coarser than `mxgraph.ir.storage_roots` (the saved-activation
    count, where only the getitems of view ops alias and `_unsafe_view` does too).
    """
    target = node.target
    aliases = node.op == "call_function" and (
        getattr(target, "__name__", "") == "getitem"
        or (isinstance(target, torch._ops.OpOverload)
            and (target.is_view or target in IDENTITY_OPS)))
    if aliases and node.all_input_nodes:
        base = node.all_input_nodes[0]
        return roots.get(base, base)
    return node


def estimate_peak(gm: torch.fx.GraphModule,
                  share: Callable[[Node], float] | None = None) -> tuple[int, int]:
    """(peak bytes, resident bytes of placeholders); `share(node)`: the part of the node's
    bytes that counts (default all; 0 for a value a fused kernel keeps on chip, or one
    counted elsewhere)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    roots: dict[Node, Node] = {}
    last_use: dict[Node, int] = {}
    for node in nodes:
        roots[node] = storage_root(node, roots)
        last_use[roots[node]] = max(last_use.get(roots[node], 0), order[node])
        for arg in node.all_input_nodes:
            last_use[roots[arg]] = max(last_use.get(roots[arg], 0), order[node])
    resident = sum(value_bytes(n) for n in nodes if n.op == "placeholder")
    frees: dict[int, int] = {}
    live = peak = resident
    for node in nodes:
        if node.op == "call_function" and roots[node] is node:
            size = value_bytes(node) * (1 if share is None else share(node))
            live += size
            peak = max(peak, live)
            frees[last_use[node]] = frees.get(last_use[node], 0) + size
        live -= frees.pop(order[node], 0)
    return peak, resident
