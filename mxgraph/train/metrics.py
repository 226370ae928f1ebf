"""The metrics of `mxgraph train`: periodic validation (--eval-every), MFU, peak memory, and
the --log-dir records (JSONL and TensorBoard), written by rank 0.

    DIR/metrics.jsonl   one JSON object per logged step (`RECORD_FIELDS`)
    DIR/run.json        the run's constants: model FLOPs per token, the peak FLOP/s MFU
                        divides by and where it comes from, processes, data-parallel ranks
    DIR/events.out.tfevents.*   TensorBoard scalars, the record's numbers under the same names

What goes where follows Hugging Face Trainer's `report_to`: --report-to lists the
destinations (jsonl, tensorboard); TensorBoard needs `pip install mxgraph[metrics]`, and
when it is asked for and missing the run stops before it starts (no silent JSONL only).

MFU = model FLOPs per token (`mxgraph.train.flops`: measured from the model's own ops) x tokens
per second over every data-parallel rank / (the device profile's peak_flops x processes).
The peak comes from --device-profile, else from the built-in profile of this device's name
(`PROFILE_BY_DEVICE_NAME`); on the CPU it is measured at the start, the machine's fp32 GEMM
rate, which the run's processes share (`device_peak`). On a GPU no profile matches, MFU is
NaN and a warning says so.

Validation between steps changes nothing of the training: it reads its own fixed batches,
runs without gradients in eval mode, and the random states are put back after it
(`flops.preserved_rng`); the non-finite guard never sees its loss.
"""
from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from mxgraph.errors import UserError
from mxgraph.runtime.cluster.device import DeviceInfo, detect
from mxgraph.train.flops import mfu, model_flops_per_token, preserved_rng

log = logging.getLogger("mxgraph.train")

REPORT_TO = ("jsonl", "tensorboard")
TENSORBOARD_HINT = "pip install mxgraph[metrics] (or pip install tensorboard)"
RECORD_FIELDS = {
    "step": "optimizer steps applied so far (this record is of the last one)",
    "loss": "that step's training loss (nats/token, the mean over data-parallel ranks)",
    "lr": "its learning rate (train.lr_at)",
    "grad_norm": "its gradient norm over the whole model, before clipping",
    "tokens_per_s": "tokens per second of one data-parallel rank since the previous record, "
                    "validation time left out",
    "mfu": "model FLOPs utilisation over the same time (null without a device profile)",
    "memory_peak_bytes": "peak memory of this process so far, bytes (see memory_kind)",
    "memory_kind": "cuda_max_memory_allocated (torch.cuda.max_memory_allocated) or "
                   "process_peak_rss (the process's peak resident set, on the CPU)",
    "dropped_fraction": "MoE models only: the mean over MoE blocks of the (token, choice) "
                        "rows dropped by the plan's moe.capacity_factor (0.0 when dropless)",
    "val_loss": "--eval-every steps only: the validation loss after that step",
}
"""The fields of a metrics.jsonl record."""

PROFILE_BY_DEVICE_NAME = (
    # (substring of torch.cuda.get_device_name, built-in profile); the first match wins
    ("H800", "h800"),
    ("H100", "h100-sxm"),
    ("H200", "h100-sxm"),  # H200 datasheet: the H100 SXM's compute, 989 TFLOPS bf16 dense
    ("A100", "a100-80gb"),
)


def report_destinations(report_to: str) -> tuple[str, ...]:
    """The destinations --report-to names; UserError for an unknown one or a missing
    tensorboard package."""
    names = tuple(n.strip() for n in report_to.split(",") if n.strip())
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown or not names:
        raise UserError(f"--report-to {report_to!r}: {', '.join(unknown) or 'nothing'} is no "
                        f"destination; list one or more of {', '.join(REPORT_TO)}")
    if "tensorboard" in names:
        try:
            import tensorboard  # noqa: F401 - SummaryWriter needs it
        except ImportError:
            raise UserError(f"--log-dir with --report-to tensorboard needs the tensorboard "
                            f"package: {TENSORBOARD_HINT}; or pass --report-to jsonl") from None
    return names


def check_metrics_flags(cfg) -> None:
    """UserError for a bad --eval-every, --log-every, --report-to or --device-profile
    (before any model is built)."""
    if cfg.eval_every < 0:
        raise UserError(f"--eval-every {cfg.eval_every} must be 0 (only at the end) or more "
                        f"(steps between validations)")
    if cfg.log_every < 1:
        raise UserError(f"--log-every {cfg.log_every} must be 1 or more (steps)")
    if cfg.log_dir:
        report_destinations(cfg.report_to)
        if int(os.environ.get("RANK", "0")) == 0:  # the one that writes
            check_log_dir(cfg.log_dir)
    if cfg.device_profile:
        from mxgraph.devices.catalog import load_device
        load_device(cfg.device_profile)


