"""In-place writes through views, as the sharding core must keep them.

The captured forward graph keeps a model's in-place writes (`out[:, t] = value` is
`copy_(select(out, 1, t), value)`; RWKV's recurrence, Mamba-style scans and state buffers
write so). A write lands in its target's storage only while every view between the
written tensor and its base is a view of that same storage. A redistribution in that chain
(a gather of a sequence shard before a `select` along the sequence, say) would hand the
write a copy, and the write would be lost without an error.

`Writes.of(graph)` finds, for each in-place op, its base (the first value up the chain that
is no alias of its input), the chain's nodes (`path`: the views and the writing op, whose
input must stay the base's storage) and every alias of the base (`family`: readers of
those must see each write in graph order). The sharder (`propagate.py`) reports a
redistribution on a path as a lost write, keeps the base of such a write whole (with every
alias of it) in its next run, and redistributes an alias for each reader right before it,
never reusing a copy made before a later write.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from mxgraph.ir import copy_module


def writes_in_place(node: Node) -> bool:
    """Whether `node` is an op that writes its first operand (`copy_`, `add_`, ...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    arguments = target._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and \
        arguments[0].alias_info.is_write


def aliases_input(node: Node) -> bool:
    """Whether `node`'s output shares its first operand's storage (a view, an in-place op,
    or an item of a view op's list output)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and aliases_input(node.args[0])
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args or \
            not isinstance(node.args[0], Node):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


@dataclass
class Writes:
    base: dict[Node, Node] = field(default_factory=dict)
    """Every alias of a written base (the base included) -> that base."""
    path: set[Node] = field(default_factory=set)
    """The views and in-place ops between a write and its base."""

    @classmethod
    def of(cls, graph: Graph) -> "Writes":
        writes = cls()
        for node in graph.nodes:
            if not writes_in_place(node) or not isinstance(node.args[0], Node):
                continue
            chain = [node]
            while aliases_input(chain[-1]) and isinstance(chain[-1].args[0], Node):
                chain.append(chain[-1].args[0])
            base = chain[-1]
            writes.path.update(chain[:-1])
            if base not in writes.base:
                writes._add_family(base)
        return writes

    def _add_family(self, base: Node) -> None:
        todo = [base]
        while todo:
            value = todo.pop()
            if value in self.base:
                continue
            self.base[value] = base
            todo += [u for u in value.users if aliases_input(u) and u.args[0] is value]

    def family(self, value: Node) -> Node | None:
        """The written base `value` aliases, or None."""
        return self.base.get(value)


def kept_whole(gm: GraphModule, trial, rounds: int = 8) -> set[str]:
    """Names of the written bases to keep whole: `trial(copy)` runs a sharder on a copy of
    `gm` keeping the given names whole and returns the bases of the writes it lost; repeated
    until none is (at most `rounds` times). Empty at once where `gm` writes nothing."""
    if not Writes.of(gm.graph).base:
        return set()
    whole: set[str] = set()
    for _ in range(rounds):
        lost = trial(copy_module(gm), whole) - whole
        if not lost:
            break
        whole |= lost
    return whole


__all__ = ["Writes", "aliases_input", "kept_whole", "writes_in_place"]
