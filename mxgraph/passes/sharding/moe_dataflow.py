"""The dataflow vocabulary of the MoE block finder (`sharding/moe_blocks.py`): the op sets it
matches, node helpers, and row-wise regions.

A row-wise region (`RowRegions.region`) starts at a tensor of rows [N, ...] and takes
every node computed from it that keeps dim 0 as the row, each output row from the same
input row (pointwise ops, casts, copies, views keeping dim 0, chunk/split/slice/unbind
along another dim, transposes and permutes keeping dim 0, norms and softmax over other
dims, matmuls whose other operand is no data, batched GEMMs over the rows, grouped GEMMs
reading the rows), provided its other inputs are no data (computed from no user input)
or allowed by the caller (the offsets of a grouped GEMM, gathered expert weights). The
region's boundary is the users it refused: the ops that stop it. `RowRegions` also finds
the routing around a block: the nearest top-k a value is computed from, the first combine
after one, and per-row gathers B[ids] of per-expert tensors. Nothing here changes a graph.
"""
from __future__ import annotations

import heapq
import operator

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxgraph.ir import CAST_OPS, COPY_LIKE_OPS, VIEW_OPS, descendants, op_name, packet

aten = torch.ops.aten

GROUPED_GEMMS = frozenset({"mxgraph::grouped_mm", "aten::_grouped_mm",
                           "transformers::grouped_mm_fallback"})
"""Grouped GEMMs with offsets, by op name (`ir.op_name`): (rows, weights [E, I, O], offs)."""
BATCHED_GEMMS = frozenset({aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
                           aten.einsum.default})
"""Batched matmuls: over per-row gathered weights (gathered), or over experts (capacity)."""
WEIGHT_VIEWS = COPY_LIKE_OPS | {aten.transpose.int, aten.permute.default}
"""Ops between a stacked expert weight [E, ...] and its read that keep dim 0."""
SINKS = frozenset({aten._assert_tensor_metadata.default})
"""Ops that read a value and produce nothing (never an exit's user)."""
ROUTERS = frozenset({aten.topk.default, aten.max.dim})
"""Ops whose indices (output 1) route rows to experts; `argmax` too (its output)."""
COMBINES = frozenset({aten.index_add.default, aten.index_add_.default, aten.scatter_add.default,
                      aten.scatter_add_.default, aten.index_put.default, aten.index_put_.default,
                      aten.scatter_reduce.two, aten.sum.dim_IntList})
"""Ops that sum expert output rows into tokens."""
_DIM_1 = frozenset({aten.unbind.int, aten.select.int, aten.slice.Tensor, aten.narrow.default})
_DIM_2 = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
_FIRST_ONLY = frozenset({aten.linear.default, aten.mm.default, aten.matmul.default,
                         aten.rms_norm.default, aten.layer_norm.default,
                         aten.native_layer_norm.default})
_ALONG_DIM = frozenset({aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                        aten._log_softmax.default, aten.unsqueeze.default, aten.squeeze.dim})


def module_of(node: Node) -> str:
    return (node.meta.get("custom") or {}).get("module") or "<top>"


def where(node: Node) -> str:
    """`aten.bmm at layers.1.mlp.experts` (for messages)."""
    return f"{packet(node)} at {module_of(node)}"


def is_param(node) -> bool:
    return isinstance(node, Node) and node.op == "placeholder" and \
        node.meta.get("mx_slot_kind") == "param"


