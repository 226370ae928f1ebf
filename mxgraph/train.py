"""`mxgraph train`: train a preset or Hugging Face model with a compiled step on built-in or
given data."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import mxgraph
from mxgraph.data import Batches, load_tokens, split
from mxgraph.errors import DataError, UserError
from mxgraph.hf import build_hf_model, is_hf_spec, parse_overrides
from mxgraph.plan import Plan
from mxgraph.runtime.checkpoint.disk import saved_world_size
from mxgraph.runtime.checkpoint.flash import FlashCheckpointer
from mxgraph.runtime.checkpoint.state import apply_training_state, capture_training_state
from mxgraph.runtime.cluster.device import detect
from mxgraph.runtime.cluster.launch import init_from_environment
from mxgraph.runtime.monitor.slow_node import MonitorConfig, StepMonitor

log = logging.getLogger("mxgraph.train")


@dataclass(kw_only=True)
class TrainConfig:
    """What `mxgraph train` runs; each field is a CLI flag of the same name."""

    model: str = "llama-tiny"
    """Model preset (see `models.list_presets()`), or a Hugging Face transformers model with
    random weights: hf:<model_type> (e.g. hf:llama, hf:mixtral; the full-size defaults unless
    --model-config shrinks them) or the path of a config.json (needs pip install mxgraph[hf])."""
    model_config: str | None = None
    """Overrides of the model's config, key=value,...: fields of the preset's config (e.g.
    n_layers=2) or of the Hugging Face config (e.g. hidden_size=64,num_hidden_layers=2)."""
    plan: str | None = None
    """Plan TOML file; default = one device, no rewrites."""
    steps: int = 600
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per step (per data-parallel rank)."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate (AdamW; linear warm-up then cosine decay to lr/10)."""
    warmup: int = 50
    """Warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    data: str | None = None
    """Text file (bytes are tokens) or .npy of token ids; default = built-in stdlib text."""
    val_batches: int = 20
    """Batches averaged for the validation loss at the end."""
    seed: int = 0
    """Seed for initialisation and data order."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    eager: bool = False
    """Run the model eagerly instead of compiling (for comparison)."""
    save_every: int = 0
    """Flash-checkpoint every N steps (0 = never); see --checkpoint-dir."""
    checkpoint_dir: str = "runs/checkpoints"
    """Where committed checkpoints go (torch.distributed.checkpoint format)."""
    resume: bool = False
    """Resume from the newest intact snapshot: in memory if every rank has it, else disk."""
    keep: int = 2
    """Committed checkpoints kept on disk."""
    profile: str | None = None
    """Directory for a torch.profiler Chrome trace per rank, DIR/rank{R}.json (CPU activity;
    CUDA too on a GPU). Steps 1-2 are warm-up (the first runs allocate, the second starts
    the profiler) and are not recorded; then --profile-steps steps are (with fewer than 3
    steps: every step). Read one with mxgraph inspect --overlap DIR/rank0.json."""
    profile_steps: int = 4
    """Steps --profile records after its 2 warm-up steps."""
    monitor_level: int = 0
    """Slow-node detection on every rank: 0 times each step's data, forward+backward,
    gradient synchronisation and optimizer (ms per step); 1 also every layer's forward and
    backward and every collective (its transfer and its wait apart) inside the compiled
    step; 2 also every op (torch.profiler, slow). Each report interval the ranks compare
    their sections with the median of ranks; findings go to the log and --monitor-json."""
    monitor_every: int = 10
    """Steps per report interval; a section slow in 2 intervals in a row is reported."""
    monitor_json: str = "runs/slow_nodes.jsonl"
    """Where rank 0 appends each finding as a JSON line (step, rank, host, section, kind,
    value_ms, reference_ms, slowdown against the median of ranks)."""


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