def check_log_dir(path: str) -> None:
    """UserError unless `path` is (or can be made) a directory this process can write."""
    from mxgraph.train.checkpoints import check_writable_dir
    check_writable_dir(path, "--log-dir")


def device_peak(profile: str | None, info: DeviceInfo, processes: int = 1
                ) -> tuple[str | None, float]:
    """(profile name, peak FLOP/s of one process's device) for MFU: --device-profile's, else
    the built-in profile of `info` (module docstring); (None, NaN) when none matches.

    On the CPU with no profile named, the peak is measured (`cpu_peak_flops`: the machine's
    fp32 GEMM rate) and the processes share it: each gets its `processes`-th, so that one
    process with every core, or four with a core each, are judged against the same machine.
    (The built-in `cpu` profile is the search's effective rate for 4 ranks on 2 cores, not a
    peak.)"""
    from mxgraph.devices.catalog import load_device
    if profile:
        return profile, load_device(profile).peak_flops
    if info.kind == "cpu":
        return "measured fp32 GEMM", cpu_peak_flops() / processes
    if info.kind == "metax":
        return "metax-c500", load_device("metax-c500").peak_flops
    for fragment, name in PROFILE_BY_DEVICE_NAME:
        if fragment in info.name:
            return name, load_device(name).peak_flops
    return None, float("nan")


def cpu_peak_flops(n: int = 1024) -> float:
    """This machine's fp32 peak, FLOP/s: one core's best rate of an n x n GEMM (of 3)
    times the cores this process may run on. Under a gloo process group rank 0 measures
    and broadcasts it, so every rank divides by the same figure and no two ranks measure at
    once."""
    rate = torch.zeros(1, dtype=torch.float64)
    shared = dist.is_initialized() and dist.get_world_size() > 1 and \
        dist.get_backend() == "gloo"
    if not shared or dist.get_rank() == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            generator = torch.Generator().manual_seed(0)  # the run's random stream untouched
            a, b = (torch.randn(n, n, generator=generator) for _ in range(2))
            a @ b
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        rate[0] = 2 * n ** 3 / best * cores
    if shared:
        dist.broadcast(rate, src=0)
    return float(rate[0])


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(peak bytes so far, how measured): torch.cuda.max_memory_allocated on a `cuda`
    device, else the process's peak resident set (getrusage)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), "process_peak_rss"


