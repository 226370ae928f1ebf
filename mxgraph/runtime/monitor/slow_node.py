"""Slow-node detection: time step sections on every rank, compare ranks, name the slow one.

Levels (each includes the ones below):
  0  step phases through `monitor.section(name, kind)`. A compiled step (`Step.set_monitor`)
     times its own: "forward_backward" (compute: the stage programs F/B/W), "grad_sync"
     (comm: the data-parallel reduction, what of it is exposed after the backward),
     "pipeline_wait" (wait: P2P receives), "param_gather" (comm: ZeRO-1 without overlap);
     the training loop adds "data" and "optimizer".
  1  per layer and per collective inside compiled steps: the generated programs call a
     timing point wherever the section changes (`passes/monitor_points.py`), timed here by
     a `ProgramTimer`: "fwd:layer 3", "bwd:layer 3" (B and W pieces; "fwd:embed" etc.
     outside the repeated layers), and for each collective "all_reduce of layer 3" (comm)
     after "all_reduce of layer 3.wait" (wait: a one-element all-reduce on the collective's
     group, so that waiting for a late rank is not mistaken for a slow transfer).
     `monitor.collective(name, fn, ...)` does the same for collectives the loop calls;
     `instrument_layers(model)` (module hooks) serves eager models only: hooks do not
     fire inside a compiled step.
  2  per op through `torch.profiler` (sections "op:<aten op>", top ops by self time, over
     the last `profile_steps` steps of each interval)

Clocks: `time.perf_counter` (monotonic) on the CPU, CUDA events when `device` is a GPU
(resolved at the end of the step). Every `report_every` steps ranks exchange one small
dict (mean ms per step for each section) with `all_gather_object`; `score` compares each
section with the median over the ranks that have it (robust: median absolute deviation;
with two ranks, the slower with the faster) and with the rank's own history. A finding
that persists `min_intervals` intervals becomes a `SlowReport`: a log line, a JSON line
(`json_path`) and `callback(report)`, e.g. "rank 3 on host-a: all_to_all of layer 7 is
1.4x the median (12.3 ms vs 8.8 ms per step, 2 intervals)".

    mon = StepMonitor(config=MonitorConfig(level=0, report_every=50), json_path="slow.jsonl")
    for batch in data:
        with mon.section("data"): tokens, targets = next(batch)
        with mon.section("forward"): loss = model(tokens, targets)
        with mon.section("backward"): loss.backward()
        mon.collective("grad_sync", dist.all_reduce, flat_grads)
        with mon.section("optimizer"): opt.step(); opt.zero_grad()
        mon.step()   # returns the SlowReports of this interval (usually [])

Kinds: "compute" and "comm" sections can be blamed; "wait" sections (time spent waiting
for other ranks) never are, since a rank that waits long is the fast one. A rank that
waits for a straggler inside a collective looks slow in it too: in an interval where some
rank is slow in a compute section, comm findings of the other ranks are dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mxgraph.runtime.collectives.groups import process_group

logger = logging.getLogger("mxgraph.monitor")

KINDS = ("compute", "comm", "wait")
_COMM_WORDS = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
               "reduce_scatter", "all_to_all", "alltoall", "broadcast", "send", "recv")


@dataclasses.dataclass(kw_only=True)
class MonitorConfig:
    level: int = 0
    """0: step sections; 1: + layers and collectives (inside a compiled step: timing
    points in its generated code, so set before it compiles); 2: + per-op profiler.
    The same on every rank."""
    report_every: int = 10
    """Steps per interval: summaries are exchanged and scored once per interval."""
    min_slowdown: float = 0.25
    """A section is slow when it is this fraction above the reference (median or history)."""
    min_abs_ms: float = 1.0
    """...and at least this many ms per step above it (ignores noise in tiny sections)."""
    mad_k: float = 4.0
    """...and this many robust standard deviations (1.4826 * MAD) above the rank median
    (three or more ranks; two are compared with each other)."""
    min_intervals: int = 2
    """Consecutive slow intervals before a report (a single hiccup is not a slow node)."""
    history_len: int = 8
    """Intervals of a rank's own past kept as its baseline."""
    history_slowdown: float = 1.0
    """Fraction above its own baseline (median of its past intervals, and `mad_k` robust
    deviations of them) for a history finding: catches all ranks slowing down together."""
    history_intervals: int = 3
    """Consecutive intervals before a history finding is reported (it is noisier)."""
    top_ops: int = 20
    """Level 2: ops per rank taken into the summary."""
    profile_steps: int = 2
    """Level 2: the last steps of each interval profiled (at most `report_every - 1`):
    summarising a profile costs far more than recording it (~0.2 s per profiled step of
    a 30 ms llama-tiny step on the CPU)."""


