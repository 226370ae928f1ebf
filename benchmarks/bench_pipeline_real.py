"""Real pipeline runs on gloo: mxgraph's schedules vs torch.distributed.pipelining's.

Runs one llama preset on `--nproc` CPU processes (pp = nproc) and times training steps
of each schedule pair, side by side in one run:
    mxgraph 1f1b        vs  Schedule1F1B
    mxgraph interleaved vs  ScheduleInterleaved1F1B        (2 stages per rank)
    mxgraph zbh1        vs  ScheduleInterleavedZeroBubble  (2 stages per rank; torch has
                                                            no single-chunk ZB-H1 class)
    mxgraph dualpipev   vs  ScheduleDualPipeV              (V: stages r and 2p-1-r)
The torch side wraps the model's own layers in stage modules (embedding in the first
stage, final norm and LM head in the last, loss as its loss_fn). Reports median step
time and the throughput ratio torch_time / mxgraph_time (>1: mxgraph faster).

    python benchmarks/bench_pipeline_real.py [--model llama-20m] [--nproc 4]
        [--microbatches 8] [--batch-size 8] [--seq-len 128] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PAIRS = [("1f1b", 1, "Schedule1F1B"), ("interleaved", 2, "ScheduleInterleaved1F1B"),
         ("zbh1", 1, "ScheduleInterleavedZeroBubble"), ("dualpipev", 2, "ScheduleDualPipeV")]


class StageModule(nn.Module):
    """Layers [lo, hi) of a llama; the first stage embeds, the last normalises and
    projects to logits."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.model, self.lo, self.hi, self.first, self.last = model, lo, hi, first, last

    def forward(self, x):
        if self.first:
            x = self.model.embed(x)
        cos, sin = self.model.rope(x.shape[1])
        for layer in self.model.layers[self.lo:self.hi]:
            x = layer(x, cos, sin)
        return self.model.lm_head(self.model.norm(x)) if self.last else x


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _time(fn, steps):
    fn()  # warm-up (compiles mxgraph)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_rank(rank, world, args, results):
    import torch.distributed.pipelining as pipelining

    import models
    import mxgraph as mx
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    targets = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    for schedule, chunks, torch_name in PAIRS:
        model = models.build_model(args.model, n_layers=args.layers)
        step = mx.compile(model, mx.Plan(pp=world, vpp=chunks if schedule != "dualpipev"
                                         else 1, schedule=schedule,
                                         micro_batches=args.microbatches))

        def mx_step(step=step, model=model):
            step(tokens, targets)
            model.zero_grad(set_to_none=True)
        mx_time = _time(mx_step, args.steps)

        peer = models.build_model(args.model, n_layers=args.layers)
        num_stages = world * 2 if torch_name != "Schedule1F1B" else world
        per = args.layers // num_stages
        if torch_name == "ScheduleDualPipeV":
            mine = [rank, num_stages - 1 - rank]
        else:
            mine = [rank + k * world for k in range(num_stages // world)]
        stages = [pipelining.PipelineStage(
            StageModule(peer, s * per, (s + 1) * per, s == 0, s == num_stages - 1),
            s, num_stages, torch.device("cpu")) for s in mine]
        cls = getattr(pipelining, torch_name)
        sched = cls(stages[0] if torch_name == "Schedule1F1B" else stages,
                    n_microbatches=args.microbatches, loss_fn=_loss)

        def torch_step(mine=mine, num_stages=num_stages, sched=sched, peer=peer):
            kwargs = {}
            if 0 in mine:
                kwargs["x"] = tokens
            if num_stages - 1 in mine:
                kwargs["target"] = targets
            sched.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
            peer.zero_grad(set_to_none=True)
        torch_time = _time(torch_step, args.steps)
        if rank == 0:
            results.append({"schedule": schedule, "peer": torch_name,
                            "mxgraph_s": mx_time, "torch_s": torch_time,
                            "ratio": torch_time / mx_time})


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-20m")
    parser.add_argument("--layers", type=int, default=8, help="layers (divisible by 2*nproc)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/pipeline_real.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch.multiprocessing as mp

    from tests.distributed import run_ranks
    results = mp.get_context("spawn").Manager().list()
    run_ranks(args.nproc, run_rank, args, results)
    rows = list(results)
    print(f"{'schedule':<12} {'peer':<30} {'mxgraph s':>10} {'torch s':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['schedule']:<12} {r['peer']:<30} {r['mxgraph_s']:>10.3f} "
              f"{r['torch_s']:>10.3f} {r['ratio']:>7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
