"""Slow-node detection: time step sections on every rank, compare ranks, name the slow one.

Levels (each includes the ones below):
  0  step phases through `monitor.section(name, kind)`: data, forward, backward, optimizer,
     pipeline wait, gradient sync...
  1  per layer (`instrument_layers(model)`: forward/backward hooks) and per collective
     (`monitor.collective(name, fn, ...)`: a barrier first splits the time into waiting
     for late ranks, kind "wait", and the transfer itself, kind "comm")
  2  per op through `torch.profiler` (sections "op:<aten op>", top ops by self time)

Clocks: `time.perf_counter` (monotonic) on the CPU, CUDA events when `device` is a GPU
(resolved at the end of the step). Every `report_every` steps ranks exchange one small
dict (mean ms per step for each section) with `all_gather_object`; `score` compares each
section with the median over ranks (robust: median absolute deviation) and with the rank's
own history. A finding that persists `min_intervals` intervals becomes a `SlowReport`:
a log line, a JSON line (`json_path`) and `callback(report)`.

    mon = StepMonitor(config=MonitorConfig(level=0, report_every=50), json_path="slow.jsonl")
    for batch in data:
        with mon.section("data"): tokens, targets = next(batch)
        with mon.section("forward"): loss = model(tokens, targets)
        with mon.section("backward"): loss.backward()
        mon.collective("grad_sync", dist.all_reduce, flat_grads)
        with mon.section("optimizer"): opt.step(); opt.zero_grad()
        mon.step()   # returns the SlowReports of this interval (usually [])

Kinds: "compute" and "comm" sections can be blamed; "wait" sections (time spent waiting
for other ranks) never are, since a rank that waits long is the fast one.
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
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger("mxgraph.monitor")

KINDS = ("compute", "comm", "wait")
_COMM_WORDS = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
               "reduce_scatter", "all_to_all", "alltoall", "broadcast", "send", "recv")


@dataclasses.dataclass(kw_only=True)
class MonitorConfig:
    level: int = 0
    """0: step sections; 1: + layers and collectives; 2: + per-op profiler."""
    report_every: int = 10
    """Steps per interval: summaries are exchanged and scored once per interval."""
    min_slowdown: float = 0.25
    """A section is slow when it is this fraction above the reference (median or history)."""
    min_abs_ms: float = 1.0
    """...and at least this many ms per step above it (ignores noise in tiny sections)."""
    mad_k: float = 4.0
    """...and this many robust standard deviations (1.4826 * MAD) above the rank median."""
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


@dataclasses.dataclass
class SlowReport:
    step: int
    rank: int
    host: str
    section: str
    kind: str  # "compute" | "communication"
    basis: str  # "ranks" (vs the median of all ranks) | "history" (vs its own past)
    value_ms: float  # mean per step in the last interval
    reference_ms: float
    slower_pct: float
    intervals: int

    @property
    def message(self) -> str:
        ref = "the median" if self.basis == "ranks" else "its own history"
        return (f"rank {self.rank} ({self.host}): {self.section} {self.slower_pct:.0f}% slower "
                f"than {ref} for {self.intervals} intervals ({self.kind}; "
                f"{self.value_ms:.2f} ms vs {self.reference_ms:.2f} ms per step)")

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

    @property
    def slower_pct(self) -> float:
        return 100.0 * (self.value_ms - self.reference_ms) / max(self.reference_ms, 1e-9)


def score(summaries: list[dict], history: dict[tuple[int, str], deque],
          cfg: MonitorConfig) -> list[Finding]:
    """Findings for one interval. summaries[r] = {"sections": {name: ms}, "kinds": {...}}.

    Pure function (history is read only), so it can be tested without processes.
    """
    findings = []
    names = set.intersection(*[set(s["sections"]) for s in summaries]) if summaries else set()
    for name in sorted(names):
        kind = summaries[0]["kinds"].get(name, "compute")
        if kind == "wait":
            continue
        vals = [s["sections"][name] for s in summaries]
        med = statistics.median(vals)
        mad = statistics.median(abs(v - med) for v in vals)
        flagged = set()
        for r, v in enumerate(vals):
            excess = v - med
            if len(vals) > 1 and excess > cfg.min_abs_ms and excess > cfg.min_slowdown * med \
                    and excess > cfg.mad_k * 1.4826 * mad:
                findings.append(Finding(r, name, kind, "ranks", v, med))
                flagged.add(r)
        for r, v in enumerate(vals):
            past = history.get((r, name))
            if r in flagged or not past or len(past) < 3:
                continue
            base = statistics.median(past)
            spread = 1.4826 * statistics.median(abs(p - base) for p in past)
            if v - base > max(cfg.min_abs_ms, cfg.history_slowdown * base, cfg.mad_k * spread):
                findings.append(Finding(r, name, kind, "history", v, base))
    return findings


class _CpuTimer:
    def start(self) -> float:
        return time.perf_counter()

    def stop(self, token: float) -> Callable[[], float]:
        ms = (time.perf_counter() - token) * 1e3
        return lambda: ms


class _CudaTimer:
    def start(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, token: Any) -> Callable[[], float]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return lambda: (end.synchronize(), token.elapsed_time(end))[1]


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
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.timer = _CudaTimer() if dev.type == "cuda" else _CpuTimer()
        self.kinds: dict[str, str] = {}
        self._pending: list[tuple[str, Callable[[], float]]] = []  # this step's timings
        self._totals: dict[str, float] = defaultdict(float)  # this interval, ms
        self._steps = 0
        self.step_count = 0
        self.history: dict[tuple[int, str], deque] = {}
        self.streak: dict[tuple[int, str, str], int] = defaultdict(int)
        self.reports: list[SlowReport] = []
        self.last_summaries: list[dict] = []
        self._profiler = None

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

        At level >= 1 a barrier on `group` runs first and is timed as `name.wait`, so that
        waiting for a late rank is not mistaken for a slow transfer.
        """
        if self.cfg.level >= 1 and self.distributed:
            with self.section(f"{name}.wait", "wait"):
                dist.barrier(group=group if group is not None else self.group)
        with self.section(name, "comm"):
            return fn(*args, **kwargs)

    def instrument_layers(self, model: torch.nn.Module,
                          match: Callable[[str, torch.nn.Module], bool] | None = None) -> list:
        """Level 1: time forward and backward of chosen submodules (default: the items of
        every nn.ModuleList, i.e. the transformer layers). Returns the hook handles."""
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
        if self.cfg.level >= 2 and self._profiler is None and self._steps == 0:
            self._start_profiler()  # profiles from the second step of the interval on
        for name, get_ms in self._pending:
            self._totals[name] += get_ms()
        self._pending.clear()
        self._steps += 1
        self.step_count += 1
        if self._steps < self.cfg.report_every:
            return []
        sections = {k: v / self._steps for k, v in self._totals.items()}
        kinds = dict(self.kinds)
        if self._profiler is not None:
            ops = self._op_times(self._steps - 1 or 1)
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
                    section=f.section, kind="communication" if f.kind == "comm" else "compute",
                    basis=f.basis, value_ms=f.value_ms, reference_ms=f.reference_ms,
                    slower_pct=f.slower_pct, intervals=self.streak[key]))
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
