"""Pipeline split: cut the forward graph into stages at layer boundaries.

Layers come from `meta["custom"]["layer"]` (the index of the repeated block a node
belongs to, set at capture from the module stack). Layers are assigned to stages by
`Plan.layout` when given, else balanced by FLOPs (`schedules.layout.balance_layers`,
stage 0 also pays the embedding, the last stage the head and loss; under DualPipeV, whose
first and last stages share a rank, each pays half of both). A node outside any
layer belongs to the stage of the closest layered node before it (stage 0 if none).

Values crossing a stage boundary are sent, except values that depend on no parameter
and no random op (RoPE tables sliced from buffers, masks built from the inputs): those
are recomputed in each stage that reads them, so no stage waits for them. A value read
two stages later passes through the stages between.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, GraphModule, Node

from mxgraph.capture import ForwardGraph, Slot
from mxgraph.cost import node_cost
from mxgraph.errors import PlanError
from mxgraph.ir import is_random
from mxgraph.schedules.layout import stage_groups


@dataclass
class StageGraph:
    """One stage's forward graph. Placeholders: its tensors (slots of kind param, buffer,
    constant), then `num_activations` received activations (slot kind "input", keys
    0..), then the user inputs it reads (slot kind "user"). Outputs: the activations the
    next stage needs, or the loss for the last stage."""

    forward: ForwardGraph
    num_activations: int
    user_inputs: list[int]  # index in the flattened user inputs, per "user" placeholder


def layer_stages(gm: GraphModule, num_stages: int, layout: str | None,
                 empty_layers: tuple[int, int] | None = None,
                 shared_ends: bool = False) -> dict[int, int]:
    """layer index -> stage, by `schedules.layout.stage_groups` on each layer's forward
    FLOPs (the embedding's and the head's beside them). `empty_layers=(pp, vpp)` pads the
    layer count with placeholder slots, metadata only; `shared_ends`: DualPipeV's V."""
    layer_cost: dict[int, float] = {}
    embed = head = 0.0
    seen_layer = False
    for node in gm.graph.nodes:
        layer = (node.meta.get("custom") or {}).get("layer")
        flops = node_cost(node).flops if node.op == "call_function" else 0
        if layer is None:
            if seen_layer:
                head += flops
            else:
                embed += flops
        else:
            seen_layer = True
            layer_cost[layer] = layer_cost.get(layer, 0.0) + flops
    layers = sorted(layer_cost)
    if layers != list(range(len(layers))):
        raise PlanError("pipeline split found no repeated blocks (a ModuleList or Sequential "
                        "of layers) in the model; pp needs layers to cut between")
    groups = stage_groups([layer_cost[i] for i in layers], num_stages, layout, empty_layers,
                          embed, head, shared_ends)
    return {layer: stage for stage, group in enumerate(groups) for layer in group}


def assign_stages(gm: GraphModule, num_stages: int, layout: str | None = None,
                  empty_layers: tuple[int, int] | None = None,
                  shared_ends: bool = False) -> dict[Node, int]:
    """The stage of every call_function node (all 0 for one stage: a model without
    repeated layers is one stage); `shared_ends` as `layer_stages`."""
    by_layer = layer_stages(gm, num_stages, layout, empty_layers, shared_ends) \
        if num_stages > 1 else {}
    stage_of, current = {}, 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        layer = (node.meta.get("custom") or {}).get("layer")
        if layer is not None and by_layer:
            current = by_layer[layer]
        stage_of[node] = current
        node.meta["custom"] = {**node.meta.get("custom", {}), "stage": current}
    return stage_of


def _recomputable(gm: GraphModule) -> set[Node]:
    """Nodes depending on no parameter and no random op: cheap to recompute anywhere."""
    tainted: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.meta.get("mx_slot_kind") == "param":
                tainted.add(node)
            continue
        if is_random(node) or any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
    return {n for n in gm.graph.nodes if n.op == "call_function" and n not in tainted}


def split_stages(forward: ForwardGraph, num_stages: int, layout: str | None = None,
                 empty_layers: tuple[int, int] | None = None,
                 shared_ends: bool = False) -> list[StageGraph]:
    gm = forward.gm
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    stage_of = assign_stages(gm, num_stages, layout, empty_layers, shared_ends)
    cheap = _recomputable(gm)
    output = gm.graph.find_nodes(op="output")[0]
    loss = output.args[0][0]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    # Which nodes each stage computes (own nodes + recomputed cheap ancestors), and
    # which values it needs from earlier stages.
    computes: list[set[Node]] = [set() for _ in range(num_stages)]
    needs: list[set[Node]] = [set() for _ in range(num_stages)]
    for node, stage in stage_of.items():
        computes[stage].add(node)
    for stage in range(num_stages):
        frontier = list(computes[stage])
        while frontier:
            node = frontier.pop()
            for arg in node.all_input_nodes:
                if arg.op != "call_function" or arg in computes[stage]:
                    continue
                if stage_of[arg] > stage:
                    raise PlanError(f"stage {stage} reads {arg.name} from later stage "
                                    f"{stage_of[arg]}: the model is not a chain of layers")
                if arg in cheap:
                    computes[stage].add(arg)
                    frontier.append(arg)
                else:
                    needs[stage].add(arg)
    # boundary b carries what stages > b need from stages <= b
    boundaries = []
    for b in range(num_stages - 1):
        carried = {v for s in range(b + 1, num_stages) for v in needs[s]
                   if stage_of[v] <= b}
        boundaries.append(sorted(carried, key=order.get))
    stages = []
    for stage in range(num_stages):
        inputs = boundaries[stage - 1] if stage else []
        outputs = boundaries[stage] if stage < num_stages - 1 else [loss]
        stages.append(_extract(forward, placeholders, computes[stage], inputs, outputs, order))
    return stages


def _extract(forward: ForwardGraph, placeholders: list[Node], nodes: set[Node],
             inputs: list[Node], outputs: list[Node], order: dict[Node, int]) -> StageGraph:
    graph = Graph()
    env: dict[Node, Node] = {}
    used = {a for n in nodes for a in n.all_input_nodes} | set(outputs)
    slots: list[Slot] = []
    user_inputs: list[int] = []
    for node, slot in zip(placeholders, forward.slots, strict=True):
        if node in used and slot.kind != "input":
            env[node] = _placeholder(graph, node)
            slots.append(slot)
    for i, node in enumerate(inputs):
        env[node] = _placeholder(graph, node, f"activation_{i}")
        slots.append(Slot("input", i))
    for node, slot in zip(placeholders, forward.slots, strict=True):
        if node in used and slot.kind == "input":
            env[node] = _placeholder(graph, node)
            slots.append(Slot("input", len(inputs) + len(user_inputs)))
            user_inputs.append(slot.key)
    for node in sorted(used, key=order.get):  # a submodule or tensor attribute: the stage's
        if node.op == "get_attr":              # GraphModule copies it from the root
            env[node] = graph.get_attr(node.target)
            env[node].meta = dict(node.meta)
    for node in sorted(nodes, key=order.get):
        if node in env:
            continue
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(tuple(env[n] for n in outputs))
    gm = GraphModule(forward.gm, graph)
    return StageGraph(ForwardGraph(gm, slots, forward.constants), len(inputs), user_inputs)


def _placeholder(graph: Graph, node: Node, name: str | None = None) -> Node:
    new = graph.placeholder(name or node.name)
    new.meta = dict(node.meta)
    return new
