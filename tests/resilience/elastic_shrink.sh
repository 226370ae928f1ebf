#!/usr/bin/env bash
# Elastic drill: two "nodes" (two torchrun agents on this machine, 1 worker each) train
# llama-tiny with --nnodes 1:2; after the checkpoint of step 10 (and one committed on disk) the node that does not host
# the rendezvous store is SIGKILLed with its workers (its saver is spared: it stands for the
# surviving node's). The survivor restarts on its own, resumes from disk at 1 process
# instead of 2 (dp 2 -> 1) and says so. Usage: bash tests/resilience/elastic_shrink.sh
set -u
cd "$(dirname "$0")/../.."
d=$(mktemp -d); port=$((20000 + RANDOM % 20000))
args="train --nproc 1 --nnodes 1:2 --rdzv-endpoint 127.0.0.1:$port --rdzv-id el$port --max-restarts 3
      --save-every 5 --steps 40 --model llama-tiny --batch-size 2 --seq-len 16 --val-batches 1
      --no-progress --checkpoint-dir $d/ck"
py=${PYTHON:-python}  # the environment mxgraph is installed in (an activated venv)
setsid "$py" -m mxgraph.cli $args > "$d/a.log" 2>&1 & a=$!
setsid "$py" -m mxgraph.cli $args > "$d/b.log" 2>&1 & b=$!
committed() { ls -d "$d"/ck/step_*/.metadata 2>/dev/null | grep -qv "step_000000000/"; }
# after step 10's copy and once a checkpoint past step 0 is committed on disk (on a loaded
# machine the disk writes can lag the steps: a node killed before its part of any is written
# leaves nothing to resume from)
until grep -q "checkpoint at step 10" "$d/a.log" "$d/b.log" && committed; do
  sleep 0.5
  kill -0 "$a" 2>/dev/null && kill -0 "$b" 2>/dev/null || { tail -5 "$d/a.log" "$d/b.log"; exit 1; }
done
store=$(ss -ltnp | grep ":$port " | grep -o "pid=[0-9]*" | head -1 | cut -d= -f2)
victim=$b; survivor=$a
if pgrep -P "$b" | grep -qx "$store"; then victim=$a; survivor=$b; fi
descendants() { for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
saver=$(pgrep -f "runtime.saver --run-id el$port" | tr '\n' '|'); saver=${saver%|}
kill -9 "$victim" $(descendants "$victim" | grep -Evx "${saver:-none}")
echo "killed node $victim at $(date +%T) (run id el$port, checkpoints in $d/ck)"
wait "$survivor"; echo "survivor exit status $?"
log=$d/a.log; [ "$survivor" = "$b" ] && log=$d/b.log
grep -E "mxgraph\[|train loss" "$log" | tail -12
