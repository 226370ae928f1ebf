"""Failure drill: run `mxgraph train` and SIGKILL its workers and its saver along the way.

    result = run_drill(train_args, kills=[Kill("worker", after_checkpoint=5), ...],
                       run_id="drill-1", seed=0)

Each `Kill` fires once, in order, a random 0-`jitter_s` seconds after the log first reports
a checkpoint (taken or skipped) of step `after_checkpoint` or later (so at a random step
after it; a kill after a worker's waits for the restart's log line, and for a later
checkpoint if its victim is not alive then): "worker"
SIGKILLs a random worker of the torchrun agent, "saver" the node's saver process. The
result holds the exit status, the whole output, the kills done (with the step they
followed) and the time each restart reported lost. Also a script:

    python tests/resilience/drill.py --steps 200 --nproc 4 -- [more mxgraph train flags]
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKPOINT = re.compile(r"checkpoint at step (\d+): (\w+)")  # copied, copying, skipped, failed
RESTART = re.compile(r"restart (\d+) \(at most \d+\): (?:resumed at step (\d+) from (\w+).*?; "
                     r"([\d.]+) s of training lost|(nothing to resume))")


@dataclasses.dataclass
class Kill:
    target: str  # "worker" | "saver"
    after_checkpoint: int


@dataclasses.dataclass
class DrillResult:
    returncode: int
    output: str
    killed: list[tuple[str, int, int]]  # (target, pid, the checkpoint step it followed)
    restarts: list[tuple[int, int, str, float]]  # (restart, resumed step, source, lost s);
    # source "none", step 0 and lost nan: killed before any snapshot every rank completed
    seconds: float


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def assert_clean(run_id: str, checkpoint_dir: str) -> None:
    """After a run: no shared-memory segment of `run_id` and no process whose command line
    names `checkpoint_dir` (workers, agents, the saver) is left."""
    from mxgraph.runtime.checkpoint.shm import segment_prefix
    assert not glob.glob(f"/dev/shm/{segment_prefix(run_id)}*"), "shared memory left behind"
    assert not processes_mentioning(checkpoint_dir), "a process of the run is still alive"


def _victim(target: str, top: int, run_id: str, rng: random.Random) -> int | None:
    if target == "saver":
        pids = processes_mentioning(f"mxgraph.runtime.checkpoint.saver --run-id {run_id} ")
        return pids[0] if pids else None
    agents = children(top)
    workers = [w for a in agents for w in children(a)]
    return rng.choice(sorted(workers)) if workers else None


def run_drill(train_args: list[str], *, kills: list[Kill], run_id: str, seed: int = 0,
              jitter_s: float = 0.3, timeout_s: float = 600) -> DrillResult:
    """Run `mxgraph train *train_args` (with MXGRAPH_RUN_ID=run_id), doing `kills`."""
    rng = random.Random(seed)
    env = dict(os.environ, MXGRAPH_RUN_ID=run_id, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "mxgraph.cli", "train", *train_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, killed, pending = [], [], list(kills)
    restarting = False  # a worker was killed, its attempt's restart not yet logged
    timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            restarting = restarting and not RESTART.search(line)
            match = CHECKPOINT.search(line)
            # at or after: a checkpoint right after a saver's death may be skipped or
            # logged past the step a kill waits for, and the later kills must still fire;
            # not on the lines the killed attempt wrote before it died (fast steps log
            # several checkpoints within a kill's delay): each kill hits a running attempt
            if restarting or not (match and pending
                                  and int(match.group(1)) >= pending[0].after_checkpoint):
                continue
            kill = pending[0]
            time.sleep(rng.uniform(0, jitter_s))
            pid = _victim(kill.target, proc.pid, run_id, rng)
            if pid is None:  # none alive now (workers or saver starting): the next checkpoint
                continue
            pending.pop(0)
            os.kill(pid, signal.SIGKILL)
            killed.append((kill.target, pid, kill.after_checkpoint))
            restarting = kill.target == "worker"
        proc.wait()
    finally:
        timer.cancel()
    output = "".join(lines)
    restarts = [(int(m.group(1)), 0, "none", float("nan")) if m.group(5) else
                (int(m.group(1)), int(m.group(2)), m.group(3), float(m.group(4)))
                for m in RESTART.finditer(output)]
    return DrillResult(proc.returncode, output, killed, restarts, time.perf_counter() - t0)


def same_final_state(dir_a: str, dir_b: str, step: int) -> bool:
    """Whether the committed checkpoints of `step` in two directories hold equal model and
    optimizer tensors (torch.equal)."""
    import torch

    sys.path.insert(0, REPO)
    from mxgraph.runtime.checkpoint import disk
    a, b = (disk.load(disk.step_dir(d, step), source_rank=0) for d in (dir_a, dir_b))
    same = a["model"].keys() == b["model"].keys() and all(
        torch.equal(t, b["model"][k]) for k, t in a["model"].items())
    return same and all(torch.equal(v, b["optimizer"]["state"][i][k])
                        for i, moments in a["optimizer"]["state"].items()
                        for k, v in moments.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="runs/drill")
    p.add_argument("extra", nargs="*", help="more mxgraph train flags (after --)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    points = sorted(rng.sample(range(args.save_every, args.steps - args.save_every,
                                    args.save_every), 4))
    kills = [Kill("worker", points[0]), Kill("saver", points[1]), Kill("worker", points[2]),
             Kill("worker", points[3])]
    common = ["--nproc", str(args.nproc), "--steps", str(args.steps), "--save-every",
              str(args.save_every), "--no-progress", *args.extra]
    train_args = [*common, "--max-restarts", "5", "--checkpoint-dir", args.checkpoint_dir]
    ref_args = [*common, "--checkpoint-dir", args.checkpoint_dir + "-reference"]
    reference = run_drill(ref_args, kills=[], run_id=f"reference-{os.getpid()}")
    print(f"uninterrupted run: exit status {reference.returncode}, {reference.seconds:.1f} s")
    result = run_drill(train_args, kills=kills, run_id=f"drill-{os.getpid()}", seed=args.seed)
    print(result.output[-3000:])
    if args.steps % args.save_every == 0 and reference.returncode == result.returncode == 0:
        print("final parameters and optimizer state bitwise equal to the uninterrupted run:",
              same_final_state(args.checkpoint_dir + "-reference", args.checkpoint_dir, args.steps))
    for target, pid, after in result.killed:
        print(f"killed {target} pid {pid} after the checkpoint of step {after}")
    for restart, step, source, lost in result.restarts:
        print(f"restart {restart}: resumed at step {step} from {source}, {lost:.1f} s lost")
    print(f"exit status {result.returncode}, {result.seconds:.1f} s in all")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
