"""Stage layouts: which layers each pipeline stage holds (pure logic, no torch).

Layout strings name each stage's layers left to right, stages separated by `|`:

    "E t*3 | t*4 | t*4 | t*3 L"

`E` embedding, `t` transformer layer, `L` head and loss, `_` empty placeholder layer
(no compute, keeps the slot count even), `x*n` repeats a token n times. `E` may only open
the first stage and `L` only close the last.

Virtual stage s (of pp * vpp) lives on rank s % pp, as in interleaved schedules.
"""

from __future__ import annotations

import math
import re

from mxgraph.errors import PlanError

EMBED, LAYER, HEAD, EMPTY = "E", "t", "L", "_"
TOKENS = (EMBED, LAYER, HEAD, EMPTY)
_TOKEN_RE = re.compile(r"^([A-Za-z_])(?:\*(\d+))?$")


def parse_layout(text: str) -> list[list[str]]:
    """`"E t*3 | t*4"` -> `[["E", "t", "t", "t"], ["t", "t", "t", "t"]]`."""
    stages = []
    for index, chunk in enumerate(text.split("|")):
        tokens: list[str] = []
        for word in chunk.split():
            match = _TOKEN_RE.match(word)
            if match is None or match.group(1) not in TOKENS:
                raise PlanError(f"bad layout token {word!r} in stage {index}; valid tokens: "
                                f"{', '.join(TOKENS)}, optionally repeated as 't*4'")
            count = int(match.group(2) or 1)
            if count < 1:
                raise PlanError(f"layout token {word!r}: repeat count must be >= 1")
            tokens += [match.group(1)] * count
        if not tokens:
            raise PlanError(f"layout stage {index} is empty in {text!r}; every stage needs at least "
                            "one token (use '_' for an empty placeholder layer)")
        stages.append(tokens)
    for index, tokens in enumerate(stages):
        for pos, tok in enumerate(tokens):
            if tok == EMBED and (index, pos) != (0, 0):
                raise PlanError(f"'E' (embedding) must be the first token of the first stage; found it "
                                f"in stage {index} position {pos}")
            if tok == HEAD and (index, pos) != (len(stages) - 1, len(tokens) - 1):
                raise PlanError(f"'L' (head and loss) must be the last token of the last stage; found "
                                f"it in stage {index} position {pos}")
    return stages


def format_layout(stages: list[list[str]]) -> str:
    """Inverse of `parse_layout`, with runs written as `t*n`."""
    parts = []
    for tokens in stages:
        words, i = [], 0
        while i < len(tokens):
            j = i
            while j < len(tokens) and tokens[j] == tokens[i]:
                j += 1
            words.append(tokens[i] if j - i == 1 else f"{tokens[i]}*{j - i}")
            i = j
        parts.append(" ".join(words))
    return " | ".join(parts)


