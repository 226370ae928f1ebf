"""`mxgraph train`: train a preset model with a compiled step on built-in or given data."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import mxgraph
from mxgraph.data import Batches, load_tokens, split
from mxgraph.plan import Plan


@dataclass(kw_only=True)
class TrainConfig:
    """What `mxgraph train` runs; each field is a CLI flag of the same name."""

    model: str = "llama-tiny"
    """Model preset (see `models.list_presets()`)."""
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train and return {"train_loss", "val_loss", "tokens_per_s", "seconds"}."""
    import models

    seed_everything(cfg.seed)
    plan = Plan.from_toml(cfg.plan) if cfg.plan else Plan()
    model = models.build_model(cfg.model, dtype=getattr(torch, cfg.dtype))
    vocab = model.config.vocab_size
    tokens = load_tokens(cfg.data)
    if int(tokens.max()) >= vocab:
        raise ValueError(f"data has token id {int(tokens.max())} but {cfg.model} has "
                         f"vocab_size={vocab}; choose a model with a larger vocabulary")
    train_tokens, val_tokens = split(tokens)
    batches = Batches(train_tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    step_fn = model if cfg.eager else mxgraph.compile(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), disable=not progress, unit="step", dynamic_ncols=True)
    loss_value = float("nan")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, targets = batches.next()
        loss = step_fn(inputs, targets)
        if cfg.eager:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{loss_value:.3f}",
                        tok_s=f"{(step + 1) * cfg.batch_size * cfg.seq_len / elapsed:,.0f}")
    seconds = time.perf_counter() - start
    val_loss = evaluate(model, val_tokens, cfg)
    return {"train_loss": loss_value, "val_loss": val_loss, "seconds": seconds,
            "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len / seconds}


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_tokens: np.ndarray, cfg: TrainConfig) -> float:
    """Mean loss (nats per token) over `cfg.val_batches` fixed validation batches."""
    was_training = model.training
    model.eval()
    batches = Batches(val_tokens, cfg.batch_size, cfg.seq_len, seed=12345)
    losses = [model(*batches.next()).item() for _ in range(cfg.val_batches)]
    model.train(was_training)
    return float(np.mean(losses))
