"""Collectives in a graph: which mxgraph ops move data, over which group, how many bytes.

Below the passes (the runner counts each graph's communication for the dump summary) and
below the communication report (`mxgraph.comm`), which adds what the runtime moves.

Volume convention (`runtime/collectives/tp.py`): one call moves the full tensor's bytes (the
all-reduce's tensor, the all-gather's output, the reduce-scatter's and all-to-all's input;
an op's own rule in `collectives.groups.VOLUME` where it has one), as Megatron-LM's formulas
count, not a ring's wire bytes. Data-dependent sizes (MoE token counts) count at the upper
bound their `torch._check`s give (`cost.concrete`), or by a caller's rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mxgraph.cost import concrete, tensor_meta
from mxgraph.ir import schema_arg
from mxgraph.runtime.collectives.groups import KIND, VOLUME

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send")
FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
"""torch's functional collectives (the asynchronous form, Plan.overlap) by op name."""


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
    else None. Bytes: `collectives.groups.VOLUME`'s rule for the op if it has one, else per the
    convention (the all-gather's output, otherwise the tensor it is given); unbacked
    sizes as in `size`."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace == "_c10d_functional" and target.__name__.split(".")[0] in FUNCTIONAL:
        kind = FUNCTIONAL[target.__name__.split(".")[0]]  # a start of overlap_async.py's
        value = (node if kind == "all_gather" else node.args[0]).meta.get("val")
        return kind, node.args[-1], tensor_bytes(value, unbacked)
    if target.namespace != "mxgraph":
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