def build_training_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model `cfg.model` names, with `cfg.model_config`'s overrides: a preset
    (`models.build_model`) or a Hugging Face model (`hf:<model_type>` or a config.json,
    `mxgraph.hf.build_hf_model`, its KV cache turned off: training throws it away). Either has
    `.config.vocab_size`."""
    import models

    dtype = getattr(torch, cfg.dtype)
    overrides = parse_overrides(cfg.model_config)
    if is_hf_spec(cfg.model):
        model = build_hf_model(cfg.model, overrides, dtype=dtype)
        model.config.use_cache = False
        return model
    return models.build_model(cfg.model, dtype=dtype, **overrides)


def _run_id(checkpoint_dir: str) -> str:
    """torchrun's run id (stable across restarts), MXGRAPH_RUN_ID, or one derived from
    the checkpoint directory, so that a re-run of the same command finds its snapshots."""
    for key in ("MXGRAPH_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(key, "none") != "none":
            return os.environ[key]
    return "ckpt-" + hashlib.sha1(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:12]


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train and return {"train_loss", "val_loss", "tokens_per_s", "seconds", "start_step"}."""
    started = time.perf_counter()
    if cfg.save_every or cfg.resume:
        check_checkpoint_dir(cfg.checkpoint_dir)
    rank = _init_distributed()
    seed_everything(cfg.seed)
    plan = Plan.from_toml(cfg.plan) if cfg.plan else Plan()
    model = build_training_model(cfg)
    vocab = model.config.vocab_size
    tokens = load_tokens(cfg.data)
    if int(tokens.max()) >= vocab:
        raise DataError(f"data has token id {int(tokens.max())} but {cfg.model} has "
                        f"vocab_size={vocab}; choose a model with a larger vocabulary or "
                        f"set --model-config vocab_size={int(tokens.max()) + 1}")
    train_tokens, val_tokens = split(tokens)
    step_fn = model if cfg.eager else mxgraph.compile(model, plan)
    dp_rank = 0 if cfg.eager else step_fn.mesh.coords["dp"]
    batches = Batches(train_tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed + dp_rank)
    monitor = slow_node_monitor(cfg, step_fn, rank)
    if not cfg.eager:  # compile first: with pp, this rank's parameters are known after
        step_fn.prepare(*batches.peek())
    if not cfg.eager and plan.pp > 1:
        release_other_stages(model, step_fn)
    params = list(model.parameters() if cfg.eager else step_fn.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.95))
    named = dict(model.named_parameters() if cfg.eager else step_fn.named_parameters())
    checkpointer, start_step = None, 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if cfg.save_every or cfg.resume or restart:
        checkpointer = FlashCheckpointer.from_env(cfg.checkpoint_dir, keep=cfg.keep,
                                                  run_id=_run_id(cfg.checkpoint_dir))
    if cfg.resume or restart:  # a restarted worker resumes by itself
        try:
            start_step = _resume(checkpointer, plan, named, optimizer, batches, restart, started)
        except UserError:  # a checkpoint of another model or plan: nothing to keep for
            checkpointer.close()
            raise
    start = time.perf_counter()
    bar = tqdm(range(start_step, cfg.steps), disable=not progress or rank != 0,
               unit="step", dynamic_ncols=True)
    loss_value = float("nan")
    profiler = step_profiler(cfg, rank, num_steps=cfg.steps - start_step)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with monitor.section("data"):
            inputs, targets = batches.next()
        if cfg.eager:
            with monitor.section("forward_backward"):
                loss = step_fn(inputs, targets)
                loss.backward()
        else:  # the compiled step times its own sections
            loss = step_fn(inputs, targets)
        if checkpointer is not None:  # a background save's copy ends before the update
            with monitor.section("checkpoint"):
                checkpointer.wait_copied()
        with monitor.section("optimizer"):
            if cfg.eager:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:  # the norm of the whole model's gradient, over every rank
                step_fn.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        monitor.step()  # every --monitor-every steps: compare ranks, report slow ones
        elapsed = time.perf_counter() - start
        tokens_per_s = (step + 1 - start_step) * cfg.batch_size * cfg.seq_len / elapsed
        postfix = dict(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        if not cfg.eager and plan.moe.capacity_factor is not None:
            dropped = step_fn.moe_stats()["dropped"]  # per MoE layer; the bar shows the mean
            postfix["dropped"] = f"{sum(dropped.values()) / max(1, len(dropped)):.1%}"
            log.debug("step %d: dropped by capacity %s", step + 1, dropped)
        bar.set_postfix(postfix)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            with monitor.section("checkpoint"):  # copied behind the next step
                result = checkpointer.save(step + 1, _capture(
                    plan, named, optimizer, batches.state_dict(), plan.to_dict()), background=True)
            log.info("checkpoint at step %d: %s (%.3f s blocking)", step + 1,
                     result.status, result.blocking_s)
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()  # writes the trace if the last recorded step was not the schedule's
    seconds = time.perf_counter() - start
    if checkpointer is not None:
        checkpointer.close()
    if not cfg.eager:
        step_fn.sync_parameters()  # zero1: the last update is still in the shards
    val_loss = evaluate(step_fn, val_tokens, cfg)
    done = max(1, cfg.steps - start_step)
    return {"train_loss": loss_value, "val_loss": val_loss, "seconds": seconds,
            "tokens_per_s": done * cfg.batch_size * cfg.seq_len / seconds,
            "start_step": start_step}


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


def check_checkpoint_dir(path: str) -> None:
    """UserError unless `path` is (or can be made) a directory this process can write: a
    bad --checkpoint-dir fails at start, not at the first save."""
    probe = os.path.join(path, f".mxgraph-write-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as error:
        raise UserError(f"--checkpoint-dir {path} is not a writable directory "
                        f"({error.strerror or error}); choose a directory you can write") from None


def _resume(checkpointer: FlashCheckpointer, plan: Plan, named: dict, optimizer, batches,
            restart: int, started: float) -> int:
    """Restore the newest snapshot (memory if every rank holds it, else disk) into the
    live parameters, optimizer and data position; returns the step to start at (0 when
    there is nothing to resume). Rank 0 logs where it came from and, after a restart
    (`restart` = torchrun's restart count), how long the failure cost."""
    restored = checkpointer.restore(into=_capture(plan, named, optimizer))
    info = checkpointer.restore_info
    rank = checkpointer.rank
    prefix = f"restart {restart} (at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}): " \
        if restart else ""
    if restored is None:
        if rank == 0:
            log.warning("%snothing to resume in %s (no snapshot in memory, no committed "
                        "checkpoint on disk): starting at step 0 (start-up with compile %.1f s)",
                        prefix, checkpointer.directory, time.perf_counter() - started)
        return 0
    batches.load_state_dict(_apply(restored.state, named, optimizer))
    if rank != 0:
        return restored.step
    where = "memory (every rank held it)" if info.source == "memory" else f"disk ({info.path})"
    message = f"{prefix}resumed at step {restored.step} from {where}: restore " \
        f"{info.seconds:.2f} s, start-up with compile {time.perf_counter() - started:.1f} s"
    if restart:  # the failed attempt's steps after the snapshot are redone
        lost = time.time() - restored.state.get("saved_at", time.time())
        message += f"; {lost:.1f} s of training lost to the failure (since that snapshot)"
    log.warning(message)
    if info.resharded:
        log.warning("the job runs on %d process(es) now, the checkpoint was saved on %d: data "
                    "parallelism is %d now (each step trains --batch-size sequences per "
                    "data-parallel rank)", checkpointer.world_size,
                    saved_world_size(info.path), plan.resolve_dp(checkpointer.world_size))
    return restored.step


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


def _capture(plan: Plan, named: dict, optimizer, data_position=None,
             plan_dict: dict | None = None) -> dict:
    """`capture_training_state`; when ranks hold different parameters (zero1 shards, tp/ep
    shards, pp stages) the parameters and the optimizer state go under "rank_local" (kept
    per rank on disk, instead of once for all ranks)."""
    state = capture_training_state(named, optimizer, None, data_position, plan_dict)
    state["saved_at"] = time.time()  # wall clock: a restart tells how much time it lost
    if plan.zero1 or plan.tp > 1 or plan.pp > 1 or plan.ep > 1:
        state["rank_local"]["sharded"] = {"model": state.pop("model"),
                                          "optimizer": state.pop("optimizer")}
    return state


def _apply(state: dict, named: dict, optimizer):
    """`apply_training_state` for a state from `_capture`; returns the data position."""
    if "sharded" in state["rank_local"]:
        state = {**state, **state["rank_local"]["sharded"]}
    return apply_training_state(state, named, optimizer)


def evaluate(step_or_model, val_tokens: np.ndarray, cfg: TrainConfig) -> float:
    """Mean loss (nats per token) over `cfg.val_batches` fixed validation batches, in eval
    mode without gradients: an eager model itself, a compiled step through its own
    forward-only compile (`eval_loss`: every layout, on the step's own parameters)."""
    batches = Batches(val_tokens, cfg.batch_size, cfg.seq_len, seed=12345)
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
