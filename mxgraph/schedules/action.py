"""Pipeline actions: what one rank does at one step, and their compact string form.

An `Action(stage, kind, microbatch)` is one unit of pipeline work. Kinds:

| kind          | meaning                                                        |
|---------------|----------------------------------------------------------------|
| `F`           | forward of `stage` for `microbatch`                            |
| `B`           | backward for inputs (input gradient) only                      |
| `W`           | backward for weights (weight gradient) only; needs its `B`     |
| `BW`          | full backward (`B` then `W` in one action)                     |
| `SEND_F`      | `stage` sends its forward output to `stage + 1`                |
| `RECV_F`      | `stage` receives its forward input from `stage - 1`            |
| `SEND_B`      | `stage` sends its input gradient to `stage - 1`                |
| `RECV_B`      | `stage` receives its output gradient from `stage + 1`          |
| `OVERLAP_F_B` | an `F` and a `B`/`BW` (two stages, two microbatches) that run  |
|               | overlapped, as in DualPipeV's steady state; `parts` holds them |

String form: `{stage}{kind}{microbatch}`, e.g. `1F0`, `0W3`, `2SEND_F1`, `3BW2`; an
overlapped pair is its two parts joined by `&`: `1F3&6BW0` (forward part first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mxgraph.errors import PlanError

F, B, W, BW = "F", "B", "W", "BW"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
OVERLAP_F_B = "OVERLAP_F_B"

COMPUTE_KINDS = (F, B, W, BW)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE_KINDS + COMM_KINDS + (OVERLAP_F_B,)
BACKWARD_KINDS = (B, BW)  # kinds that produce the input gradient

# Longest kinds first so that "BW" is not read as "B" followed by "W3".
_ACTION_RE = re.compile(
    r"^(\d+)(" + "|".join(sorted(COMPUTE_KINDS + COMM_KINDS, key=len, reverse=True)) + r")(\d+)$"
)


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank. For `OVERLAP_F_B`, `stage`/`microbatch` are those of the
    forward part and `parts == (forward_action, backward_action)`; otherwise `parts == ()`."""

    stage: int
    kind: str
    microbatch: int
    parts: tuple["Action", ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"unknown action kind {self.kind!r}; valid kinds: {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise PlanError(f"action {self.kind} needs stage >= 0 and microbatch >= 0, "
                            f"got stage={self.stage}, microbatch={self.microbatch}")
        if self.kind == OVERLAP_F_B:
            ok = (len(self.parts) == 2 and self.parts[0].kind == F
                  and self.parts[1].kind in BACKWARD_KINDS
                  and (self.stage, self.microbatch) == (self.parts[0].stage, self.parts[0].microbatch))
            if not ok:
                raise PlanError("OVERLAP_F_B needs parts=(F action, B or BW action) and the F "
                                f"part's stage/microbatch; got parts={self.parts!r}")
        elif self.parts:
            raise PlanError(f"only OVERLAP_F_B actions have parts, not {self.kind}")

    @staticmethod
    def overlap(forward: "Action", backward: "Action") -> "Action":
        """The overlapped pair `forward & backward` (forward is an F, backward a B or BW)."""
        return Action(forward.stage, OVERLAP_F_B, forward.microbatch, (forward, backward))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS or self.kind == OVERLAP_F_B

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def compute_parts(self) -> tuple["Action", ...]:
        """The plain compute actions this action performs (both parts for an overlap)."""
        if self.kind == OVERLAP_F_B:
            return self.parts
        return (self,) if self.kind in COMPUTE_KINDS else ()

    def __str__(self) -> str:
        if self.kind == OVERLAP_F_B:
            return "&".join(str(p) for p in self.parts)
        return f"{self.stage}{self.kind}{self.microbatch}"


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`: `"1F0"`, `"2SEND_F1"`, `"1F3&6BW0"`."""
    text = text.strip()
    if "&" in text:
        pieces = text.split("&")
        if len(pieces) != 2:
            raise PlanError(f"overlapped action {text!r} must have exactly two parts, like '1F3&6BW0'")
        return Action.overlap(parse_action(pieces[0]), parse_action(pieces[1]))
    match = _ACTION_RE.match(text)
    if match is None:
        raise PlanError(f"cannot parse action {text!r}; expected <stage><kind><microbatch> with kind "
                        f"in {', '.join(COMPUTE_KINDS + COMM_KINDS)} (e.g. '1F0', '2SEND_F1') "
                        "or an overlapped pair like '1F3&6BW0'")
    return Action(int(match.group(1)), match.group(2), int(match.group(3)))
