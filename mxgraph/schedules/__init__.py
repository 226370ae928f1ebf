"""Pipeline schedules as data: actions per rank, generators, validator, simulator, layout.

    sched = build_schedule("zbh1", pp=4, num_microbatches=8)
    validate(sched)                                   # raises ScheduleError with a grid
    tl = simulate(sched, Costs(f=1, b=1, w=1))
    tl.bubble_ratio, tl.peak_activations; tl.to_chrome_trace("t.json"); tl.to_png("t.png")
"""

from mxgraph.schedules.action import (
    BW,
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    parse_action,
)
from mxgraph.schedules.build import SCHEDULES, build_schedule
from mxgraph.schedules.layout import (
    balance_layers,
    format_layout,
    pad_empty_layers,
    parse_layout,
    slots_to_layout,
    stage_costs,
)
from mxgraph.schedules.schedule import Schedule, add_comm_actions, format_grid, schedule_from_text
from mxgraph.schedules.simulate import Costs, simulate
from mxgraph.schedules.timeline import Timeline
from mxgraph.schedules.validate import ScheduleError, validate

__all__ = [
    "Action", "parse_action", "Schedule", "schedule_from_text", "add_comm_actions", "format_grid",
    "build_schedule", "SCHEDULES", "validate", "ScheduleError", "Costs", "simulate", "Timeline",
    "F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "OVERLAP_F_B",
    "KINDS", "COMPUTE_KINDS", "COMM_KINDS",
    "parse_layout", "format_layout", "balance_layers", "pad_empty_layers", "slots_to_layout", "stage_costs",
]
