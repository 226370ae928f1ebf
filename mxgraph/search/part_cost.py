"""The cost of one traced node by class, for Auto Search's layer costs (`layer_cost.py`):
GEMM FLOPs with their shapes, attention FLOPs, memory-bound bytes; collectives apart.

    part = PartCost()
    add_node(part, node, ep=1)          # a node of a traced joint graph
    part.gemms, part.gemm_shapes, part.attention, part.memory
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from mxgraph.cost import concrete, node_cost, tensor_meta
from mxgraph.ir import ATTENTION_OPS, COPY_OPS, MATMUL_OPS, from_sdpa, is_alias, packet

GROUPED = {"grouped_mm", "grouped_mm_wgrad"}
ATTENTION_BACKWARD = {"_scaled_dot_product_flash_attention_backward",
                      "_scaled_dot_product_flash_attention_for_cpu_backward",
                      "_scaled_dot_product_efficient_attention_backward",
                      "_scaled_dot_product_cudnn_attention_backward"}


@dataclass
class PartCost:
    """One layer kind's work in one program (F, B or W) for one micro-batch on one rank."""

    gemms: list[float] = field(default_factory=list)
    """FLOPs of each GEMM call."""
    gemm_shapes: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """Each GEMM's (batch, m, n, k, grows) beside `gemms` (empty when not known): `grows`
    is the index (0-3) of the dimension that grows with the micro-batch (-1: none found)."""
    attention: list[float] = field(default_factory=list)
    """FLOPs of each attention call."""
    memory: list[float] = field(default_factory=list)
    """Bytes of each other kernel (memory-bound)."""
    comm: list[tuple[str, str, float]] = field(default_factory=list)
    """(axis, kind, bytes) of each collective call."""

    @property
    def flops(self) -> float:
        return sum(self.gemms) + sum(self.attention)


@dataclass(frozen=True)
class FusedAttention:
    """The S x S values of math attention (`fused_attention`) and whether it is causal."""

    numels: frozenset
    """Element counts of the traced score/probability matrices (batch x heads x Sq x Sk)."""
    keys: frozenset
    """Their last dim (Sk)."""
    causal: bool
    ops: frozenset = frozenset()
    """Autograd sequence numbers (`meta["seq_nr"]`) of the ops an SDPA call decomposed
    into: with its S x S matrices, its casts of q, k, v to the math dtype, their scaling
    and the output's cast back, and (same numbers) the gradients of all of these."""

    def scores(self, value) -> bool:
        """`value` (a node's meta value) is one of the S x S matrices."""
        shape = getattr(value, "shape", None)
        return shape is not None and len(shape) >= 2 and concrete(shape[-1]) in self.keys \
            and numel(shape) in self.numels

    def on_chip(self, node) -> bool:
        """The node's value stays inside the fused kernel: an S x S matrix, or a value of
        the decomposed call that only the call's own ops read (q, k, v cast and scaled,
        the fp32 output before its cast back; their gradients alike)."""
        if self.scores(node.meta.get("val")):
            return True
        return node.meta.get("seq_nr") in self.ops and bool(node.users) and all(
            user.meta.get("seq_nr") in self.ops for user in node.users)

    def holds(self, node) -> bool:
        """The node reads or writes one of the S x S matrices, or is an op of a decomposed
        SDPA call (`ops`): a fused kernel reads q, k, v as they are and scales on chip."""
        return node.meta.get("seq_nr") in self.ops or any(
            self.scores(value) for value in
            [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes])


SOFTMAX = {torch.ops.aten._softmax, torch.ops.aten._safe_softmax,
           torch.ops.aten._softmax_backward_data}