@dataclasses.dataclass
class SlowReport:
    step: int
    rank: int
    host: str
    section: str
    kind: str  # the section's kind: "compute" | "comm"
    basis: str  # "ranks" (vs the median of the ranks) | "history" (vs its own past)
    value_ms: float  # mean per step in the last interval
    reference_ms: float
    slowdown: float  # value_ms / reference_ms
    intervals: int
    ranks: int = 0
    """How many ranks reported the section (with two, the reference is the other one)."""

    @property
    def message(self) -> str:
        ref = "its own history" if self.basis == "history" else \
            "the other rank" if self.ranks == 2 else "the median"
        return (f"rank {self.rank} on {self.host}: {self.section} is {self.slowdown:.1f}x "
                f"{ref} ({self.value_ms:.1f} ms vs {self.reference_ms:.1f} ms per step, "
                f"{self.intervals} intervals)")

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "message": self.message})


@dataclasses.dataclass
class Finding:
    rank: int
    section: str
    kind: str
    basis: str
    value_ms: float
    reference_ms: float
    ranks: int = 0

    @property
    def slowdown(self) -> float:
        return self.value_ms / max(self.reference_ms, 1e-9)


def score(summaries: list[dict], history: dict[tuple[int, str], deque],
          cfg: MonitorConfig) -> list[Finding]:
    """Findings for one interval. summaries[r] = {"sections": {name: ms}, "kinds": {...}}.

    Each section is compared over the ranks that report it (pipeline ranks hold different
    layers): with three or more, against their median, beyond `mad_k` robust deviations;
    with two, the slower against the faster (their median is their mean, from which both
    deviate alike). Pure function (history is read only), so it can be tested without
    processes.
    """
    findings = []
    names = sorted(set().union(*(s["sections"] for s in summaries)))
    for name in names:
        held = [(r, s["sections"][name]) for r, s in enumerate(summaries) if name in s["sections"]]
        kind = next(s["kinds"].get(name, "compute") for s in summaries if name in s["sections"])
        if kind == "wait":
            continue
        vals = [v for _, v in held]
        flagged = set()
        if len(vals) == 2:
            ref, floor = min(vals), 0.0
        elif len(vals) > 2:
            ref = statistics.median(vals)
            floor = cfg.mad_k * 1.4826 * statistics.median(abs(v - ref) for v in vals)
        for r, v in held if len(vals) > 1 else ():
            excess = v - ref
            if excess > cfg.min_abs_ms and excess > cfg.min_slowdown * ref and excess > floor:
                findings.append(Finding(r, name, kind, "ranks", v, ref, len(vals)))
                flagged.add(r)
        for r, v in held:
            past = history.get((r, name))
            if r in flagged or not past or len(past) < 3:
                continue
            base = statistics.median(past)
            spread = 1.4826 * statistics.median(abs(p - base) for p in past)
            if v - base > max(cfg.min_abs_ms, cfg.history_slowdown * base, cfg.mad_k * spread):
                findings.append(Finding(r, name, kind, "history", v, base, len(vals)))
    stragglers = {f.rank for f in findings if f.kind == "compute" and f.basis == "ranks"}
    return [f for f in findings if not stragglers or f.kind != "comm" or f.basis != "ranks"
            or f.rank in stragglers]  # the others waited for the straggler in collectives


