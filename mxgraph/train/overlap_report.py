"""Communication-compute overlap read from a PyTorch profiler trace (the Chrome-trace JSON
`mxgraph train --profile DIR` writes per rank): per collective kind, how long the transfers
took and how much of that time the compute lane sat idle waiting (`mxgraph inspect
--overlap TRACE`).

How communication shows in a torch 2.13 trace (found on 2-rank gloo runs):
- gloo collectives: the issuing op runs on the main thread (`c10d::allreduce_`,
  `c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, `c10d::alltoall_base_`,
  `c10d::broadcast_`; torch's functional collectives as `_c10d_functional::all_reduce`
  around the `c10d::` op) and returns at once; the transfer runs on one of the group's
  worker threads ("pt_gloo_runloop") as a `gloo:all_reduce` (`gloo:all_gather`,
  `gloo:all_to_all`, `gloo:broadcast`, `gloo:barrier`) span: its duration is the transfer's.
  A reduce-scatter runs as a `gloo:all_reduce`, so a transfer takes the kind of the op that
  issued it. send/recv have no worker: `gloo:send`/`gloo:recv` spans on the main thread,
  from the post to completion (a blocking recv waits inside `c10d::recv_` before it).
- waiting: `_c10d_functional::wait_tensor` is a main-thread op; `Work.wait()` (and the
  wait inside a synchronous `dist.all_reduce`) records nothing: the main thread is idle.
  gloo emits no `record_param_comms` events.
- NCCL (MCCL under MXMACA) on `cuda`: GPU kernels named `ncclDevKernel_AllReduce_...`
  (`mccl...`); the compute lane is then the other GPU kernels.

So a transfer's communication time is its span, and its exposed time the part of the span
in which the compute lane computes nothing: on a CPU trace, the main thread runs no op that
is neither a collective nor a wait (nor contains one). Reported times are in ms.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mxgraph.errors import UserError

ISSUE_OPS = {  # main-thread op -> the collective kind it starts
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_reduce_": "all_reduce",
    "_c10d_functional::all_reduce_coalesced": "all_reduce",
    "c10d::allgather_": "all_gather", "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "c10d::reduce_scatter_": "reduce_scatter", "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "c10d::alltoall_": "all_to_all", "c10d::alltoall_base_": "all_to_all",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "c10d::send": "send/recv", "c10d::recv_": "send/recv", "c10d::recv_any_source_": "send/recv",
    "c10d::broadcast_": "broadcast", "_c10d_functional::broadcast": "broadcast",
    "c10d::barrier": "barrier",
}
WAIT_OPS = {"_c10d_functional::wait_tensor", "c10d::wait"}
GLOO_TRANSFERS = {"gloo:all_reduce": "all_reduce", "gloo:all_gather": "all_gather",
                  "gloo:reduce_scatter": "reduce_scatter", "gloo:all_to_all": "all_to_all",
                  "gloo:broadcast": "broadcast", "gloo:send": "send/recv",
                  "gloo:recv": "send/recv", "gloo:barrier": "barrier"}
KERNEL_KINDS = (  # (pattern in an nccl*/mccl* kernel's name, kind), the first match wins
    ("AllReduce", "all_reduce"), ("AllGather", "all_gather"),
    ("ReduceScatter", "reduce_scatter"), ("AllToAll", "all_to_all"),
    ("SendRecv", "send/recv"), ("Send", "send/recv"), ("Recv", "send/recv"),
    ("Broadcast", "broadcast"),
)
COMM_KERNEL = re.compile(r"^(nccl|mccl)", re.IGNORECASE)
SERVES = {"all_reduce": ("all_reduce", "reduce_scatter", "barrier"),
          "send/recv": ("send/recv", "all_to_all")}
"""A transfer of kind K may carry a collective of these kinds (gloo reduce-scatters by an
all-reduce; NCCL's all-to-all is SendRecv kernels); otherwise only K itself."""
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send/recv",
         "broadcast", "barrier")


@dataclass(frozen=True)
class Transfer:
    kind: str
    start: float  # µs, the trace's clock
    end: float
    exposed: float  # µs of [start, end] with the compute lane idle


