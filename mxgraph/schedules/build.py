"""`build_schedule(name, pp, num_microbatches, vpp)`: the one entry point to generators.

| name          | stages     | placement            | vpp      | microbatches          |
|---------------|------------|----------------------|----------|-----------------------|
| "gpipe"       | pp         | stage s on rank s    | 1        | >= 1                  |
| "1f1b"        | pp         | stage s on rank s    | 1        | >= 1                  |
| "interleaved" | pp * vpp   | stage s on rank s%pp | >= 1 (2) | multiple of pp        |
| "zbh1"        | pp         | stage s on rank s    | 1        | >= 1                  |
| "dualpipev"   | 2 * pp     | V: ranks r, 2pp-1-r  | 2        | >= 2 * pp             |

`vpp=None` takes the value in parentheses (1 where none is given).
"""

from __future__ import annotations

from typing import Callable

from mxgraph.errors import PlanError
from mxgraph.schedules.dualpipev import dualpipev, dualpipev_min_microbatches
from mxgraph.schedules.gpipe import gpipe
from mxgraph.schedules.interleaved import interleaved
from mxgraph.schedules.one_f_one_b import one_f_one_b
from mxgraph.schedules.schedule import Schedule
from mxgraph.schedules.zero_bubble import zbh1


def _check_vpp_one(name: str, pp: int, m: int, vpp: int) -> None:
    if vpp != 1:
        raise PlanError(f"schedule {name!r} holds one stage per rank: vpp must be 1, got vpp={vpp} "
                        "(use 'interleaved' for vpp > 1, or 'dualpipev' for vpp = 2)")


def _check_interleaved(name: str, pp: int, m: int, vpp: int) -> None:
    if m % pp != 0:
        raise PlanError(f"schedule 'interleaved' needs num_microbatches to be a multiple of pp={pp}, "
                        f"got num_microbatches={m} (valid: {pp}, {2 * pp}, {3 * pp}, ...)")


def _check_dualpipev(name: str, pp: int, m: int, vpp: int) -> None:
    if vpp != 2:
        raise PlanError(f"schedule 'dualpipev' places two stages per rank (V shape): vpp must be 2, "
                        f"got vpp={vpp}")
    need = dualpipev_min_microbatches(pp)
    if m < need:
        raise PlanError(f"schedule 'dualpipev' needs num_microbatches >= 2 * pp = {need}, "
                        f"got num_microbatches={m}")


# name -> (default vpp, legality check, generator(pp, m, vpp))
SCHEDULES: dict[str, tuple[int, Callable, Callable[[int, int, int], Schedule]]] = {
    "gpipe": (1, _check_vpp_one, lambda pp, m, vpp: gpipe(pp, m)),
    "1f1b": (1, _check_vpp_one, lambda pp, m, vpp: one_f_one_b(pp, m)),
    "interleaved": (2, _check_interleaved, interleaved),
    "zbh1": (1, _check_vpp_one, lambda pp, m, vpp: zbh1(pp, m)),
    "dualpipev": (2, _check_dualpipev, lambda pp, m, vpp: dualpipev(pp, m)),
}


def build_schedule(name: str, pp: int, num_microbatches: int, vpp: int | None = None) -> Schedule:
    """The schedule `name` for `pp` pipeline ranks; raises PlanError for illegal input."""
    if name not in SCHEDULES:
        raise PlanError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}")
    default_vpp, check, generate = SCHEDULES[name]
    vpp = default_vpp if vpp is None else vpp
    for field, value in (("pp", pp), ("num_microbatches", num_microbatches), ("vpp", vpp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{field} must be an integer >= 1, got {field}={value!r}")
    check(name, pp, num_microbatches, vpp)
    return generate(pp, num_microbatches, vpp)