class _CpuTimer:
    def start(self) -> float:
        return time.perf_counter()

    def elapsed(self, begin: float, end: float) -> float:
        return (end - begin) * 1e3

    def stop(self, token: float) -> float:
        return self.elapsed(token, time.perf_counter())


class _CudaTimer:
    def start(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed(self, begin: Any, end: Any) -> Callable[[], float]:
        return lambda: (end.synchronize(), begin.elapsed_time(end))[1]

    def stop(self, token: Any) -> Callable[[], float]:
        return self.elapsed(token, self.start())


def timed(monitor: StepMonitor | None, name: str, kind: str = "compute"):
    """`monitor.section(name, kind)`, or a context that does nothing without a monitor."""
    return contextlib.nullcontext() if monitor is None else monitor.section(name, kind)


class ProgramTimer:
    """Level 1: the segments of one generated program between its timing points.

    `labels[i]` = (section, kind, group) of the segment that point i opens; the segment
    lasts until the next point, a pause (the program yields before a collective wait
    while another part of an overlapped F&B pair runs: that time is not its own) or the
    program's end. A segment with a group (a collective's ".wait") first runs a
    one-element all-reduce on that group: the time until every member arrived. Set on a
    `Program` as its `clock` by the executor (`PipelineExecutor.set_monitor`)."""

    def __init__(self, monitor: StepMonitor, labels: list[tuple[str, str, str | None]]):
        self.monitor, self.labels = monitor, labels
        self.open: int | None = None
        self.since: Any = None
        for section, kind, _ in labels:
            monitor.kinds[section] = kind

    def point(self, index: int) -> None:
        now = self.monitor.timer.start()
        if index == 0:  # a new run (a run that raised left its segment open)
            self.open = None
        self._close(now)
        self.open, self.since = index, now
        group = self.labels[index][2]
        if group is not None:
            self.monitor.sync(group)

    def _close(self, now: Any) -> None:
        if self.open is not None and self.since is not None:
            self.monitor.add(self.labels[self.open][0],
                             self.monitor.timer.elapsed(self.since, now))
        self.since = None

    def pause(self) -> None:
        self._close(self.monitor.timer.start())

    def resume(self) -> None:
        if self.open is not None:
            self.since = self.monitor.timer.start()

    def end(self) -> None:
        self._close(self.monitor.timer.start())
        self.open = None

    def paused(self, work):
        """`yield from` a program's generator (`Program.steps`), the open segment closed
        while it is paused."""
        while True:
            try:
                next(work)
            except StopIteration as stop:
                return stop.value
            self.pause()
            yield
            self.resume()


class StepMonitor:
    """Per-rank section timer and cross-rank slow-node detector. Call `step()` once per step."""

    def __init__(self, *, rank: int | None = None, world_size: int | None = None,
                 group: Any = None, host: str | None = None,
                 config: MonitorConfig | None = None,
                 callback: Callable[[SlowReport], None] | None = None,
                 json_path: str | None = None, device: torch.device | str | None = None,
                 report_rank: int = 0):
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank(group) if distributed else 0)
        self.world_size = world_size if world_size is not None else \
            (dist.get_world_size(group) if distributed else 1)
        self.group, self.distributed = group, distributed and self.world_size > 1
        self.host = host or socket.gethostname()
        self.cfg = config or MonitorConfig()
        self.callback, self.json_path, self.report_rank = callback, json_path, report_rank
        self.use_device(device if device is not None else "cpu")
        self.kinds: dict[str, str] = {}
        self._pending: list[tuple[str, Any]] = []  # this step's timings: ms or a function
        self._totals: dict[str, float] = defaultdict(float)  # this interval, ms
        self._steps = 0
        self.step_count = 0
        self.history: dict[tuple[int, str], deque] = {}
        self.streak: dict[tuple[int, str, str], int] = defaultdict(int)
        self.reports: list[SlowReport] = []
        self.last_summaries: list[dict] = []
        self._profiler = None
        self._profiled_from = 0

    def use_device(self, device: torch.device | str) -> None:
        """Time on `device`'s clock (CUDA events on a GPU); a compiled step sets its own
        (`Step.set_monitor`)."""
        self.device = torch.device(device)
        self.timer = _CudaTimer() if self.device.type == "cuda" else _CpuTimer()
        self._one = None  # the sync points' one-element tensor, made on first use

    def add(self, name: str, ms: Any) -> None:
        """Add a timing (ms, or a function returning them at the end of the step)."""
        self._pending.append((name, ms))

    @property
    def timings_this_step(self) -> int:
        """How many timings this step recorded so far (sections entered, segments)."""
        return len(self._pending)

    # -- level 0 ------------------------------------------------------------------------
    @contextlib.contextmanager
    def section(self, name: str, kind: str = "compute") -> Iterator[None]:
        """Time the enclosed block as `name` (summed if entered several times in a step)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        self.kinds[name] = kind
        token = self.timer.start()
        try:
            yield
        finally:
            self._pending.append((name, self.timer.stop(token)))

    # -- level 1 ------------------------------------------------------------------------
    def collective(self, name: str, fn: Callable[..., Any], *args: Any, group: Any = None,
                   **kwargs: Any) -> Any:
        """Run collective `fn(*args, **kwargs)` timed as `name` (kind "comm").

        At level >= 1 the ranks of `group` first meet (`wait_for_peers`), so that waiting
        for a late rank is not mistaken for a slow transfer.
        """
        self.wait_for_peers(name, group=group if group is not None else self.group)
        with self.section(name, "comm"):
            return fn(*args, **kwargs)

    def wait_for_peers(self, name: str, group: Any = None) -> None:
        """Level >= 1: time how long this rank waits for the others of `group` (default:
        every rank) as `name.wait` (kind "wait"); nothing at level 0 or on one rank."""
        if self.cfg.level >= 1 and self.distributed:
            with self.section(f"{name}.wait", "wait"):
                self._meet(group)

    def sync(self, group_name: str) -> None:
        """The meeting of a collective's group (`ProgramTimer`), by process-group name."""
        if self.distributed:
            self._meet(process_group(group_name))

    def _meet(self, group: Any) -> None:
        if self._one is None:
            self._one = torch.zeros(1, device=self.device)
        dist.all_reduce(self._one, group=group)

    def program_timer(self, labels: list[tuple[str, str, str | None]]) -> ProgramTimer:
        """A `ProgramTimer` for a program whose timing points open these segments."""
        return ProgramTimer(self, labels)

    def instrument_layers(self, model: torch.nn.Module,
                          match: Callable[[str, torch.nn.Module], bool] | None = None) -> list:
        """Level 1 for an eager model: time forward and backward of chosen submodules
        (default: the items of every nn.ModuleList, i.e. the transformer layers). Returns
        the hook handles. Module hooks do not fire inside a compiled step: there the
        generated code has timing points (`Step.set_monitor`)."""
        if match is None:
            lists = {n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)}
            match = lambda n, m: n.rpartition(".")[0] in lists and n != ""  # noqa: E731
        handles = []
        for name, mod in model.named_modules():
            if not match(name, mod):
                continue
            handles += self._hook(mod, name)
        return handles

    def _hook(self, mod: torch.nn.Module, name: str) -> list:
        tokens: dict[str, Any] = {}

        def fwd_pre(_m, _i):
            tokens["f"] = self.timer.start()

        def fwd_post(_m, _i, _o):
            self.kinds[f"fwd:{name}"] = "compute"
            self._pending.append((f"fwd:{name}", self.timer.stop(tokens.pop("f"))))

        def bwd_pre(_m, _go):
            tokens["b"] = self.timer.start()

        def bwd_post(_m, _gi, _go):
            if "b" in tokens:
                self.kinds[f"bwd:{name}"] = "compute"
                self._pending.append((f"bwd:{name}", self.timer.stop(tokens.pop("b"))))

        return [mod.register_forward_pre_hook(fwd_pre), mod.register_forward_hook(fwd_post),
                mod.register_full_backward_pre_hook(bwd_pre),
                mod.register_full_backward_hook(bwd_post)]

    # -- level 2 ------------------------------------------------------------------------
    def _start_profiler(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if isinstance(self.timer, _CudaTimer):
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=acts)
        self._profiler.__enter__()

    def _op_times(self, steps: int) -> dict[str, float]:
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        cuda = isinstance(self.timer, _CudaTimer)
        rows = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3)
                for e in prof.key_averages()]
        rows.sort(key=lambda r: -r[1])
        return {f"op:{k}": ms / steps for k, ms in rows[:self.cfg.top_ops]}

    # -- per step -----------------------------------------------------------------------
    def step(self) -> list[SlowReport]:
        """End of a training step; every `report_every` steps: exchange, score, report."""
        if self.cfg.level >= 2 and self._profiler is None and \
                self._steps == max(0, self.cfg.report_every - 1 - self.cfg.profile_steps):
            self._start_profiler()  # profiles the interval's last `profile_steps` steps
            self._profiled_from = self._steps + 1
        for name, ms in self._pending:
            self._totals[name] += ms() if callable(ms) else ms
        self._pending.clear()
        self._steps += 1
        self.step_count += 1
        if self._steps < self.cfg.report_every:
            return []
        sections = {k: v / self._steps for k, v in self._totals.items()}
        kinds = dict(self.kinds)
        if self._profiler is not None:
            ops = self._op_times(max(1, self._steps - self._profiled_from))
            sections.update(ops)
            kinds.update({k: "comm" if any(w in k.lower() for w in _COMM_WORDS) else "compute"
                          for k in ops})
        self._totals.clear()
        self._steps = 0
        return self._exchange({"host": self.host, "sections": sections, "kinds": kinds})

    def _exchange(self, summary: dict) -> list[SlowReport]:
        if self.distributed:
            summaries: list[Any] = [None] * self.world_size
            dist.all_gather_object(summaries, summary, group=self.group)
        else:
            summaries = [summary]
        return self.ingest(summaries)

    def ingest(self, summaries: list[dict]) -> list[SlowReport]:
        """Score one interval's summaries (one per rank), update streaks, deliver reports."""
        self.last_summaries = summaries
        findings = score(summaries, self.history, self.cfg)
        seen = set()
        reports = []
        for f in findings:
            key = (f.rank, f.section, f.basis)
            seen.add(key)
            self.streak[key] += 1
            need = self.cfg.min_intervals if f.basis == "ranks" else self.cfg.history_intervals
            if self.streak[key] >= need:
                reports.append(SlowReport(
                    step=self.step_count, rank=f.rank, host=summaries[f.rank]["host"],
                    section=f.section, kind=f.kind, basis=f.basis, value_ms=f.value_ms,
                    reference_ms=f.reference_ms, slowdown=f.slowdown,
                    intervals=self.streak[key], ranks=f.ranks))
        for key in list(self.streak):
            if key not in seen:
                del self.streak[key]
        flagged = {(f.rank, f.section) for f in findings}
        for r, s in enumerate(summaries):  # a slow interval does not become the baseline
            for name, ms in s["sections"].items():
                if (r, name) not in flagged:
                    self.history.setdefault((r, name), deque(maxlen=self.cfg.history_len)) \
                        .append(ms)
        for rep in reports:
            self._deliver(rep)
        return reports

    def _deliver(self, rep: SlowReport) -> None:
        self.reports.append(rep)
        if self.rank == self.report_rank:
            logger.warning("slow node: %s", rep.message)
            if self.json_path:
                with open(self.json_path, "a") as f:
                    f.write(rep.to_json() + "\n")
        if self.callback is not None:
            self.callback(rep)
