"""Training precision side by side: fp32, bf16-mixed and pure bf16 on the same run.

For each precision, `mxgraph train` (the library call, same seed, data and schedule) runs
`--steps` steps of `--model` on the built-in text; the table gives the final train loss
(the mean over the last tenth of the steps, read from the run's metrics.jsonl: one batch's
loss alone moves by several percent from step to step), the validation loss, and each
one's relative difference from fp32 (bf16-mixed's target: within 1%).

Memory: a compiled step of the same model in each precision takes one step and one AdamW
update. "state" is the bytes of the tensors then held for training, counted tensor by
tensor (`numel * element_size`): the parameters the step runs on, their gradients as kept
for the optimizer (bf16-mixed: the masters' fp32 ones), the fp32 master weights, and
AdamW's exp_avg and exp_avg_sq; its "est" is `memory_plan.estimate_memory`'s params +
grads + optimizer. "peak" is the step's measured peak: the state held at the start of a
second step (gradients freed by `zero_grad`) plus the peak of the CPU allocator's running
total during that step (forward, backward, clip and AdamW; torch.profiler's memory
events); its "est" is the estimate's device total (params + grads + optimizer +
activations + transient, math attention as the CPU runs it). Target: within 10%.

    python benchmarks/bench_precision.py [--model llama-20m] [--steps 200] [--batch-size 2]
        [--seq-len 32] [--val-batches 20] [--threads 1] [--out bench_results/precision.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import models
import mxgraph as mx
from mxgraph.memory_plan import estimate_memory
from mxgraph.train.loop import TrainConfig, train

sys.path.insert(0, str(Path(__file__).resolve().parent))  # search_worker, when imported

PRECISIONS = ("fp32", "bf16-mixed", "bf16")


def state_bytes(step, optimizer) -> dict[str, int]:
    """Bytes of the training state a compiled step and its optimizer hold now (see the
    module docstring): parameters, gradients, masters, AdamW moments, step counters."""
    def size(t):
        return t.numel() * t.element_size()
    model_params = [p for _, p in step.model_parameters()]
    updated = list(step.parameters())
    mixed = step.master_weights is not None
    grads = [p.grad for p in (updated if mixed else model_params) if p.grad is not None]
    moments = [t for state in optimizer.state.values() for key, t in state.items()
               if key in ("exp_avg", "exp_avg_sq")]
    counters = [t for state in optimizer.state.values() for key, t in state.items()
                if key == "step"]
    return {"params": sum(map(size, model_params)), "grads": sum(map(size, grads)),
            "master": sum(map(size, updated)) if mixed else 0,
            "optimizer": sum(map(size, moments)), "step_counters": sum(map(size, counters))}


def measure_memory(model_name: str, precision: str, batch_size: int, seq_len: int) -> dict:
    """One compiled step of `model_name` in `precision`: the training state it holds
    (`state_bytes`) and its measured peak - the state held at a step's start plus the CPU
    allocator's peak during that step (forward, backward, clip, AdamW), from torch.profiler's
    memory events - beside `estimate_memory`'s (math attention, as the CPU runs it)."""
    torch.manual_seed(0)
    model = models.build_model(model_name)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    step = mx.compile(model, mx.Plan(precision=precision), example=batch)
    del model
    optimizer = torch.optim.AdamW(step.parameters(), lr=1e-4)

    def one_step():
        step(*batch)
        step.clip_grad_norm_(1.0)
        optimizer.step()

    one_step()  # compiles, and AdamW's state exists from here
    held = state_bytes(step, optimizer)
    optimizer.zero_grad()
    gc.collect()
    start = state_bytes(step, optimizer)  # no gradients: zero_grad freed them
    peak = sum(start.values()) + step_peak(one_step)
    stage, = estimate_memory(model_name, mx.Plan(precision=precision), batch_size=batch_size,
                             seq_len=seq_len, flash_attention=False)
    state = stage.params + stage.grads + stage.optimizer
    measured_state = held["params"] + held["grads"] + held["master"] + held["optimizer"]
    return {"measured_bytes": measured_state, "estimate_bytes": state,
            "estimate_error": state / measured_state - 1, "held": held,
            "peak_bytes": peak, "peak_estimate_bytes": stage.device_total,
            "peak_estimate_error": stage.device_total / peak - 1,
            "estimate": {"params": stage.params, "grads": stage.grads,
                         "optimizer_and_master": stage.optimizer,
                         "activations": stage.activations, "transient": stage.transient}}


def step_peak(fn) -> int:
    """Peak of the CPU allocator's running total while `fn()` runs, above its start (bytes;
    torch.profiler `profile_memory`, read by `search_worker.profile_peak`)."""
    from search_worker import profile_peak
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return profile_peak(prof)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-20m")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (on a shared 2-core machine 2 threads spin against "
                        "the other jobs: 21 s a step instead of 0.5)")
    parser.add_argument("--out", default="bench_results/precision.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for precision in PRECISIONS:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as log_dir:
            cfg = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size,
                              seq_len=args.seq_len, warmup=min(50, args.steps // 4),
                              val_batches=args.val_batches, precision=precision,
                              monitor_json="/dev/null", log_dir=log_dir, log_every=1,
                              report_to="jsonl")
            result = train(cfg, progress=True)  # the bar on stderr
            with open(Path(log_dir) / "metrics.jsonl") as f:
                losses = [json.loads(line)["loss"] for line in f]
        tail = losses[-max(1, len(losses) // 10):]
        row = {"precision": precision, "train_loss": sum(tail) / len(tail),
               "last_step_loss": result["train_loss"], "val_loss": result["val_loss"],
               "train_s": time.perf_counter() - started}
        row.update(measure_memory(args.model, precision, args.batch_size, args.seq_len))
        rows.append(row)
        print(f"{precision}: done in {row['train_s']:.0f} s", flush=True)
    fp32 = rows[0]
    for row in rows:
        row["train_vs_fp32"] = row["train_loss"] / fp32["train_loss"] - 1
        row["val_vs_fp32"] = row["val_loss"] / fp32["val_loss"] - 1
    print(f"{args.model}, {args.steps} steps, batch {args.batch_size} x {args.seq_len}; "
          f"memory, MiB: the training state (params + grads + masters + AdamW) and the step's "
          f"peak, each measured beside its estimate")
    print(f"{'precision':<11} {'train':>7} {'val':>7} {'train/fp32':>10} {'val/fp32':>9} "
          f"{'state':>7} {'est':>7} {'err':>7} {'peak':>7} {'est':>7} {'err':>7} {'seconds':>8}")
    for row in rows:
        print(f"{row['precision']:<11} {row['train_loss']:>7.4f} {row['val_loss']:>7.4f} "
              f"{row['train_vs_fp32']:>+10.2%} {row['val_vs_fp32']:>+9.2%} "
              f"{row['measured_bytes'] / 2 ** 20:>7.1f} {row['estimate_bytes'] / 2 ** 20:>7.1f} "
              f"{row['estimate_error']:>+7.1%} {row['peak_bytes'] / 2 ** 20:>7.1f} "
              f"{row['peak_estimate_bytes'] / 2 ** 20:>7.1f} {row['peak_estimate_error']:>+7.1%} "
              f"{row['train_s']:>8.0f}")
    result = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
