#!/usr/bin/env bash
# The prepared GPU check: one command, about 8 minutes on one GPU (H100/H200/MetaX C500 class).
#
#   benchmarks/gpu_check.sh [OUT_DIR]          on a GPU: LLM shapes and a ~1B Llama in bf16
#   benchmarks/gpu_check.sh --tiny [OUT_DIR]   on the CPU: tiny sizes (the test suite runs this)
#
# 1. Every fused kernel (Triton on the GPU) against its eager reference (err: the largest
#    relative error of its outputs and gradients; WRONG past the tolerance, and the script
#    fails) and against torch.compile of that reference (Inductor), with the achieved
#    fraction of the measured device-copy bandwidth: benchmarks/bench_kernels.py.
# 2. llama-1b training steps (forward + backward, bf16, one GPU) for eager, torch.compile,
#    the mxmaca backend, and mx.compile with Python and with Inductor codegen, fusion off
#    and on: step ms, tokens/s, compile s, peak memory: benchmarks/bench_compile.py.
# Tables go to stdout, JSON to OUT_DIR (default bench_results/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=0
if [[ "${1:-}" == "--tiny" ]]; then tiny=1; shift; fi
out="${1:-bench_results/gpu_check}"
py="${PYTHON:-python}"  # the interpreter with torch and mxgraph
mkdir -p "$out"
"$py" -c "import torch, sys; print('torch', torch.__version__, '| GPU:',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
if [[ $tiny == 1 ]]; then
    "$py" benchmarks/bench_kernels.py --smoke --out "$out/kernels.json"
    "$py" benchmarks/bench_compile.py --models llama-tiny --runners eager,mxgraph-python,mxgraph-python-fusion \
        --steps 1 --batch-size 1 --seq-len 16 --out "$out/compile.json"
    exit 0
fi
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else
'gpu_check.sh: no GPU (torch.cuda.is_available() is False); run it with --tiny on the CPU')"
"$py" benchmarks/bench_kernels.py --tokens 16384 --hidden 4096 --seq 2048 --iters 10 \
    --out "$out/kernels.json"
"$py" benchmarks/bench_compile.py --device cuda --dtype bfloat16 --models llama-1b --steps 8 \
    --batch-size "${GPU_CHECK_BATCH:-8}" --seq-len 2048 \
    --runners eager,inductor,mxmaca,mxgraph-python,mxgraph-python-fusion,mxgraph-inductor,mxgraph-inductor-fusion \
    --out "$out/compile.json"
