"""`mxgraph train`: train a preset or Hugging Face model with a compiled step on built-in or
given data."""
from __future__ import annotations

import logging
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import mxgraph
from mxgraph.data.batches import Batches, split
from mxgraph.data.training_data import TrainingData, training_data
from mxgraph.errors import DataError, UserError
from mxgraph.hf.export import export_info
from mxgraph.hf.models import build_hf_model
from mxgraph.hf.pretrained import build_from_dir, load_weights
from mxgraph.plan import Plan
from mxgraph.runtime.checkpoint.flash import FlashCheckpointer
from mxgraph.runtime.cluster.device import detect
from mxgraph.runtime.cluster.launch import init_from_environment
from mxgraph.runtime.grad_norm import named_gradient_pieces
from mxgraph.runtime.health import Drill, Guard, NonFiniteError, Verdict, locate
from mxgraph.runtime.monitor.slow_node import MonitorConfig, StepMonitor
from mxgraph.runtime.precision import PARAM_DTYPE
from mxgraph.train.checkpoints import RunCheckpoints, check_checkpoint_dir, run_id_for
from mxgraph.train.config import TrainConfig
from mxgraph.train.metrics import RunMetrics, check_metrics_flags, count_flops, moe_kind
from mxgraph.train.model_spec import ModelSpec, resolve_model
from mxgraph.train.precision import check_precision_flags, plan_with_precision

log = logging.getLogger("mxgraph.train")


