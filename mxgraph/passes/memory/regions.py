"""Which forward nodes form a norm, an activation, an attention core, an MLP, an MoE block,
a layer: rules on graph structure and ops (never module names).

Each rule returns *units*: (kind, layer, stage, nodes). The remat pass recomputes the
units a policy names; the offload pass uses the same regions to pick saved values.

Rules (forward nodes only; "projection" = mm/addmm/bmm/linear/grouped_mm with an operand
whose storage is a parameter; "pointwise" = an ATen op tagged pointwise, or a dtype cast).
Fused kernels are recognised by their registered kind (`mxgraph.ir.fused_kind`), never by
their names:

* **norm** - RMSNorm decomposition: a `rsqrt` whose input is `mean(x*x or pow(x, 2)) + eps`;
  the unit is that chain plus its pointwise descendants whose other operands are the
  normalised input or parameters (x * rsqrt * weight, dtype casts), stopping at the value
  that feeds a projection. LayerNorm: `native_layer_norm` (+ its outputs). Fused ops of
  kind "norm" (`mxgraph::rmsnorm`, `add_rmsnorm`) count as norms.
* **act** - `silu`/`gelu` (or a fused op of kind "act": swiglu, bias_gelu) plus the pointwise
  ops that follow it (the SwiGLU `mul`, a bias add) up to the value that feeds a matmul.
* **attn** - the core attention: an SDPA op (or a fused op of kind "attn"), or a
  softmax whose input comes from a `bmm` and whose output feeds a `bmm` (math attention);
  the unit grows, until nothing joins, backwards through every non-projection op (RoPE,
  repeat-KV copies, scaling, masks) to the q/k/v projections and forwards to the output
  projection.
* **mlp** - an act unit outside an MoE block, plus the projections that feed it (and
  their bias adds) and the projection it feeds.
* **MoE block** - a layer holding a data-dependent routing op (`sort`, `argsort`) together
  with a row gather (`index`) or fused ops of kind "matmul"/"moe" (`mxgraph::grouped_mm`,
  `mxgraph::moe_*`): its block is
  every forward node of the layer that descends from the router's input and feeds the
  block output (before the residual add). Inside it: router = the projection feeding a
  `topk` and the chain to the gate weights; permute/unpermute = `index`/`index_add`/
  `scatter*` and the gate weighting; expert first projections = projections whose input
  comes from a permute; shared experts = projections reading the block input directly
  (other than the router) and everything between them.
  **moe_light** = block minus projections, plus the router projection;
  **moe_medium** = light + expert first projections + shared-expert units;
  **moe_full** = the whole block.
* **op_sac** - torchtitan's per-op selective checkpointing (`selective_ac_option = "op"`):
  a layer's full unit (below) less the outputs it saves: attention ops' (SDPA, fused
  attention) and every other projection's, counted in forward order within the layer
  (the 1st, 3rd, ... stay saved; the 2nd, 4th, ... are recomputed with everything else).
* **full** - every forward node of one layer (`meta["custom"]["layer"]`) except the
  layer's outputs (values read by another layer), which stay saved as checkpoints.

Random ops (`mxgraph.ir.is_random`, e.g. `native_dropout`; not attention with dropout_p=0)
are never recomputed: their mask stays saved and the dropout output is replayed from it
(see memory/remat.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from mxgraph.ir import (
    ATTENTION_OPS,
    MATMUL_OPS,
    ancestors,
    descendants,
    fused_kind,
    is_alias,
    is_forward_op,
    is_random,
    packet,
    storage_roots,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Unit:
    kind: str
    layer: int | None
    stage: int
    nodes: frozenset


def is_matmul(node: Node) -> bool:
    """An ATen matmul (`MATMUL_OPS`) or a fused matmul kernel (`mxgraph::grouped_mm`)."""
    return node.op == "call_function" and (packet(node) in MATMUL_OPS
                                           or fused_kind(node) == "matmul")


def is_attention(node: Node) -> bool:
    """An ATen SDPA op (`ATTENTION_OPS`) or a fused attention kernel (kind "attn")."""
    return node.op == "call_function" and (packet(node) in ATTENTION_OPS
                                           or fused_kind(node) == "attn")


def is_pointwise(node: Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket in (
        aten._to_copy, aten.type_as, aten.clone)


def layer_of(node: Node):
    return (node.meta.get("custom") or {}).get("layer")


def stage_of(node: Node) -> int:
    return int((node.meta.get("custom") or {}).get("stage", 0) or 0)


class Graph:
    """Forward-graph facts the rules share: storage roots, parameters, matmul feeds."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.roots = storage_roots(gm)
        self.params = {n for n in self.nodes if n.op == "placeholder" and
                       type(n.meta.get("desc")).__name__ in ("ParamAOTInput", "BufferAOTInput")}
        self.forward = [n for n in self.nodes if is_forward_op(n)]
        self.forward_set = set(self.forward)

    def is_param_value(self, node: Node) -> bool:
        return self.roots.get(node, node) in self.params or (
            node.op == "placeholder") or (node.op == "call_function" and not any(
                isinstance(a, Node) for a in node.all_input_nodes) and not node.all_input_nodes)

    def is_projection(self, node: Node) -> bool:
        return is_matmul(node) and any(self.roots.get(a, a) in self.params
                                       for a in node.all_input_nodes)

    def fwd_users(self, node: Node):
        return [u for u in node.users if u in self.forward_set]

    def feeds_matmul(self, node: Node) -> bool:
        """Some forward user (through aliases) is a matmul."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            for u in self.fwd_users(n):
                if u in seen:
                    continue
                seen.add(u)
                if is_matmul(u):
                    return True
                if is_alias(u):
                    stack.append(u)
        return False

    def with_aliases(self, nodes: set) -> set:
        """Add forward alias descendants and the getitems of multi-output nodes."""
        out = set(nodes)
        stack = list(nodes)
        while stack:
            n = stack.pop()
            for u in self.fwd_users(n):
                if u not in out and (is_alias(u) or getattr(u.target, "__name__", "") == "getitem"):
                    out.add(u)
                    stack.append(u)
        return out


# ---- rules ----------------------------------------------------------------------------

def _grow_pointwise(g: Graph, unit: set, allowed_inputs: set, stop_at_matmul: bool) -> set:
    """Add pointwise descendants whose tensor inputs are in `unit`, `allowed_inputs` or
    parameters; a node that feeds a matmul is added but not grown past."""
    changed = True
    frontier = set(unit)
    while changed:
        changed = False
        for n in list(frontier):
            if stop_at_matmul and n not in allowed_inputs and g.feeds_matmul(n) and n in unit:
                continue
            for u in g.fwd_users(n):
                if u in unit or not is_pointwise(u) or is_random(u):
                    continue
                if all(a in unit or a in allowed_inputs or g.is_param_value(a)
                       for a in u.all_input_nodes):
                    unit.add(u)
                    frontier.add(u)
                    changed = True
            frontier.discard(n)
    return unit


def norm_units(g: Graph) -> list[set]:
    units = []
    for n in g.forward:
        if packet(n) in (aten.native_layer_norm, aten.layer_norm, aten.rms_norm,
                         aten._fused_rms_norm) or fused_kind(n) == "norm":
            units.append(g.with_aliases({n}))
            continue
        if packet(n) is not aten.rsqrt:
            continue
        add = n.args[0]
        if not (isinstance(add, Node) and packet(add) is aten.add):
            continue
        mean = next((a for a in add.all_input_nodes if packet(a) is aten.mean), None)
        if mean is None:
            continue
        square = mean.args[0]
        if packet(square) is aten.pow and square.args[1] == 2:
            x = square.args[0]
        elif packet(square) is aten.mul and square.args[0] is square.args[1]:
            x = square.args[0]
        else:
            continue
        unit = {square, mean, add, n}
        inputs = {x}
        if packet(x) is aten._to_copy and isinstance(x.args[0], Node):  # x.float()
            unit.add(x)
            inputs.add(x.args[0])
        units.append(g.with_aliases(_grow_pointwise(g, unit, inputs, stop_at_matmul=True)))
    return units


def act_units(g: Graph) -> list[set]:
    units = []
    for n in g.forward:
        if packet(n) in (aten.silu, aten.gelu) or fused_kind(n) == "act":
            unit = _grow_pointwise(g, {n}, set(), stop_at_matmul=True)
            units.append(g.with_aliases(unit))
    return units


def _is_softmax_attention(g: Graph, n: Node) -> bool:
    if packet(n) not in (aten._softmax, aten._safe_softmax, aten.softmax):
        return False

    def reaches(start: Node, forward: bool) -> bool:
        stack, seen = [start], set()
        while stack:
            m = stack.pop()
            nxt = g.fwd_users(m) if forward else m.all_input_nodes
            for k in nxt:
                if k in seen or k.op != "call_function":
                    continue
                seen.add(k)
                if packet(k) in (aten.bmm, aten.matmul):
                    return True
                if is_alias(k) or is_pointwise(k) or is_random(k) or \
                        getattr(k.target, "__name__", "") == "getitem":
                    stack.append(k)
        return False
    return reaches(n, True) and reaches(n, False)


def attn_units(g: Graph) -> list[set]:
    units = []
    taken: set = set()
    for n in g.forward:
        if not (is_attention(n) or _is_softmax_attention(g, n)) or n in taken:
            continue
        layer = layer_of(n)
        unit, grown = {n}, True
        while grown:  # alternate until nothing joins: backwards to the q/k/v projections,
            grown = False  # forwards to the output projection (the P@V bmm pulls in v)
            stack = list(unit)
            while stack:
                m = stack.pop()
                for a in m.all_input_nodes:
                    if a in unit or a not in g.forward_set or g.is_projection(a) or \
                            layer_of(a) != layer or g.is_param_value(a):
                        continue
                    unit.add(a)
                    stack.append(a)
                    grown = True
            stack = list(unit)
            while stack:
                m = stack.pop()
                for u in g.fwd_users(m):
                    if u in unit or g.is_projection(u) or layer_of(u) != layer:
                        continue
                    unit.add(u)
                    stack.append(u)
                    grown = True
        unit = g.with_aliases(unit)
        taken |= unit
        units.append(unit)
    return units


def moe_blocks(g: Graph) -> dict:
    """layer -> (block nodes, block input node) for layers that route tokens."""
    by_layer: dict = {}
    for n in g.forward:
        by_layer.setdefault(layer_of(n), []).append(n)
    blocks = {}
    for layer, nodes in by_layer.items():
        if layer is None:
            continue
        routing = [n for n in nodes if packet(n) in (aten.sort, aten.argsort)]
        gathers = [n for n in nodes if packet(n) in (aten.index, aten.index_select)
                   or fused_kind(n) in ("matmul", "moe")]
        topks = [n for n in nodes if packet(n) is aten.topk]
        if not routing or not gathers or not topks:
            continue
        router = _router_projection(g, topks[0])
        if router is None:
            continue
        block_input = g.roots[next(a for a in router.all_input_nodes
                                   if g.roots.get(a, a) not in g.params)]
        # block output: the node of this layer whose users leave the block (residual add)
        down = _descendants(g, block_input, layer)
        final = [n for n in down if any(layer_of(u) != layer or _is_residual(g, u, down)
                                        for u in g.fwd_users(n))]
        ups = set()
        for out in final:
            ups |= ancestors([out], keep=lambda a, layer=layer: a in g.forward_set and layer_of(a) == layer)
        block = (down & ups) | {out for out in final}
        block = {n for n in block if not _is_residual(g, n, down)}
        blocks[layer] = (g.with_aliases(block), block_input, router)
    return blocks


def _is_residual(g: Graph, node: Node, block_desc: set) -> bool:
    return packet(node) is aten.add and any(a not in block_desc and not g.is_param_value(a)
                                            for a in node.all_input_nodes)


def _router_projection(g: Graph, topk: Node):
    stack, seen = [topk], set()
    while stack:
        m = stack.pop()
        for a in m.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if g.is_projection(a):
                return a
            if a in g.forward_set:
                stack.append(a)
    return None


def _descendants(g: Graph, start: Node, layer) -> set:
    """The forward nodes of `layer` that read `start`, transitively (`start` left out)."""
    return descendants([start], keep=lambda u: u in g.forward_set and layer_of(u) == layer) - {
        start}


def moe_units(g: Graph) -> dict[str, list[set]]:
    light, medium, full = [], [], []
    for layer, (block, block_input, router) in moe_blocks(g).items():
        projections = {n for n in block if g.is_projection(n)}
        permutes = {n for n in block if packet(n) in (aten.index, aten.index_select)}
        first = set()
        for p in projections:
            if any(_derives_from(g, a, permutes, block - projections)
                   for a in p.all_input_nodes):
                first.add(p)
        shared_inputs = {n for n in projections - {router} if all(
            g.roots.get(a, a) in g.params or g.roots.get(a, a) is block_input
            for a in n.all_input_nodes)}
        shared = set(shared_inputs)
        for p in shared_inputs:
            for u in _descendants(g, p, layer) & block:
                if _derives_from(g, u, shared_inputs, block) and not _derives_from(
                        g, u, permutes, block):
                    shared.add(u)
        lite = (block - projections) | {router}
        light.append(g.with_aliases(lite))
        medium.append(g.with_aliases(lite | first | shared))
        full.append(block)
    return {"moe_light": light, "moe_medium": medium, "moe_full": full}


def _derives_from(g: Graph, node: Node, sources: set, within: set) -> bool:
    stack, seen = [node], set()
    while stack:
        m = stack.pop()
        if m in sources:
            return True
        for a in m.all_input_nodes:
            if a not in seen and (a in within or a in sources):
                seen.add(a)
                stack.append(a)
    return False


def mlp_units(g: Graph, moe_nodes: set) -> list[set]:
    units = []
    for act in act_units(g):
        if act & moe_nodes:
            continue
        unit = set(act)
        for n in act:  # the projections (and bias adds) feeding the activation
            for a in n.all_input_nodes:
                _take_projection_chain(g, a, unit, upward=True)
        for n in list(act):  # the projection it feeds
            for u in g.fwd_users(n):
                _take_projection_chain(g, u, unit, upward=False)
        units.append(g.with_aliases(unit))
    return units


def _take_projection_chain(g: Graph, start: Node, unit: set, upward: bool) -> None:
    chain, m = [], start
    while m is not None and m in g.forward_set and m not in unit:
        chain.append(m)
        if g.is_projection(m):
            unit.update(chain)
            return
        if not (is_alias(m) or (is_pointwise(m) and any(g.is_param_value(a)
                                                        for a in m.all_input_nodes))):
            return
        if upward:
            inputs = [a for a in m.all_input_nodes if not g.is_param_value(a)]
            m = inputs[0] if len(inputs) == 1 else None
        else:
            users = g.fwd_users(m)
            m = users[0] if len(users) == 1 else None


def full_units(g: Graph) -> list[set]:
    """Every forward node of a layer except its outputs (values that forward nodes of
    another layer read): those stay saved as the checkpoints the next layer recomputes
    from; recomputing them too would chain every layer back to the embedding."""
    by_layer: dict = {}
    for n in g.forward:
        if layer_of(n) is not None:
            by_layer.setdefault(layer_of(n), set()).add(n)
    units = []
    for layer, nodes in by_layer.items():
        outputs = {n for n in nodes if any(layer_of(u) != layer for u in g.fwd_users(n))}
        for n in list(outputs):  # a view read by another layer: keep its base too
            while is_alias(n) and n.all_input_nodes and n.all_input_nodes[0] in nodes:
                n = n.all_input_nodes[0]
                outputs.add(n)
        units.append(nodes - outputs)
    return units


def op_sac_units(g: Graph) -> list[set]:
    """A full unit less attention outputs and the odd-numbered projections of its layer
    (module docstring): what torchtitan's op policy saves."""
    units = []
    for unit in full_units(g):
        projections = sorted((n for n in unit if g.is_projection(n)), key=g.order.__getitem__)
        attention = {n for n in unit if is_attention(n)}
        units.append(unit - g.with_aliases(set(projections[0::2]) | attention))
    return units


