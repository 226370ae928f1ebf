"""Placements: how a value of the forward graph lies over one mesh axis (as DTensor and
SimpleFSDP model them).

* `Replicate()` (`R`): every rank holds the whole value;
* `Shard(dim, outer)`: each rank holds a 1/n part along `dim`. `outer` > 1 when dims were
  merged in front of the sharded one by a view: `[b, s]` sharded on `s`, viewed as `[b*s]`,
  is `Shard(0, outer=b)` (each rank holds `b` runs of `s/n` elements, not one chunk);
* `Partial()`: each rank holds a summand; the value is their sum (a row-parallel matmul's
  output, a vocabulary-parallel embedding lookup, a sum over a sharded dim).

`view_placement` carries a shard through a reshape. Placements are values: compare them
with `==`; a multi-output op's placement is a tuple (one per output).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    outer: int = 1

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.outer == 1 else f"S({self.dim}, outer={self.outer})"

    def at(self, dim: int) -> "Shard":
        return Shard(dim, self.outer)


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __repr__(self) -> str:
        return f"P({self.reduce})"


R = Replicate()
P = Partial()
Placement = Replicate | Shard | Partial


def is_shard(placement) -> bool:
    return isinstance(placement, Shard)


def view_group(full_in: list[int], full_out: list[int], dim: int):
    """(input dims, output dims) of the group holding input dim `dim` in a view, or None.
    Groups of input and output dims with equal products are matched left to right."""
    i = j = 0
    while i < len(full_in) and j < len(full_out):
        gi, gj = [i], [j]
        pi, pj = full_in[i], full_out[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= full_in[i]
            else:
                j += 1
                gj.append(j)
                pj *= full_out[j]
        if dim in gi:
            return gi, gj
        i, j = i + 1, j + 1
    return None


def view_placement(full_in: list[int], full_out: list[int], shard: Shard,
                   parts: int) -> Shard | None:
    """The placement of a view's output whose input is `shard` (over `parts` ranks), or None
    when no output dim can hold this rank's elements as a shard.

    Within the group of dims holding the shard (`view_group`), the group's elements are
    `outer` runs (the shard's own `outer` times the dims merged in front of it), each split
    into `parts` contiguous pieces, one per rank (dims after the shard lie inside the runs).
    An output dim e of the group holds that as `Shard(e, q)` when the group's dims before e
    multiply to `outer / q` and each of its `q` runs splits evenly into `parts`."""
    group = view_group(full_in, full_out, shard.dim)
    if group is None:
        return None
    gi, gj = group
    outer = shard.outer * math.prod(full_in[d] for d in gi if d < shard.dim)
    before = 1
    for e in gj:
        size = full_out[e]
        if size != 1 and outer % before == 0:
            q = outer // before
            if size % q == 0 and (size // q) % parts == 0:
                return Shard(e, q)
        before *= size
    return None