def val_of(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def is_dim0(dim: int, ndim: int) -> bool:
    return (dim % ndim if ndim else 0) == 0


def is_grouped_gemm(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        op_name(node) in GROUPED_GEMMS


def grouped_args(node: Node) -> tuple[Node, Node, Node]:
    """(rows, weights, offs) of a grouped GEMM, positional or keyword."""
    names = [a.name for a in node.target._schema.arguments[:3]]
    return tuple(node.args[i] if i < len(node.args) else node.kwargs[n]
                 for i, n in enumerate(names))


def expert_weight(node: Node) -> tuple[Node, list[Node]] | None:
    """The parameter `node` reads whole through views keeping dim 0, and the views."""
    chain = []
    while node.op == "call_function" and node.target in WEIGHT_VIEWS:
        ndim = node.args[0].meta["val"].dim()
        if (node.target is aten.transpose.int and any(is_dim0(d, ndim) for d in node.args[1:3])) \
                or (node.target is aten.permute.default and not is_dim0(node.args[1][0], ndim)):
            return None
        chain.append(node)
        node = node.args[0]
    return (node, chain) if is_param(node) else None


def count_of(value) -> tuple[Node, int] | None:
    """(counts, e) when `value` is item(unbind(counts)[e]) or item(select(counts, 0, e))."""
    if not isinstance(value, Node) or value.target is not aten.item.default:
        return None
    src = value.args[0]
    if src.target is operator.getitem and src.args[0].target is aten.unbind.int and \
            (src.args[0].args[1:] or (0,))[0] == 0:
        return src.args[0].args[0], src.args[1]
    if src.target is aten.select.int and src.args[1] == 0:
        return src.args[0], src.args[2]
    return None


def gather_index(node: Node, value: Node) -> Node | None:
    """ids when `node` is value[ids] or index_select(value, 0, ids), ids 1-D."""
    if node.target is aten.index.Tensor and node.args[0] is value and len(node.args[1]) == 1:
        ids = node.args[1][0]
    elif node.target is aten.index_select.default and node.args[0] is value and \
            is_dim0(node.args[1], value.meta["val"].dim()):
        ids = node.args[2]
    else:
        return None
    return ids if isinstance(val_of(ids), torch.Tensor) and ids.meta["val"].dim() == 1 else None


def data_dependent(graph: Graph) -> set[Node]:
    """The user inputs and every node computed from them."""
    data = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.meta.get("mx_slot_kind") == "input") or (
                node.op == "call_function" and any(a in data for a in node.all_input_nodes)):
            data.add(node)
    return data




class RowRegions:
    """Row-wise regions of one graph and the routing around them (module docstring)."""

    def __init__(self, gm: GraphModule):
        self.graph = gm.graph
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.data = data_dependent(self.graph)

    # ---- row-wise regions ---------------------------------------------------------------
    def keeps_rows(self, node: Node, region: set[Node], rows) -> bool:
        """`node`, reading region values, keeps dim 0 as the row (module docstring)."""
        target, first = node.target, node.args[0] if node.args else None
        if target is operator.getitem:
            return first in region
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if target in _DIM_1 or target in _DIM_2:
            index = 1 if target in _DIM_1 else 2
            dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
            return first in region and not is_dim0(dim, first.meta["val"].dim())
        value = val_of(node)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or \
                not statically_known_true(value.shape[0] == rows):
            return False
        if target in COPY_LIKE_OPS or target in CAST_OPS or torch.Tag.pointwise in target.tags:
            return all(a.meta["val"].dim() == value.dim() for a in node.all_input_nodes
                       if a in region)  # no broadcast of the rows into new leading dims
        if target is aten.transpose.int:
            return not any(is_dim0(d, value.dim()) for d in node.args[1:3])
        if target is aten.permute.default:
            return is_dim0(node.args[1][0], value.dim())
        if target in _ALONG_DIM:
            return not is_dim0(node.args[1], value.dim() + (target is aten.unsqueeze.default))
        if target in _FIRST_ONLY:
            return [a for a in node.all_input_nodes if a in region] == [first]
        if target in VIEW_OPS or target in (aten.bmm.default, aten.baddbmm.default):
            return True  # dim 0 kept: the batch dim is the row
        return is_grouped_gemm(node) and grouped_args(node)[0] in region

    def region(self, start: Node, allowed=lambda user, value: False
               ) -> tuple[set[Node], list[Node]]:
        """`start` and the nodes computed from it row-wise (`keeps_rows`) whose other inputs
        are no data (or `allowed(user, value)`), in graph order; and the boundary: users of
        region nodes refused (the ops that stop the region)."""
        rows = start.meta["val"].shape[0]
        region, boundary, seen = {start}, [], {start}
        todo = [(self.order[u], u) for u in start.users]
        heapq.heapify(todo)
        while todo:
            _, node = heapq.heappop(todo)
            if node in seen or node.target in SINKS:
                continue
            seen.add(node)
            if node.op != "call_function" or not self.keeps_rows(node, region, rows) or any(
                    a not in region and a in self.data and not allowed(node, a)
                    for a in node.all_input_nodes):
                boundary.append(node)
                continue
            region.add(node)
            for user in node.users:
                heapq.heappush(todo, (self.order[user], user))
        return region, boundary

    # ---- routing, combine -----------------------------------------------------------------
    def nearest_router(self, starts: list[Node]) -> Node | None:
        """The nearest top-k/argmax whose indices the `starts` are computed from."""
        todo, seen = list(starts), set()
        while todo:
            node = todo.pop(0)
            if node in seen:
                continue
            seen.add(node)
            if node.target is operator.getitem and node.args[0].target in ROUTERS:
                if node.args[1] == 1:
                    return node.args[0]
            elif node.target is aten.argmax.default:
                return node
            else:
                todo.extend(node.all_input_nodes)
        return None

    def combine_of(self, start: Node | None) -> Node | None:
        """The first op after `start` (in graph order) that sums rows into tokens."""
        later = descendants([start]) if start is not None else set()
        return min((n for n in later if n.target in COMBINES), key=self.order.get, default=None)

    def row_gathers(self, num: int, rows, router: Node | None
                    ) -> dict[Node, tuple[Node, list[Node]]]:
        """Gathers B[ids] (`index`, `index_select` on dim 0) of a parameter B [num, ...]
        (through views keeping dim 0) by integer ids [rows] computed from the top-k
        `router`: per-expert tensors read per row sorted by expert. gather -> (B, views)."""
        found = {}
        for param in self.graph.find_nodes(op="placeholder") if router is not None else ():
            if not is_param(param) or param.meta["val"].dim() == 0 or \
                    param.meta["val"].shape[0] != num:
                continue
            for view in descendants([param], keep=lambda u: u.target in WEIGHT_VIEWS):
                for user in view.users:
                    ids = gather_index(user, view)
                    if ids is None or not statically_known_true(ids.meta["val"].shape[0] == rows) \
                            or ids.meta["val"].dtype.is_floating_point or \
                            self.nearest_router([ids]) is not router:
                        continue
                    weight = expert_weight(view)
                    if weight is not None and weight[0] is param:
                        found[user] = weight
        return found

    def exits(self, region: set[Node]) -> list[Node]:
        return sorted((n for n in region if any(u not in region and u.target not in SINKS
                                                 for u in n.users)), key=self.order.get)


__all__ = ["BATCHED_GEMMS", "COMBINES", "GROUPED_GEMMS", "ROUTERS", "SINKS", "WEIGHT_VIEWS",
           "RowRegions", "count_of", "data_dependent", "expert_weight", "gather_index", "grouped_args",
           "is_dim0", "is_grouped_gemm", "is_param", "module_of", "val_of", "where"]