def all_units(gm: torch.fx.GraphModule, kinds) -> list[Unit]:
    """Units of the given kinds (a subset of RECOMPUTE_KINDS)."""
    g = Graph(gm)
    kinds = set(kinds)
    found: list[tuple[str, set]] = []
    moe = moe_units(g) if kinds & {"moe_light", "moe_medium", "moe_full", "mlp"} else {}
    if "norm" in kinds:
        found += [("norm", u) for u in norm_units(g)]
    if "act" in kinds:
        found += [("act", u) for u in act_units(g)]
    if "attn" in kinds:
        found += [("attn", u) for u in attn_units(g)]
    if "mlp" in kinds:
        moe_nodes = set().union(*moe["moe_full"]) if moe.get("moe_full") else set()
        found += [("mlp", u) for u in mlp_units(g, moe_nodes)]
    for kind in ("moe_light", "moe_medium", "moe_full"):
        if kind in kinds:
            found += [(kind, u) for u in moe[kind]]
    if "op_sac" in kinds:
        found += [("op_sac", u) for u in op_sac_units(g)]
    if "full" in kinds:
        found += [("full", u) for u in full_units(g)]
    units = []
    for kind, nodes in found:
        nodes = {n for n in nodes if n in g.forward_set}
        if not nodes:
            continue
        first = min(nodes, key=g.order.__getitem__)
        units.append(Unit(kind, layer_of(first), stage_of(first), frozenset(nodes)))
    return units
