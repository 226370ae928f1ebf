"""The registry every collective op of mxgraph declares itself in, and process groups by name.

`KIND` maps each op's name to the collective it runs in its forward ("all_reduce",
"all_gather", "reduce_scatter", "all_to_all"), or None for ops that move no data (their
backward is another op in this table, so a joint graph shows it by name). The volume of
one call is the size in bytes of the full tensor: the all-reduce's tensor, the
all-gather's output, the reduce-scatter's input, the all-to-all's input (the convention of
Megatron-LM's formulas, not the bytes a ring algorithm puts on the wire).
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

KIND = {
    "tp_all_reduce": "all_reduce",
    "tp_copy": None,
    "tp_all_gather": "all_gather",
    "tp_slice": None,
    "sp_all_gather": "all_gather",
    "sp_reduce_scatter": "reduce_scatter",
}


VOLUME: dict = {}
"""op name -> function(fx node) -> bytes of one call, for ops whose volume is not the
size of one tensor (e.g. `vocab_parallel_ce`: three all-reduces of one float per token).
The group of an op is its argument named `group_name`."""

GROUP_SIZES: dict[str, int] = {}
"""Sizes of groups that exist only on paper (`group_size` reads these first): tracing a
plan for thousands of ranks on the meta device in one process names groups like
"fake:tp:8" here instead of creating them."""


def process_group(name: str):
    return _resolve_process_group(name)


def group_size(name: str) -> int:
    """The number of ranks in group `name` (a real process group, or one in GROUP_SIZES)."""
    if name in GROUP_SIZES:
        return GROUP_SIZES[name]
    return dist.get_world_size(process_group(name))