def balance_layers(layer_costs: list[float], num_stages: int, embed_cost: float = 0.0,
                   head_cost: float = 0.0) -> list[list[int]]:
    """Split layers 0..n-1 into `num_stages` contiguous, non-empty runs minimising the most
    expensive stage; stage 0 also pays `embed_cost` and the last stage `head_cost`.
    Exact (dynamic programming, O(num_stages * n^2))."""
    n = len(layer_costs)
    if num_stages < 1:
        raise PlanError(f"num_stages must be >= 1, got {num_stages}")
    if n < num_stages:
        raise PlanError(f"cannot give {num_stages} stages at least one of {n} layers; use fewer "
                        "stages or pad_empty_layers")
    if any(not math.isfinite(c) or c < 0 for c in [*layer_costs, embed_cost, head_cost]):
        raise PlanError("layer, embedding and head costs must be finite and >= 0")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (embed_cost if stage == 0 else 0.0) + (head_cost if stage == num_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[j][i]: min over splits of layers [0, i) into stages 0..j of the max stage cost.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for j in range(1, num_stages):
        for i in range(j + 1, n + 1):
            for t in range(j, i):
                value = max(best[j - 1][t], cost(j, t, i))
                if value < best[j][i] - 1e-12:
                    best[j][i], cut[j][i] = value, t
    bounds, hi = [], n
    for j in range(num_stages - 1, 0, -1):
        lo = cut[j][hi]
        bounds.append((lo, hi))
        hi = lo
    bounds.append((0, hi))
    return [list(range(lo, hi)) for lo, hi in reversed(bounds)]


def pad_empty_layers(num_layers: int, pp: int, vpp: int = 1) -> list[list[int | None]]:
    """Slots per virtual stage so every virtual stage (hence every rank) holds the same
    number of slots: layer indices in order, `None` for an empty placeholder.

    Slots per stage = ceil(num_layers / (pp*vpp)). Placeholders go where the pipeline
    already carries extra work: the last virtual stage (head and loss) first, then the
    first (embedding), alternating; when each of those holds only one real layer, the
    next pair inwards (second-to-last, second) takes over. In the first half of the
    stages placeholders sit before the layers, in the second half after them.
    DeepSeek-V3 (61 layers, pp=8, vpp=2): 16 stages of 4 slots; stage 0 = [None, 0, 1, 2],
    stage 15 = [59, 60, None, None].
    """
    for field, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        if value < 1:
            raise PlanError(f"{field} must be >= 1, got {value}")
    num_virtual = pp * vpp
    if num_layers < num_virtual:
        raise PlanError(f"{num_layers} layers cannot give each of pp*vpp = {num_virtual} virtual stages a "
                        "real layer; lower pp or vpp")
    slots = -(-num_layers // num_virtual)
    empties = slots * num_virtual - num_layers
    per_stage = [0] * num_virtual
    for k in range(num_virtual // 2 + num_virtual % 2):
        pair = [num_virtual - 1 - k] + ([k] if k != num_virtual - 1 - k else [])
        while empties and any(per_stage[s] < slots - 1 for s in pair):
            for s in pair:
                if empties and per_stage[s] < slots - 1:
                    per_stage[s] += 1
                    empties -= 1
    out, layer = [], 0
    for s, e in enumerate(per_stage):
        real = list(range(layer, layer + slots - e))
        layer += slots - e
        pads: list[int | None] = [None] * e
        out.append(pads + real if s < num_virtual / 2 else real + pads)
    return out


def slots_to_layout(slots: list[list[int | None]]) -> str:
    """`pad_empty_layers` output as a layout string, with `E` and `L` added."""
    stages = [[EMPTY if x is None else LAYER for x in stage] for stage in slots]
    stages[0].insert(0, EMBED)
    stages[-1].append(HEAD)
    return format_layout(stages)


def stage_costs(stages: list[list[int | None]], layer_costs: list[float], embed_cost: float = 0.0,
                head_cost: float = 0.0) -> list[float]:
    """Cost of each stage (placeholders cost nothing)."""
    out = [sum(layer_costs[i] for i in stage if i is not None) for stage in stages]
    out[0] += embed_cost
    out[-1] += head_cost
    return out


def stage_groups(layer_costs: list[float], num_stages: int, layout: str | None = None,
                 empty_layers: tuple[int, int] | None = None, embed_cost: float = 0.0,
                 head_cost: float = 0.0, shared_ends: bool = False) -> list[list[int]]:
    """The layers of each stage, as the pipeline split assigns them: `layout` when given
    (its "t" count per stage), else `empty_layers=(pp, vpp)` padding (`pad_empty_layers`),
    else `balance_layers` by the layers' costs, stage 0 paying `embed_cost` and the last
    `head_cost`. `shared_ends`: the first and last stage run on one rank (DualPipeV's V),
    so each pays half of the embedding and head together and that rank carries as much as
    another. PlanError when the layout or the layer count does not fit the stages."""
    n = len(layer_costs)
    if layout:
        stages = parse_layout(layout)
        counts = [sum(1 for item in stage if item == "t") for stage in stages]
        if len(stages) != num_stages or sum(counts) != n:
            raise PlanError(f"layout {layout!r} has {len(stages)} stages and {sum(counts)} "
                            f"layers; the plan needs {num_stages} stages and the model has "
                            f"{n} layers")
        starts = [sum(counts[:s]) for s in range(len(counts))]
        return [list(range(start, start + count)) for start, count in zip(starts, counts,
                                                                          strict=True)]
    if empty_layers is not None:
        return [[layer for layer in slots if layer is not None]
                for slots in pad_empty_layers(n, *empty_layers)]
    if n < num_stages:
        raise PlanError(f"{num_stages} pipeline stages need at least as many layers; the "
                        f"model has {n}: lower pp*vpp or add layers")
    if shared_ends:
        embed_cost = head_cost = (embed_cost + head_cost) / 2
    return balance_layers(layer_costs, num_stages, embed_cost, head_cost)