class _ConsoleHandler(logging.Handler):
    """Log records written above the progress bar (tqdm.write), to stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def log_to_console() -> None:
    """Show mxgraph's log on stderr as `mxgraph[rank R]: message`: INFO and up on rank 0,
    warnings and up on the other ranks (restores, restarts, slow nodes, checkpoints)."""
    rank = int(os.environ.get("RANK", "0"))
    root = logging.getLogger("mxgraph")
    if any(isinstance(h, _ConsoleHandler) for h in root.handlers):
        return
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter(f"mxgraph[rank {rank}]: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _init_distributed() -> int:
    """Join the torchrun job, if any (as `mxgraph.compile` would); returns the global rank."""
    init_from_environment()
    return dist.get_rank() if dist.is_initialized() else 0


def build_training_model(cfg: TrainConfig, dtype: torch.dtype | None = None,
                         spec: ModelSpec | None = None) -> torch.nn.Module:
    """The model `cfg.model` names (`model_spec.resolve_model`), with `cfg.model_config`'s
    overrides: a preset (`models.build_model`) or a Hugging Face model (`hf:<model_type>`
    or a config.json, `mxgraph.hf.build_hf_model`, its KV cache turned off: training throws
    it away), or a pretrained model directory (`mxgraph.hf.pretrained.build_from_dir`: no
    weights until `load_weights` after compile). Each has `.config.vocab_size`. `dtype`: its
    parameters' (default: those of the precision that --precision or --dtype ask for,
    `PARAM_DTYPE`). `spec`: `cfg.model` already resolved (else resolved here)."""
    import models

    dtype = dtype or PARAM_DTYPE[check_precision_flags(cfg.precision, cfg.dtype) or "fp32"]
    spec = spec or resolve_model(cfg.model, cfg.model_config, command="train")
    if spec.kind == "preset":
        return models.build_model(spec.name, dtype=dtype, **spec.overrides)
    if spec.kind == "pretrained":  # its weights are read after compile: `load_weights`
        model = build_from_dir(spec.directory, spec.overrides, dtype=dtype)
    else:
        model = build_hf_model(spec.config_source, spec.overrides, dtype=dtype)
    model.config.use_cache = False
    return model


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train; returns {"train_loss" (the last applied step's), "val_loss", "tokens_per_s"
    (of one data-parallel rank, periodic validation left out), "mfu"
    (`metrics.RunMetrics.mfu`; NaN without a device profile), "seconds", "start_step",
    "skipped" and "rollbacks" (steps the non-finite policy did not apply), "parameters"
    (name -> this rank's tensor after the run: its shards, its stages), "optimized" (name ->
    what the optimizer updated: the same, or the fp32 master weights under bf16-mixed, the
    flat shards under zero1)}. Raises NonFiniteError when the policy stops the run."""
    started = time.perf_counter()
    guard = nonfinite_guard(cfg)
    check_metrics_flags(cfg)
    if cfg.save_every or cfg.resume:
        check_checkpoint_dir(cfg.checkpoint_dir)
    rank = _init_distributed()
    seed_everything(cfg.seed)
    plan = plan_with_precision(Plan.from_toml(cfg.plan) if cfg.plan else Plan(), cfg.precision,
                               cfg.dtype, cfg.eager, cfg.plan)
    spec = resolve_model(cfg.model, cfg.model_config, command="train")
    data = training_data(cfg.data, cfg.tokenizer, cfg.data_field, cfg.model,
                         spec.vocab_size, cfg.batch_size, cfg.seq_len,
                         progress=progress and rank == 0)  # tokenized once, before the model
    model = build_training_model(cfg, PARAM_DTYPE[plan.precision], spec)
    vocab = model.config.vocab_size
    tokens = data.tokens
    if not data.packed and int(tokens.max()) >= vocab:  # a tokenizer's ids were checked
        raise DataError(f"data has token id {int(tokens.max())} but {cfg.model} has "
                        f"vocab_size={vocab}; choose a model with a larger vocabulary or "
                        f"set --model-config vocab_size={int(tokens.max()) + 1}")
    train_tokens, val_tokens = split(tokens)
    flops_per_token = count_flops(model, train_tokens, cfg.seq_len)  # whole model, uncompiled
    moe = moe_kind(model, None if cfg.eager else plan.moe.capacity_factor)
    step_fn = model if cfg.eager else mxgraph.compile(model, plan)
    dp_rank = 0 if cfg.eager else step_fn.mesh.coords["dp"]
    dp_size = 1 if cfg.eager else step_fn.mesh.sizes["dp"]
    batches = data.batches(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed, dp_rank, dp_size)
    monitor = slow_node_monitor(cfg, step_fn, rank)
    if not cfg.eager:  # compile first: with pp, this rank's parameters are known after
        step_fn.prepare(*batches.peek())
        step_fn.guard = guard
    if not cfg.eager and plan.pp > 1:
        release_other_stages(model, step_fn)
    if spec.kind == "pretrained":  # this rank's slices of the pretrained weights, before
        load_weights(model, None if cfg.eager else step_fn,  # zero1 copies them to shards
                     progress=progress and rank == 0)
    params = list(model.parameters() if cfg.eager else step_fn.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.95))
    named = dict(model.named_parameters() if cfg.eager else step_fn.named_parameters())
    checkpoints, start_step = None, 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if cfg.save_every or cfg.resume or restart:
        checkpoints = RunCheckpoints(
            FlashCheckpointer.from_env(cfg.checkpoint_dir, keep=cfg.keep,
                                       run_id=run_id_for(cfg.checkpoint_dir)),
            plan, named, optimizer, batches)
        checkpoints.export_info = export_info(cfg, step_fn)  # for `mxgraph export`
    if cfg.resume or restart:  # a restarted worker resumes by itself
        try:
            start_step = checkpoints.resume(restart, started)
        except UserError:  # a checkpoint of another model or plan: nothing to keep for
            checkpoints.checkpointer.close()
            raise
    if cfg.save_every and start_step == 0:  # the initial state: what a NaN before the
        checkpoints.save(0, {}, background=False)  # first save rolls back (or resumes) to
    metrics = RunMetrics.for_run(cfg, step_fn, flops_per_token, moe, rank, start_step,
                                 evaluate=lambda: evaluate(step_fn, val_tokens, cfg, data))
    loop = _Loop(cfg, step_fn, optimizer, batches, guard, monitor, checkpoints, rank, metrics)
    try:
        loop.run(start_step, progress)
    except NonFiniteError as error:
        where = "no checkpoint is taken without --save-every"
        if checkpoints is not None:
            checkpoints.checkpointer.close()
            where = checkpoints.last_good()
        raise NonFiniteError(f"{error}; {where}") from None
    finally:
        metrics.close()
    if checkpoints is not None:
        checkpoints.checkpointer.close()
    if not cfg.eager:
        step_fn.sync_parameters()  # zero1: the last update is still in the shards
    val_loss = evaluate(step_fn, val_tokens, cfg, data)
    held = model.named_parameters() if cfg.eager else step_fn.model_parameters()
    tokens_per_s = max(1, loop.iterations) * cfg.batch_size * cfg.seq_len / max(
        1e-9, loop.seconds - metrics.eval_seconds)  # periodic validation left out
    return {"train_loss": loop.loss, "val_loss": val_loss, "seconds": loop.seconds,
            "tokens_per_s": tokens_per_s, "mfu": metrics.mfu(tokens_per_s),
            "start_step": start_step, "skipped": loop.count("skip"),
            "rollbacks": loop.count("rollback"), "parameters": dict(held),
            "optimized": dict(named)}


