"""Saved activations of a joint graph: what the step keeps between forward and backward.

The joint graph runs forward nodes first, then backward nodes (`partitioner_tag`). The
*saved activations* are the tensors produced by forward nodes that are still alive when
the first backward node runs (parameters and inputs excluded): exactly what a forward
module would pass to a backward module if the graph were split at that point.

* `saved_roots(gm)` / `estimate_saved(gm)`: from the graph alone (no run). A value
  is counted once per storage (`mxgraph.ir.storage_roots`): views, `_unsafe_view` and the
  getitems of a view-returning op (split, unbind) share their base's storage; the getitems
  of other multi-output ops (attention, layer norm, topk) own their storage. Data-dependent (unbacked) sizes
  count at their balanced share (see `size_hints`). Values moved to the host by the
  offload pass count apart, as host bytes.
* `measure_saved(gm, args)`: runs the graph (an fx Interpreter that frees each value
  after its last use, like the generated code) and, right before the first backward node,
  sums the storages of the live tensors that are not parameters or inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from mxgraph.capture import flat_inputs, model_tensors, slot_tensor
from mxgraph.cost import concrete, tensor_meta
from mxgraph.ir import is_backward, storage_roots

aten = torch.ops.aten


def size_hints(gm: torch.fx.GraphModule) -> dict:
    """Hints for unbacked sizes: the pieces of a `split_with_sizes` whose sizes are
    data-dependent get the balanced share of the split dimension (the sum is exact, so
    per-expert tensors of a dropless MoE add up to the right total)."""
    hints = {}
    for node in gm.graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
        sizes = node.args[1]
        val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        if val is None:
            continue
        dim = node.args[2] if len(node.args) > 2 else 0
        total = val.shape[dim]
        if not isinstance(total, int):
            continue
        for size in sizes:
            value = size.meta.get("val") if isinstance(size, Node) else size
            if isinstance(value, torch.SymInt) and value.node.expr.free_symbols:
                for symbol in value.node.expr.free_symbols:
                    hints[symbol] = total / len(sizes)
    return hints


def node_bytes(node: Node, hints: dict | None = None) -> int:
    """Bytes of the tensors `node` produces, unbacked sizes at their hint when known."""
    total = 0
    for t in tensor_meta(node.meta.get("val")):
        numel = 1
        for dim in t.shape:
            numel *= _dim(dim, hints or {})
        total += int(numel) * t.element_size()
    return total


def _dim(dim, hints: dict) -> float:
    if isinstance(dim, int):
        return dim
    expr = dim.node.expr
    if hints and expr.free_symbols and expr.free_symbols <= set(hints):
        return float(expr.xreplace(hints))
    return concrete(dim)


def boundary(gm: torch.fx.GraphModule) -> int | None:
    """Index (in graph order) of the first backward node; None for a forward-only graph."""
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "call_function" and is_backward(node):
            return i
    return None


@dataclass
class SavedSummary:
    device_bytes: int
    host_bytes: int
    values: list[tuple[str, int]]  # (root node name, bytes), device-resident only


def saved_roots(gm: torch.fx.GraphModule) -> tuple[list[Node], list[Node]]:
    """(device roots, host roots) alive across the forward/backward boundary."""
    nodes = list(gm.graph.nodes)
    start = boundary(gm)
    if start is None:
        return [], []
    order = {n: i for i, n in enumerate(nodes)}
    roots = storage_roots(gm)
    last = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            root = roots[arg]
            last[root] = max(last.get(root, -1), order[node])
    device, host = [], []
    for node in nodes[:start]:
        if node.op != "call_function" or roots[node] is not node:
            continue
        if last.get(node, -1) >= start and tensor_meta(node.meta.get("val")):
            (host if is_host_value(node) else device).append(node)
    return device, host


def is_host_value(node: Node) -> bool:
    return getattr(node.target, "_mxgraph_host", False) or str(node.target).startswith(
        "mxgraph.offload")


def estimate_saved(gm: torch.fx.GraphModule) -> SavedSummary:
    hints = size_hints(gm)
    device, host = saved_roots(gm)
    values = [(n.name, node_bytes(n, hints)) for n in device]
    return SavedSummary(sum(b for _, b in values), sum(node_bytes(n, hints) for n in host),
                        values)


class _BoundaryProbe(torch.fx.Interpreter):
    """Runs the graph; before the first backward node, records the live storages."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=True)
        self.start = boundary(gm)
        self.index = 0
        self.result: SavedSummary | None = None
        self.placeholder_storages: set[int] = set()

    def run_node(self, node):
        if node.op == "placeholder":
            value = super().run_node(node)
            for t in _tensors(value):
                self.placeholder_storages.add(t.untyped_storage().data_ptr())
            self.index += 1
            return value
        if self.index == self.start and self.result is None:
            self.result = self._live()
        self.index += 1
        return super().run_node(node)

    def _live(self) -> SavedSummary:
        seen: set[int] = set(self.placeholder_storages)
        device = host = 0
        values = []
        for node, value in self.env.items():
            for t in _tensors(value):
                storage = t.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage.data_ptr())
                if is_host_value(node):
                    host += storage.nbytes()
                else:
                    device += storage.nbytes()
                    values.append((node.name, storage.nbytes()))
        return SavedSummary(device, host, values)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def measure_saved(gm: torch.fx.GraphModule, args: list) -> SavedSummary:
    """Run `gm` on `args` (no autograd) and measure the saved activations."""
    probe = _BoundaryProbe(gm)
    with torch.no_grad():
        probe.run(*args)
    return probe.result or SavedSummary(0, 0, [])


def step_joint(step, *args) -> tuple[torch.fx.GraphModule, list]:
    """The joint graph (after the joint passes) of a compiled step without pipelining, and
    the inputs it takes for `args` (the loss's incoming gradient: 1)."""
    executor = step.compiled(*args)
    (runtime,) = executor.stages.values()
    tensors, flat = model_tensors(step.model), flat_inputs(args, {})
    inputs = []
    for slot in runtime.joint.inputs:
        if slot.kind == "tangent":
            inputs.append(torch.ones((), dtype=executor.loss_meta.dtype, device=step.mesh.device))
        elif slot.kind == "input":
            inputs.append(flat[runtime.user_inputs[slot.key]])
        else:
            inputs.append(slot_tensor(slot, tensors, runtime.constants))
    return runtime.joint.gm, inputs


def measure_step(step, *args) -> SavedSummary:
    """Measure the saved activations of a compiled step without pipelining (its one
    stage's joint graph after the joint passes), for inputs `args`."""
    return measure_saved(*step_joint(step, *args))


def relative_gap(estimate: int, measured: int) -> float:
    return abs(estimate - measured) / max(measured, 1)


__all__ = ["SavedSummary", "boundary", "estimate_saved", "measure_saved", "measure_step",
           "node_bytes", "relative_gap", "saved_roots", "size_hints"]
