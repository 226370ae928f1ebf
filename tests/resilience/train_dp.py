"""Data-parallel llama-tiny training with flash checkpoints; run under torchrun (gloo).

Seeded data from the global torch RNG (so RNG restore matters), gradient all_reduce by
hand. `--kill-at K`: on the first attempt rank 1 SIGKILLs itself before step K's
all_reduce (with `--kill-saver`, rank 0 first waits for a committed disk checkpoint and
SIGKILLs the node's saver). Rank 0 writes the final state_dict to `--out` and every
restore to `--events` (one JSON line per rank and attempt).
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import models  # noqa: E402
from mxgraph.runtime.checkpoint import disk as checkpoint_disk  # noqa: E402
from mxgraph.runtime.checkpoint import saver  # noqa: E402
from mxgraph.runtime.checkpoint.flash import (  # noqa: E402
    FlashCheckpointer,
    apply_training_state,
    capture_training_state,
    default_run_id,
    init_restartable_process_group,
)


def wait_for(cond, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-saver", action="store_true")
    p.add_argument("--persist-every", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--events", required=True)
    args = p.parse_args()

    init_restartable_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = models.build_model("llama-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    torch.manual_seed(1234 + rank)  # data stream differs per rank

    run_id = default_run_id()
    ckpt = FlashCheckpointer.from_env(args.ckpt_dir, keep=2, persist_every=args.persist_every,
                                      linger_s=20.0)
    start = 0
    restored = ckpt.restore(into=capture_training_state(model, opt, sched))
    if restored is not None:
        start = apply_training_state(restored.state, model, opt, sched)
    with open(args.events, "a") as f:
        f.write(json.dumps({"rank": rank, "attempt": attempt, "start": start,
                            "source": ckpt.restore_info.source,
                            "skipped": ckpt.restore_info.skipped}) + "\n")

    for step in range(start, args.steps):
        tokens = torch.randint(0, 256, (2, 32))
        targets = torch.roll(tokens, -1, dims=1)
        loss = model(tokens, targets)
        loss.backward()
        if step == args.kill_at and attempt == 0:
            if args.kill_saver and rank == 0:
                wait_for(lambda: any(checkpoint_disk.is_committed(p)
                                     for _, p in checkpoint_disk.list_steps(args.ckpt_dir)))
                os.kill(saver.saver_pid(run_id), signal.SIGKILL)
                wait_for(lambda: saver.saver_pid(run_id) is None)
            dist.barrier()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        ckpt.save(done, capture_training_state(model, opt, sched, done, {"dp": world}),
                  persist=done % args.persist_every == 0 or done == args.steps)
    ckpt.close()
    if rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