def nonfinite_guard(cfg: TrainConfig) -> Guard:
    """The run's non-finite policy (`runtime/health.py`) from `cfg`'s --on-nonfinite,
    --max-skips and --loss-spike flags; UserError for a bad one."""
    if cfg.on_nonfinite == "rollback" and not cfg.save_every:
        raise UserError("--on-nonfinite rollback reloads the newest snapshot: set --save-every "
                        "N (steps between snapshots)")
    return Guard(cfg.on_nonfinite, max_skips=cfg.max_skips, spike_factor=cfg.loss_spike,
                 spike_window=cfg.loss_spike_window)


class _Loop:
    """The steps of `train`: `--steps` optimizer updates, however many batches the
    non-finite policy skips or rolls back on the way."""

    def __init__(self, cfg: TrainConfig, step_fn, optimizer, batches: Batches, guard: Guard,
                 monitor: StepMonitor, checkpoints: RunCheckpoints | None, rank: int,
                 metrics: RunMetrics):
        self.cfg, self.step_fn, self.optimizer, self.batches = cfg, step_fn, optimizer, batches
        self.monitor, self.checkpoints, self.rank = monitor, checkpoints, rank
        self.metrics = metrics
        """--log-dir records and --eval-every validation, after an applied step."""
        self.eager = isinstance(step_fn, torch.nn.Module)
        self.guard = guard
        """The policy (a compiled step holds it too: `Step.check_health`)."""
        self.drill = Drill.from_env()
        self.loss, self.seconds, self.iterations = float("nan"), 0.0, 0

    def count(self, action: str) -> int:
        return sum(event.action == action for event in self.guard.events)

    def run(self, start_step: int, progress: bool) -> None:
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=start_step, disable=not progress or self.rank != 0,
                   unit="step", dynamic_ncols=True)
        profiler = step_profiler(cfg, self.rank, num_steps=cfg.steps - start_step)
        start, update = time.perf_counter(), start_step
        with bar:
            update = self.steps(update, bar, start, profiler)
        if profiler is not None:
            profiler.stop()  # writes the trace if the last recorded step was not the schedule's
        self.seconds = time.perf_counter() - start

    def steps(self, update: int, bar, start: float, profiler) -> int:
        cfg = self.cfg
        while update < cfg.steps:
            verdict = self.one_step(update)
            self.iterations += 1
            self.monitor.step()  # every --monitor-every steps: compare ranks, report slow ones
            if verdict.action == "rollback":
                update = self.checkpoints.rollback(verdict)
                bar.n = update
                bar.refresh()
            elif verdict.action == "update":
                update += 1
                self.loss = verdict.loss
                bar.update(1)
                bar.set_postfix(self.postfix(time.perf_counter() - start))
                self.metrics.after_update(update, verdict, self.iterations, lr_at(update - 1, cfg),
                                          lambda: self.step_fn.moe_stats()["dropped"])
                if cfg.save_every and update % cfg.save_every == 0:
                    self.save(update, verdict)
            if profiler is not None:
                profiler.step()
        return update

    def one_step(self, update: int) -> Verdict:
        """Forward, backward, clipping and the verdict on optimizer step `update`; the
        update itself when healthy."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(update, self.cfg)
        with self.monitor.section("data"):
            while self.batches.step in self.drill.drop:
                self.batches.next()
            batch = self.batches.step
            inputs, targets = self.batches.next()
        if self.eager:
            with self.monitor.section("forward_backward"):
                loss = self.step_fn(inputs, targets)
                loss.backward()
        else:  # the compiled step times its own sections
            loss = self.step_fn(inputs, targets)
        self.drill.inject(batch, self.gradients)  # listed only when a drill writes
        if self.checkpoints is not None:  # a background save's copy ends before the update
            with self.monitor.section("checkpoint"):
                self.checkpoints.checkpointer.wait_copied()
        with self.monitor.section("optimizer"):
            if self.eager:  # torch's clip_grad_norm_ in two halves: NaN spares the grads
                grads = [p.grad for p in self.step_fn.parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
                verdict = self.guard.check(update, loss, norm,
                                           lambda: locate(self.gradients(), None))
                if verdict.action == "update":
                    torch.nn.utils.clip_grads_with_norm_(self.step_fn.parameters(), 1.0, norm)
            else:  # the norm of the whole model's gradient, over every rank
                norm = self.step_fn.clip_grad_norm_(1.0)
                verdict = self.step_fn.check_health(loss, norm, update)
            if verdict.action == "update":
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return verdict

    def gradients(self) -> list[tuple[str, torch.Tensor]]:
        """(name, this rank's gradient or its part), in the model's parameter order."""
        if self.eager:
            return [(n, p.grad) for n, p in self.step_fn.named_parameters() if p.grad is not None]
        return [(name, grad) for name, grad, _ in named_gradient_pieces(self.step_fn)]

    def postfix(self, elapsed: float) -> dict:
        cfg = self.cfg
        tokens_per_s = self.iterations * cfg.batch_size * cfg.seq_len / elapsed
        postfix = dict(loss=f"{self.loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        skipped = len(self.guard.events)
        if skipped:
            postfix["not_applied"] = str(skipped)
        if not self.eager and self.step_fn.plan.moe.capacity_factor is not None:
            dropped = self.step_fn.moe_stats()["dropped"]  # per MoE layer; the bar: the mean
            postfix["dropped"] = f"{sum(dropped.values()) / max(1, len(dropped)):.1%}"
            log.debug("dropped by capacity %s", dropped)
        return postfix

    def save(self, update: int, verdict: Verdict) -> None:
        with self.monitor.section("checkpoint"):  # copied behind the next step
            result = self.checkpoints.save(update, {"loss": verdict.loss,
                                                    "grad_norm": verdict.grad_norm})
        if result is not None:
            log.info("checkpoint at step %d: %s (%.3f s blocking)", update, result.status,
                     result.blocking_s)


def release_other_stages(model: torch.nn.Module, step_fn) -> None:
    """With pp > 1 a rank runs only its stages: the model built here still holds every
    stage's parameters, so give the others' a zero-stride view of one element each (shape,
    dtype and device kept, for a later trace; no memory). This rank never reads their values."""
    held = {id(p) for _, p in step_fn.model_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in held:
                param.data = param.data.new_empty(()).expand(param.shape)


def slow_node_monitor(cfg: TrainConfig, step_fn, rank: int) -> StepMonitor:
    """The run's slow-node monitor at `cfg.monitor_level`, attached to the compiled step
    (which then times its forward+backward, gradient sync and, at level 1, its layers and
    collectives); an eager model's layers are timed by module hooks at level 1."""
    if rank == 0 and os.path.dirname(cfg.monitor_json):
        os.makedirs(os.path.dirname(cfg.monitor_json), exist_ok=True)
    monitor = StepMonitor(config=MonitorConfig(level=cfg.monitor_level,
                                               report_every=cfg.monitor_every),
                          json_path=cfg.monitor_json)
    if cfg.eager:
        if cfg.monitor_level >= 1:
            monitor.instrument_layers(step_fn)
    else:
        step_fn.set_monitor(monitor)
    return monitor


def step_profiler(cfg: TrainConfig, rank: int, num_steps: int):
    """A started torch.profiler.profile whose schedule skips 2 warm-up steps and records
    `cfg.profile_steps`, writing `cfg.profile`/rank{rank}.json; None without --profile."""
    if not cfg.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule
    os.makedirs(cfg.profile, exist_ok=True)
    path = os.path.join(cfg.profile, f"rank{rank}.json")
    activities = [ProfilerActivity.CPU]
    if detect().torch_device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    recorded = None if num_steps < 3 else schedule(
        skip_first=1, wait=0, warmup=1, active=max(1, min(cfg.profile_steps, num_steps - 2)),
        repeat=1)

    def write(prof) -> None:
        prof.export_chrome_trace(path)
        log.info("profiler trace: %s", path)
    profiler = profile(activities=activities, schedule=recorded, on_trace_ready=write)
    profiler.start()
    return profiler


def evaluate(step_or_model, val_tokens: np.ndarray, cfg: TrainConfig, data: TrainingData
             ) -> float:
    """Mean loss (nats per token) over `cfg.val_batches` fixed validation batches (`data`'s
    loader: the first of `PackedBatches`' order for packed documents, else random windows),
    in eval mode without gradients: an eager model itself, a compiled step through its own
    forward-only compile (`eval_loss`: every layout, on the step's own parameters)."""
    batches = data.batches(val_tokens, cfg.batch_size, cfg.seq_len, seed=12345)
    if isinstance(step_or_model, torch.nn.Module):
        model = step_or_model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            losses = [model(*batches.next()).item() for _ in range(cfg.val_batches)]
        model.train(was_training)
        return float(np.mean(losses))
    return float(np.mean([step_or_model.eval_loss(*batches.next()).item()
                          for _ in range(cfg.val_batches)]))