def fused_attention(gm, seq_len: int, cp: int) -> FusedAttention | None:
    """Math attention (two bmms around a softmax over keys: what the trace holds when no
    SDPA kernel takes the shapes, as MLA's q/k head dim 192 against v's 128 on the CPU)
    as the fused kernel a GPU runs (FlashAttention-2/3, cuDNN's fused attention: the
    `flash_attention` device flag): its S x S scores and probabilities stay on chip, so
    the elementwise kernels over them (mask, softmax, scale, casts, softmax backward)
    move no HBM bytes, and its bmms are the attention kernel's FLOPs, half of them
    under a causal mask (the kernel skips the masked blocks, as `cost._attention_flops`
    counts SDPA). Softmaxes whose last two dims are query and key lengths (the local
    sequence, or the whole one under cp) mark it; a triangular mask of that shape makes it
    causal. An SDPA call the trace decomposed into math (its ops' `meta["torch_fn"]` names
    it) casts q, k, v to fp32 and scales q and k first; those ops and their gradients are the
    fused kernel's too (`FusedAttention.ops`), as is a contiguous copy of its output
    (`_output_copy`). None when the graph has none (SDPA kernels are priced by their own
    rules)."""
    lengths = {seq_len, seq_len // cp}
    numels, keys, causal, ops = set(), set(), False, set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("seq_nr") is not None and (from_sdpa(node) or _output_copy(node)):
            ops.add(node.meta["seq_nr"])
        shape = getattr(node.meta.get("val"), "shape", None)
        if shape is None or len(shape) < 2 or not {concrete(shape[-1]), concrete(shape[-2])} <= lengths:
            continue
        if packet(node) in SOFTMAX and len(shape) >= 3:
            numels.add(numel(shape))
            keys.add(concrete(shape[-1]))
        elif packet(node) in (torch.ops.aten.tril, torch.ops.aten.triu):
            causal = True
    return FusedAttention(frozenset(numels), frozenset(keys), causal, frozenset(ops)) \
        if numels else None


def _output_copy(node) -> bool:
    """A contiguous copy of a decomposed SDPA call's output seen through views (the
    heads-to-hidden transpose and reshape after attention): a fused kernel writes its
    output as (batch, sequence, heads, dim), where that transpose is a view."""
    if node.target not in COPY_OPS:
        return False
    source = node.args[0]
    while isinstance(source, torch.fx.Node) and is_alias(source):
        source = source.args[0]
    return isinstance(source, torch.fx.Node) and source.op == "call_function" and \
        from_sdpa(source)


def add_node(part: PartCost, node, ep: int, fused: FusedAttention | None = None,
             tokens: int = 1) -> None:
    """Add one node's cost to `part` by shape class (collectives are counted apart);
    `fused`: math attention priced as a fused kernel (`fused_attention`); `tokens`: the
    fewest tokens of one sequence a GEMM dimension holds on this rank (`gemm_shape`)."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    namespace = getattr(node.target, "namespace", "")
    if namespace == "mxgraph" and name in GROUPED:
        x, other = (a.meta["val"] for a in node.args[:2])
        share = _share(node, ep)
        flops = 2 * numel(x.shape) * concrete(other.shape[-1]) / share  # rows x in x out
        experts = concrete(other.shape[0]) if len(other.shape) == 3 else 1
        rows = max(1, round(flops / (2 * concrete(other.shape[-1]) * concrete(x.shape[-1]) * experts)))
        part.gemms.append(flops)
        part.gemm_shapes.append((experts, rows, concrete(other.shape[-1]), concrete(x.shape[-1]), 1))
        return
    cost = node_cost(node)
    if cost.flops == 0 and cost.bytes == 0:
        return
    if "collective" in str(node.target) or "_c10d_functional" in str(node.target) or (
            namespace == "mxgraph" and _is_collective(node)):
        return
    share = _share(node, ep)
    p = packet(node)
    if fused is not None and fused.holds(node):
        if p in MATMUL_OPS:  # a matmul of the fused kernel; the rest stays on chip
            part.attention.append(cost.flops / share / (2 if fused.causal else 1))
        return
    if p in MATMUL_OPS:
        part.gemms.append(cost.flops / share)
        part.gemm_shapes.append(gemm_shape(node, cost.flops / share, share, tokens))
    elif p in ATTENTION_OPS or name in ATTENTION_BACKWARD:
        part.attention.append(cost.flops / share)
    else:
        part.memory.append(cost.bytes / share)


def gemm_shape(node, flops: float, share: int, tokens: int) -> tuple[int, int, int, int, int]:
    """(batch, m, n, k, grows) of a matmul node from its output shape and FLOPs (k = FLOPs /
    2 / output elements); `grows`: the first of m, k, batch that holds a multiple of
    `tokens` (the dimension more sequences per micro-batch make longer), -1 when none does.
    A dimension equal to the model width by chance picks m for a weight gradient whose k
    is the tokens: the FLOPs are the same, only the tile count differs."""
    out = tensor_meta(node.meta.get("val"))[0]
    dims = [concrete(d) for d in out.shape] or [1]
    n = dims[-1]
    m = max(1, dims[-2] // share) if len(dims) >= 2 else 1
    batch = max(1, numel(out.shape) // max(1, dims[-2] if len(dims) >= 2 else 1) // n)
    k = max(1, round(flops / (2 * batch * m * n)))
    shape = (batch, m, n, k)
    grows = next((i for i in (1, 3, 0) if shape[i] >= tokens and shape[i] % tokens == 0), -1)
    return (*shape, grows)


def _is_collective(node) -> bool:
    from mxgraph.runtime.collectives.groups import KIND
    return KIND.get(getattr(node.target, "_name", "").split("::")[-1].split(".")[0]) is not None


def _share(node, ep: int) -> int:
    """ep when the node's shapes are data-dependent (balanced share of the upper bound)."""
    if ep == 1:
        return 1
    values = tensor_meta(node.meta.get("val")) + [
        v for a in node.all_input_nodes for v in tensor_meta(a.meta.get("val"))]
    return ep if any(free_unbacked_symbols(v) for v in values) else 1


def numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= concrete(dim)
    return total
