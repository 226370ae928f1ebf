"""The sharding rule of a two-operand `einsum` (`torch.einsum("bsd,df->bsf", x, w)`: the
export keeps it whole), for the TP and CP tables (`Rules.register(aten.einsum.default)`).

Read by letters: the operands' sharded dims must name one letter; an operand without a
shard that has that letter is sliced along it; the output is sharded on the letter where
the output keeps it, partial where the equation contracts it. A partial operand times a
replicated one is partial (einsum is bilinear); two partials, or a partial with a sharded
operand, sum first. Ellipses, repeated letters in one operand, more than two operands and
shards of merged dims gather (listed).
"""
from __future__ import annotations

from torch.fx import Node

from mxgraph.passes.sharding.placement import P, Partial, R, Shard
from mxgraph.passes.sharding.propagate import placed


def _letters(equation: str) -> tuple[list[str], str] | None:
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    specs = inputs.split(",")
    if any(len(set(spec)) != len(spec) for spec in specs):
        return None
    return specs, output


def einsum_rule(s, node: Node):
    equation, operands = node.args[0], list(node.args[1])
    letters = _letters(equation)
    if letters is None or len(operands) != 2:
        return s.gather_all(node, f"an einsum form without a rule ({equation!r})")
    specs, output = letters
    partial = [x for x in operands if isinstance(s.of(x), Partial)]
    if len(partial) == 1 and all(s.of(x) == R for x in operands if x is not partial[0]):
        return P
    for x in partial:  # summed first: their product is no sum of products
        operands[operands.index(x)] = s.need(node, x, s.reduce_target(x))
    shards = {}
    for x, spec in zip(operands, specs, strict=True):
        p = s.of(x)
        if isinstance(p, Shard):
            p = placed(p, s.ndim(x))
            if p.outer != 1:
                return s.gather_all(node, "an einsum of a merged-dim shard")
            shards[x] = spec[p.dim]
    if not shards:
        return R
    if len(set(shards.values())) > 1:
        return s.gather_all(node, f"an einsum of operands sharded on {sorted(set(shards.values()))}")
    letter = next(iter(shards.values()))
    for x, spec in zip(operands, specs, strict=True):
        if x not in shards and letter in spec:
            s.need(node, x, Shard(spec.index(letter)))
    return Shard(output.index(letter)) if letter in output else P


__all__ = ["einsum_rule"]
