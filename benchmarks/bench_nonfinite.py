"""Overhead of non-finite detection (`Step.check_health`) on a training step, side by side.

Three compiled steps of the same model (same seed), each with its own AdamW, run the loop
of `mxgraph train` in turn:

* `off`: step, `clip_grad_norm_`, optimizer step, `zero_grad`, then `loss.item()` (the
  loop's one host sync before detection existed);
* `off_again`: the same, a second time: its 'overhead' is the noise floor;
* `guard`: step, `clip_grad_norm_`, `check_health(loss, norm)` (the host sync moved before
  the update, the loss and norm read together), then the update when healthy.

Rounds run `--steps-per-round` steps of each variant in turn, rotating the order, so drift
on a shared machine hits all alike. Overhead = the median step time over `off`'s, minus 1.
The guard's own time (`self`) is timed around `check_health` alone.

    python benchmarks/bench_nonfinite.py [--model llama-20m] [--batch-size 4] [--seq-len 256]
        [--rounds 6] [--steps-per-round 4] [--out bench_results/nonfinite.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import models
import mxgraph as mx

VARIANTS = ("off", "off_again", "guard")


class Variant:
    def __init__(self, name: str, args):
        torch.manual_seed(0)
        self.name = name
        model = models.build_model(args.model)
        self.step = mx.compile(model, mx.Plan())
        self.optimizer = torch.optim.AdamW(self.step.parameters(), lr=1e-4)
        self.times: list[float] = []
        self.self_times: list[float] = []
        self.index = 0

    def run(self, batch) -> None:
        started = time.perf_counter()
        loss = self.step(*batch)
        norm = self.step.clip_grad_norm_(1.0)
        if self.name == "guard":
            checked = time.perf_counter()
            verdict = self.step.check_health(loss, norm, self.index)
            self.self_times.append(time.perf_counter() - checked)
            if verdict.action == "update":
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()
        self.times.append(time.perf_counter() - started)
        self.index += 1


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-20m")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--out", default="bench_results/nonfinite.json")
    args = parser.parse_args(argv)
    vocab = models.preset_config(args.model).vocab_size
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=generator)
    batch = (tokens[:, :-1], tokens[:, 1:])
    variants = [Variant(name, args) for name in VARIANTS]
    for variant in variants:  # compile and warm up (the first steps allocate)
        for _ in range(2):
            variant.run(batch)
        variant.times.clear()
        variant.self_times.clear()
    for r in range(args.rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            for _ in range(args.steps_per_round):
                variant.run(batch)
    base = statistics.median(variants[0].times)
    rows = []
    print(f"{args.model}, batch {args.batch_size} x {args.seq_len}, "
          f"{args.rounds} rounds x {args.steps_per_round} steps, median step")
    print(f"{'variant':<10} {'step ms':>9} {'overhead':>9} {'self ms':>8}")
    for variant in variants:
        median = statistics.median(variant.times)
        own = statistics.median(variant.self_times) * 1e3 if variant.self_times else 0.0
        rows.append({"variant": variant.name, "step_ms": median * 1e3,
                     "overhead": median / base - 1, "self_ms": own,
                     "steps": len(variant.times)})
        print(f"{variant.name:<10} {median * 1e3:>9.1f} {median / base - 1:>+9.2%} {own:>8.3f}")
    result = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
