#!/usr/bin/env bash
# The prepared GPU check: one command, about 8 minutes on one GPU (H100/H200/MetaX C500 class).
#
#   benchmarks/gpu_check.sh [OUT_DIR]          on a GPU: LLM shapes and llama-1b-class steps
#   benchmarks/gpu_check.sh --tiny [OUT_DIR]   on the CPU: tiny sizes (the test suite runs this)
#
# 1. Every fused kernel (Triton on the GPU) against its eager reference (err: the largest
#    relative error of its outputs and gradients; WRONG past the tolerance, and the script
#    fails) and against torch.compile of that reference (Inductor), with the achieved
#    fraction of the measured device-copy bandwidth: benchmarks/bench_kernels.py (~2 min).
# 2. llama-1b training steps (the TinyLlama-1.1B layer shapes, GPU_CHECK_LAYERS=4 of its 22
#    layers so that each runner compiles in seconds; forward + backward, bf16, one GPU) for
#    eager, torch.compile, the mxmaca backend, and mx.compile with Python and with Inductor
#    codegen, fusion off and on: step ms, tokens/s, MFU, compile s, peak memory, and each
#    runner's 15 most expensive kernels and kernel launches a step (--profile):
#    benchmarks/bench_compile.py (~3 min).
# 3. Auto Search on this GPU: calibrate it (--quick), predict llama-1b (2 layers) under its
#    top plan and under full recompute, train each with mxgraph train, print the errors:
#    benchmarks/bench_search_gpu.py (~3 min).
# Runs from a checkout, installed or not, on the torch the machine has (2.11 and 2.13 seen).
# Tables go to stdout, JSON to OUT_DIR (default bench_results/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=0
if [[ "${1:-}" == "--tiny" ]]; then tiny=1; shift; fi
out="${1:-bench_results/gpu_check}"
py="${PYTHON:-python}"  # the interpreter with torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mxgraph and models, installed or not
mkdir -p "$out"
"$py" -c "import torch, sys; print('torch', torch.__version__, '| GPU:',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
if [[ $tiny == 1 ]]; then
    "$py" benchmarks/bench_kernels.py --smoke --out "$out/kernels.json"
    "$py" benchmarks/bench_compile.py --models llama-tiny --runners eager,mxgraph-python,mxgraph-python-fusion \
        --steps 1 --batch-size 1 --seq-len 16 --profile 5 --out "$out/compile.json"
    exit 0
fi
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else
'gpu_check.sh: no GPU (torch.cuda.is_available() is False); run it with --tiny on the CPU')"
status=0
"$py" benchmarks/bench_kernels.py --tokens 16384 --hidden 4096 --seq 2048 --iters 10 \
    --out "$out/kernels.json" || status=$?
"$py" benchmarks/bench_compile.py --device cuda --dtype bfloat16 --models llama-1b \
    --layers "${GPU_CHECK_LAYERS:-4}" --steps 6 --batch-size "${GPU_CHECK_BATCH:-8}" --seq-len 2048 \
    --runners eager,inductor,mxmaca,mxgraph-python,mxgraph-python-fusion,mxgraph-inductor,\
mxgraph-inductor-no-auto-remat,mxgraph-inductor-fusion \
    --timeout 120 --profile 15 --out "$out/compile.json" || status=$?
"$py" benchmarks/bench_search_gpu.py --model llama-1b --layers 2 --global-batch 8 --seq-len 2048 \
    --steps 7 --warmup 3 --quick --layouts top,full --timeout 150 --out "$out/search" || status=$?
exit $status