class MetricsWriter:
    """Rank 0's --log-dir: metrics.jsonl and TensorBoard event files (module docstring).
    A run that starts at step 0 starts metrics.jsonl afresh; a resumed one appends."""

    def __init__(self, log_dir: str, report_to: tuple[str, ...], run: dict, append: bool):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.jsonl = open(self.path, "a" if append else "w") if "jsonl" in report_to else None
        self.tensorboard = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(log_dir=log_dir)
        with open(os.path.join(log_dir, "run.json"), "w") as f:
            json.dump(run, f, indent=1)

    def write(self, record: dict) -> None:
        """One record: a JSON line (a value that is not a finite number as null), and each
        number but the step as a TensorBoard scalar at that step."""
        numbers = {name: value for name, value in record.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)}
        if self.jsonl is not None:
            line = {name: numbers.get(name, value if isinstance(value, str) else None)
                    for name, value in record.items()}
            self.jsonl.write(json.dumps(line) + "\n")
            self.jsonl.flush()
        if self.tensorboard is not None:
            for name, value in numbers.items():
                if name != "step":
                    self.tensorboard.add_scalar(name, value, record["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class RunMetrics:
    """What `train`'s loop reports after each applied step: every --log-every steps a
    record, every --eval-every steps a validation (every rank runs it: it is collective
    under dp and pp; rank 0 writes)."""

    def __init__(self, cfg, *, flops_per_token: float, peak: tuple[str | None, float],
                 dp: int, processes: int, device: torch.device, moe: str | None,
                 evaluate: Callable[[], float], rank: int, start_step: int):
        self.cfg, self.evaluate, self.device, self.moe = cfg, evaluate, device, moe
        self.flops_per_token, (self.profile, self.peak_flops) = flops_per_token, peak
        self.dp, self.processes = dp, processes
        """Data-parallel ranks (their tokens add up) and processes (their peaks add up)."""
        self.eval_seconds = 0.0
        """Seconds spent in periodic validation (left out of tokens/s)."""
        self.last_val_loss: float | None = None
        self.writer = None
        if rank == 0 and cfg.log_dir:
            run = {"flops_per_token": flops_per_token, "device_profile": self.profile,
                   "peak_flops_per_device": self.peak_flops, "processes": processes,
                   "data_parallel": dp, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                   "fields": RECORD_FIELDS}
            self.writer = MetricsWriter(cfg.log_dir, report_destinations(cfg.report_to), run,
                                        append=start_step > 0)
        self._mark = (time.perf_counter(), 0, 0.0)  # (time, iterations, eval seconds)

    @classmethod
    def for_run(cls, cfg, step_fn, flops_per_token: float, moe: str | None, rank: int,
                start_step: int, evaluate: Callable[[], float]) -> RunMetrics:
        """The metrics of `train`'s run of `step_fn` (a compiled step, or the model itself
        under --eager: one process, one data-parallel rank): MFU over the run's processes,
        validation by `evaluate`."""
        if cfg.eager:
            device, dp, processes = next(step_fn.parameters()).device, 1, 1
        else:
            device, dp = step_fn.mesh.device, step_fn.mesh.sizes["dp"]
            processes = dist.get_world_size() if dist.is_initialized() else 1
        info = detect(device)
        peak = device_peak(cfg.device_profile, info, processes)
        if peak[0] is None and rank == 0:
            log.warning("no device profile for %s: MFU is not computed; name one with "
                        "--device-profile (a built-in or a TOML device file)", info.name)
        return cls(cfg, flops_per_token=flops_per_token, peak=peak, dp=dp, processes=processes,
                   device=device, moe=moe, rank=rank, evaluate=evaluate, start_step=start_step)

    def mfu(self, tokens_per_s: float) -> float:
        """MFU of `tokens_per_s` per data-parallel rank over all processes."""
        return mfu(self.flops_per_token, tokens_per_s * self.dp, self.peak_flops * self.processes)

    def after_update(self, step: int, verdict, iterations: int, lr: float, dropped) -> None:
        """After applied step `step` (1-based): validate and log when due. `iterations`:
        steps run so far (applied or not: their tokens were processed); `dropped`: a
        callable giving {MoE block: dropped fraction} of the step, for MoE models."""
        cfg = self.cfg
        evaluating = cfg.eval_every and step % cfg.eval_every == 0
        logging_now = step % cfg.log_every == 0 or evaluating
        if not logging_now:
            return
        record = self.train_record(step, verdict, iterations, lr, dropped)
        if evaluating:
            started = time.perf_counter()
            with preserved_rng():
                self.last_val_loss = self.evaluate()
            self.eval_seconds += time.perf_counter() - started
            record["val_loss"] = self.last_val_loss
            log.info("step %d: validation loss %.4f nats/token", step, self.last_val_loss)
        self._mark = (time.perf_counter(), iterations, self.eval_seconds)
        if self.writer is not None:
            self.writer.write(record)

    def train_record(self, step: int, verdict, iterations: int, lr: float, dropped) -> dict:
        now = time.perf_counter()
        then, then_iterations, then_eval = self._mark
        seconds = max(1e-9, now - then - (self.eval_seconds - then_eval))
        tokens_per_s = (iterations - then_iterations) * self.cfg.batch_size * \
            self.cfg.seq_len / seconds
        memory, kind = peak_memory(self.device)
        record = {"step": step, "loss": verdict.loss, "lr": lr, "grad_norm": verdict.grad_norm,
                  "tokens_per_s": tokens_per_s, "mfu": self.mfu(tokens_per_s),
                  "memory_peak_bytes": memory, "memory_kind": kind}
        if self.moe == "capacity":
            fractions = dropped()
            record["dropped_fraction"] = sum(fractions.values()) / max(1, len(fractions))
        elif self.moe == "dropless":
            record["dropped_fraction"] = 0.0
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def count_flops(model: torch.nn.Module, train_tokens: np.ndarray, seq_len: int) -> float:
    """Model FLOPs per token of `model` at `seq_len` (`flops.model_flops_per_token`, on the
    first training tokens); a warning names the ops it could not count."""
    sample = torch.from_numpy(train_tokens[:seq_len + 1].astype(np.int64))
    flops, uncounted = model_flops_per_token(model, sample, seq_len)
    if uncounted:
        log.warning("MFU leaves out the FLOPs of %s (no FLOP rule in mxgraph/cost.py)",
                    ", ".join(uncounted))
    return flops


def moe_kind(model: torch.nn.Module, capacity_factor: float | None) -> str | None:
    """"capacity" when the plan's moe.capacity_factor drops rows (the step records them),
    "dropless" for another model with routed experts (stacked expert weights: a parameter
    of 3 or more dims, as the presets and transformers 5 write them) that does not pad
    them itself, None for a dense model or one that drops rows the step does not see (a
    model-level capacity factor: then no dropped_fraction is written, and a warning says
    so)."""
    if not any(p.dim() >= 3 for p in model.parameters()):
        return None
    if capacity_factor is not None:
        return "capacity"
    own = getattr(model.config, "capacity_factor", None)
    if own is not None:
        log.warning("the model pads its experts itself (capacity_factor=%s in its config): "
                    "the rows it drops are not counted, so the --log-dir records have no "
                    "dropped_fraction (the plan's moe.capacity_factor is counted)", own)
        return None
    return "dropless"


def format_mfu(value: float) -> str:
    return "MFU n/a (no device profile: --device-profile)" if math.isnan(value) \
        else f"MFU {value:.2%}"
