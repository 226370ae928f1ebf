"""B/W split: cut a stage's joint graph into forward (F), input-gradient (B) and
weight-gradient (W) programs.

  * F: nodes that need no incoming gradient and that the forward outputs depend on, and
    every node the joint computes before its first backward node;
  * B: gradient nodes the input gradients depend on (what the previous stage waits for);
  * W: the remaining gradient nodes (parameter gradients), run whenever the schedule
    finds room — the zero-bubble idea.
Other nodes that need no incoming gradient and feed only B or W (a weight's transpose, a
value remat recomputes) are computed in the program that reads them. Values flow between programs by node:
each `Program` names the joint-graph nodes it reads and writes, and the executor keeps
one `dict[Node, Tensor]` per (stage, micro-batch). Numerics: bitwise equal to the joint.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from mxgraph.ir import ancestors, is_random
from mxgraph.joint import JointGraph
from mxgraph.runtime.pipeline.programs import Program, StagePrograms


def split_bw(joint: JointGraph, num_activations: int) -> StagePrograms:
    gm = joint.gm
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    outputs = list(gm.graph.find_nodes(op="output")[0].args[0])
    forward_outputs = outputs[:joint.num_forward_outputs]
    grads = outputs[joint.num_forward_outputs:]
    tangents = {p for p, s in zip(placeholders, joint.inputs, strict=True) if s.kind == "tangent"}
    needs_tangent: set[Node] = set(tangents)
    for node in gm.graph.nodes:
        if any(a in needs_tangent for a in node.all_input_nodes):
            needs_tangent.add(node)
    input_grads, param_grads = {}, []
    for slot, grad in zip(joint.grad_of, grads, strict=True):
        if slot is None or grad is None:
            continue
        if slot.kind == "input" and slot.key < num_activations:
            input_grads[slot.key] = grad
        elif slot.kind == "param":
            param_grads.append((slot.key, grad))
    placeholder_set = set(placeholders)
    f_nodes = ancestors(forward_outputs, placeholder_set)
    # what the joint computes before its first backward node stays in F (a value moved to
    # the host by the offload pass, say), so F + B + W run the joint's order
    for node in gm.graph.nodes:
        if node.meta.get("partitioner_tag") == "is_backward":
            break
        if node.op == "call_function" and node not in needs_tangent:
            f_nodes.add(node)
    b_nodes = ancestors(input_grads.values(), placeholder_set | f_nodes)
    w_nodes = ancestors([g for _, g in param_grads], placeholder_set | f_nodes | b_nodes)
    # a random op must run once, in F, so B and W see the values F drew (`is_random`: an
    # SDPA without dropout that remat recomputes stays where remat put it)
    for node in list(b_nodes | w_nodes):
        if node not in needs_tangent and is_random(node):
            f_nodes |= ancestors([node], placeholder_set)
    b_nodes -= f_nodes
    w_nodes -= f_nodes | b_nodes
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    w_reads = _reads(w_nodes)
    b_reads = _reads(b_nodes)
    forward = _program(gm, f_nodes, f_nodes & (b_reads | w_reads) | set(forward_outputs),
                       order, first=forward_outputs)
    backward_input = _program(gm, b_nodes, (b_nodes & w_reads) | set(input_grads.values()),
                              order)
    backward_weight = _program(gm, w_nodes, {g for _, g in param_grads}, order)
    return StagePrograms(forward, backward_input, backward_weight, placeholders,
                         forward_outputs, input_grads, param_grads)


def _reads(nodes: set[Node]) -> set[Node]:
    return {a for n in nodes for a in n.all_input_nodes}


def _program(gm: GraphModule, nodes: set[Node], outputs: set[Node], order,
             first=()) -> Program:
    """Nodes `nodes` as a graph; inputs = what they read from outside, in graph order."""
    graph = Graph()
    env: dict[Node, Node] = {}
    inputs = sorted({a for n in nodes for a in n.all_input_nodes if a not in nodes},
                    key=order.get)
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in sorted(nodes, key=order.get):
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    ordered = list(first) + sorted(set(outputs) - set(first), key=order.get)
    # an output can be a placeholder passed straight through (a stage forwarding an input)
    for node in ordered:
        if node not in env:
            env[node] = graph.placeholder(node.name)
            inputs.append(node)
    graph.output(tuple(env[n] for n in ordered))
    graph.set_codegen(torch.fx.graph.CodeGen())
    program = GraphModule(gm, graph)
    return Program(program, inputs, ordered)
