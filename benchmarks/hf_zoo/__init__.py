"""The Hugging Face causal-LM zoo sweep of benchmarks/bench_hf_zoo.py: `shrink` (tiny
configs by attribute name), `cells` (one model under one plan vs eager), `launch` (worker
processes with time limits, gloo ranks), `report` (the Markdown table)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # fused kernels on CPU tensors: Triton's interpreter,
# switched on before anything imports triton (as tests/conftest.py does)