def load_events(path: str | Path) -> tuple[list[dict], dict]:
    """The trace's events and its distributedInfo ({} without); UserError for a missing
    file or one that is no Chrome trace."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no trace at {path}; write one per rank with "
                        f"mxgraph train --profile DIR (DIR/rank0.json, ...)")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"{path} is not a profiler trace (Chrome-trace JSON): {error}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise UserError(f"{path} is JSON but not a Chrome trace: it has no traceEvents list")
    keys = {"name", "ts", "dur", "pid", "tid"}
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and keys <= e.keys()]
    return spans, data.get("distributedInfo") or {}


def analyse(events: list[dict]) -> tuple[list[Transfer], list[tuple[float, float]], str]:
    """(transfers, the compute lane's busy intervals merged, "gpu" or "cpu")."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    main = _main_thread_ops(events)
    issues = _outermost([e for e in main if e["name"] in ISSUE_OPS])
    if kernels:
        lane = "gpu"
        compute = [_interval(e) for e in kernels if not COMM_KERNEL.match(e["name"])]
        raw = [(kernel_kind(e["name"]), e) for e in kernels if COMM_KERNEL.match(e["name"])]
    else:
        lane = "cpu"
        compute = _clean_compute(main)
        raw = [(GLOO_TRANSFERS[e["name"]], e) for e in events if e["name"] in GLOO_TRANSFERS]
    merged = merge(compute)
    transfers, unmatched = [], sorted(issues, key=lambda e: e["ts"])
    for kind, event in sorted(raw, key=lambda pair: pair[1]["ts"]):
        start, end = _interval(event)
        issue = next((i for i in unmatched if i["ts"] <= start + 1e-3 and
                      ISSUE_OPS[i["name"]] in SERVES.get(kind, (kind,))), None)
        if issue is not None:
            unmatched.remove(issue)
            kind = ISSUE_OPS[issue["name"]]
            if kind == "send/recv" and lane == "cpu":  # posted and waited on this thread
                start = min(start, issue["ts"])
        transfers.append(Transfer(kind, start, end, uncovered(start, end, merged)))
    return transfers, merged, lane


def kernel_kind(name: str) -> str:
    return next((kind for part, kind in KERNEL_KINDS if part in name), "other")


def overlap_summary(trace_path: str | Path) -> dict:
    """Per collective kind: count, total_ms (the transfers' spans), exposed_ms (of those,
    with the compute lane idle), hidden_fraction = 1 - exposed/total (None without
    communication); "all" sums the kinds. comm_wall_ms / exposed_wall_ms count time with
    any transfer in flight once (transfers may overlap each other); compute_ms is the
    compute lane's busy time and window_ms the trace's span. JSON-able."""
    events, info = load_events(trace_path)
    transfers, compute, lane = analyse(events)
    found = {t.kind for t in transfers}
    kinds = [k for k in KINDS if k in found] + sorted(found - set(KINDS))
    rows = {kind: _row([t for t in transfers if t.kind == kind]) for kind in kinds}
    spans = merge([(t.start, t.end) for t in transfers])
    window = max((e["ts"] + e["dur"] for e in events), default=0) - \
        min((e["ts"] for e in events), default=0)
    return {"trace": str(trace_path), "rank": info.get("rank"), "compute_lane": lane,
            "kinds": rows, "all": _row(transfers),
            "comm_wall_ms": _ms(length(spans)),
            "exposed_wall_ms": _ms(sum(uncovered(s, e, compute) for s, e in spans)),
            "compute_ms": _ms(length(compute)), "window_ms": _ms(window)}


def format_table(summary: dict) -> str:
    rank = "" if summary["rank"] is None else f" (rank {summary['rank']})"
    lines = [(f"{summary['trace']}{rank}: compute lane {summary['compute_lane']}, "
              f"{summary['window_ms']:.2f} ms traced, {summary['compute_ms']:.2f} ms computing"),
             f"{'collective':<16} {'count':>6} {'comm ms':>10} {'exposed ms':>11} {'hidden':>7}"]
    for kind, row in list(summary["kinds"].items()) + [("all", summary["all"])]:
        hidden = "-" if row["hidden_fraction"] is None else f"{row['hidden_fraction']:.1%}"
        lines.append(f"{kind:<16} {row['count']:>6} {row['total_ms']:>10.3f} "
                     f"{row['exposed_ms']:>11.3f} {hidden:>7}")
    lines.append(f"wall time with communication in flight {summary['comm_wall_ms']:.3f} ms, "
                 f"of it exposed {summary['exposed_wall_ms']:.3f} ms")
    return "\n".join(lines)


def trace_files(path: str | Path) -> list[Path]:
    """`path` itself, or the rank*.json traces of a directory (UserError when it has none)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    found = sorted(path.glob("rank*.json*"), key=lambda p: _rank_number(p.name)) or \
        sorted(path.glob("*.json*"))
    if not found:
        raise UserError(f"{path} has no traces (rank*.json); write them with "
                        f"mxgraph train --profile {path}")
    return found


def plot_timeline(paths: list[str | Path], png: str | Path) -> None:
    """A PNG with two lanes per trace: compute (grey) and communication (a colour per
    kind, its exposed part hatched red), in ms from each trace's start."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.9 * len(paths)))
    colours = dict(zip(KINDS, plt.get_cmap("tab10").colors, strict=False))
    labels, seen = [], set()  # y tick labels; the kinds in the legend
    for row, path in enumerate(paths):
        events, info = load_events(path)
        transfers, compute, _ = analyse(events)
        origin = min((e["ts"] for e in events), default=0.0)
        y = 2 * (len(paths) - 1 - row)
        ax.broken_barh([((s - origin) / 1e3, (e - s) / 1e3) for s, e in compute], (y + 1, 0.8),
                       color="0.6")
        for t in transfers:
            bar = [((t.start - origin) / 1e3, (t.end - t.start) / 1e3)]
            label = None if t.kind in seen else t.kind
            seen.add(t.kind)
            ax.broken_barh(bar, (y, 0.8), color=colours.get(t.kind, "black"), label=label)
        spans = merge([(t.start, t.end) for t in transfers])
        idle = [gap for s, e in spans for gap in _gaps(s, e, compute)]
        ax.broken_barh([((s - origin) / 1e3, (e - s) / 1e3) for s, e in idle], (y, 0.8),
                       facecolor="none", edgecolor="red", hatch="////", linewidth=0)
        name = f"rank {info['rank']}" if info.get("rank") is not None else Path(path).stem
        labels += [(y + 0.4, f"{name} comm"), (y + 1.4, f"{name} compute")]
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.set_xlabel("ms from each trace's start")
    ax.set_title("compute and communication per rank")
    handles = ax.get_legend_handles_labels()[0] + [matplotlib.patches.Patch(
        facecolor="none", edgecolor="red", hatch="////", label="exposed")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def merge(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(merged) -> float:
    return sum(e - s for s, e in merged)


def uncovered(start: float, end: float, merged) -> float:
    """How much of [start, end] the merged intervals leave uncovered."""
    return sum(e - s for s, e in _gaps(start, end, merged))


def _gaps(start, end, merged):
    """The parts of [start, end] the merged intervals leave uncovered."""
    cursor = start
    i = max(0, bisect.bisect_right(merged, (start, float("inf"))) - 1)
    for s, e in merged[i:]:
        if s >= end:
            break
        if s > cursor:
            yield cursor, s
        cursor = max(cursor, e)
    if cursor < end:
        yield cursor, end


def _main_thread_ops(events: list[dict]) -> list[dict]:
    """The CPU ops of the main thread (its tid is the process id; else the busiest)."""
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    threads = {(e["pid"], e["tid"]) for e in ops}
    main = next((t for t in threads if t[0] == t[1]), None)
    if main is None and threads:
        main = max(threads, key=lambda t: sum((e["pid"], e["tid"]) == t for e in ops))
    return sorted((e for e in ops if (e["pid"], e["tid"]) == main),
                  key=lambda e: (e["ts"], -e["dur"]))


def _clean_compute(ops: list[dict]) -> list[tuple[float, float]]:
    """The intervals of main-thread ops that are compute: neither a collective or a wait,
    nor inside one, nor containing one. `ops` sorted by (start, -duration)."""
    comm = ISSUE_OPS.keys() | WAIT_OPS
    stack: list[dict] = []
    tainted: set[int] = set()  # ids of ops that are, contain or sit inside a collective
    for op in ops:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= op["ts"]:
            stack.pop()
        if op["name"] in comm:
            tainted.update(id(parent) for parent in stack)
            tainted.add(id(op))
        elif any(parent["name"] in comm for parent in stack):
            tainted.add(id(op))
        stack.append(op)
    return [_interval(op) for op in ops if id(op) not in tainted]


def _outermost(ops: list[dict]) -> list[dict]:
    """The ops not inside another of `ops` (sorted by start, longest first)."""
    kept, end = [], float("-inf")
    for op in ops:
        if op["ts"] >= end:
            kept.append(op)
            end = op["ts"] + op["dur"]
    return kept


def _interval(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event["dur"])


def _row(transfers: list[Transfer]) -> dict:
    total = sum(t.end - t.start for t in transfers)
    exposed = sum(t.exposed for t in transfers)
    return {"count": len(transfers), "total_ms": _ms(total), "exposed_ms": _ms(exposed),
            "hidden_fraction": None if total <= 0 else 1 - exposed / total}


def _ms(microseconds: float) -> float:
    return microseconds / 1e3


def _rank_number(name: str) -> int:
    digits = re.search(r"\d+", name)
    return int(digits.group()) if digits else -1
