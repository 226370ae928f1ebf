"""Built-in device profiles, each number with its source (`DeviceProfile.sources`).

Peak FLOP/s, memory and link figures: vendor datasheets. Efficiencies: published kernel
microbenchmarks (large cuBLAS GEMMs, FlashAttention-2/3 forward+backward, STREAM-like
copies, nccl-tests bus bandwidth, compute slowed beside collectives), rounded; no number
was fitted to an end-to-end training throughput (those are used only to check, in
benchmarks/bench_search.py and bench_search_published.py). Bandwidths are
per device and direction: NVLink's "600 GB/s" (A100) is 300 GB/s each way.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import tomllib

from mxgraph.devices.profile import DeviceProfile
from mxgraph.errors import UserError

_NCCL = "nccl-tests all_reduce bus bandwidth / link bandwidth, typical of published runs"
_GEMM = "large bf16 cuBLAS GEMM microbenchmarks (share of dense peak)"
_MAMF = ("ml-engineering (stas00), compute/accelerator README, Maximum Achievable Matmul FLOPS "
         "table: the best shape's mean of 100 matmuls after 50 warm-up ones on one GPU, its "
         "neighbours idle (a burst above the rate sustained at the power limit while every "
         "GPU of a node trains, which the same book's MSMF notes put lower)")
_OVERLAP = ("Lee et al., Characterizing Compute-Communication Overlap in GPU-Accelerated "
            "Distributed Deep Learning (arXiv 2507.03114): GPT and Llama layers' kernels beside "
            "NCCL collectives on A100s and H100s run 18.9% slower on average (at most 40%) "
            "than alone; the NCCL kernels hold SMs (DeepSeek-V3 report, Sec. 3.2.2: 20 of an "
            "H800's 132 SMs, 15%, for its overlapped communication)")
_FA3_FIGURES = ("FlashAttention-3 paper (Shah et al., arXiv 2407.08608), H100 SXM5 figures, head "
                "dim 128, sequences 2k-16k: ")
_FA_FLOPS = ("; the FlashAttention papers' benchmarks count a backward as 2.5x the forward's "
             "FLOPs (5 matmuls with the recomputed scores: flash-attention's "
             "benchmarks/benchmark_flash_attention.py, fwd_bwd = 3.5x fwd), mxgraph's cost "
             "rules as 2x (Megatron's convention), so a forward+backward share from a paper is "
             "times 3 / 3.5 here")
_FA2_H100 = (_FA3_FIGURES + "FlashAttention-2 forward (causal) 298-335 and backward 291-322 "
             "TFLOPS, i.e. 293-326 forward+backward: 0.30-0.33 of 989, the plateau 0.33 taken "
             "(attention_half_flops gives the ramp) -> 0.28" + _FA_FLOPS)
_TILES = ("NVIDIA Matrix Multiplication Background User's Guide (tile and wave quantization); "
          "tile: the cuBLAS kernels profilers name for large bf16 GEMMs")

A100 = DeviceProfile(
    name="a100-80gb", peak_flops=312e12, hbm_bytes=80e9, hbm_bw=2.039e12, gpus_per_node=8,
    intra_link="nvlink", intra_bw=300e9, intra_latency_s=3e-6, inter_bw=25e9,
    inter_latency_s=8e-6, comm_efficiency=0.78, host_bw=25e9, gemm_efficiency=0.80,
    gemm_half_flops=3e8, attention_efficiency=0.51, attention_half_flops=1e9,
    memory_efficiency=0.85, op_overhead_s=4e-6, sm_count=108, gemm_tile=[256, 128],
    overlap_slowdown=0.19, attention_kernels={"fa2": 0.51},
    sources={
        "peak_flops": "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense (624 with sparsity)",
        "sm_count": "NVIDIA A100 whitepaper: 108 SMs",
        "gemm_tile": _TILES + " (ampere_bf16_s16816gemm ... 256x128)",
        "hbm": "A100 80GB SXM datasheet: 80 GB HBM2e, 2,039 GB/s",
        "intra_bw": "NVLink 3: 600 GB/s total per GPU = 300 GB/s per direction",
        "inter_bw": "DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s",
        "host_bw": "PCIe 4.0 x16: ~25 GB/s achieved per direction",
        "gemm_efficiency": _GEMM + ": ~250 of 312 TFLOPS; MAMF 271.2 (86.9%, " + _MAMF + ")",
        "attention_efficiency": "FlashAttention-2 paper: 50-70% of peak forward+backward, 0.60 "
                                "taken -> 0.51" + _FA_FLOPS,
        "attention_kernels": "fa2: the default (FlashAttention-2, as above)",
        "memory_efficiency": "STREAM-like device copies: ~1.7 of 2.0 TB/s",
        "comm_efficiency": _NCCL + " (~230 of 300 GB/s on DGX A100)",
        "overlap_slowdown": _OVERLAP,
    })

H100 = DeviceProfile(
    name="h100-sxm", peak_flops=989e12, hbm_bytes=80e9, hbm_bw=3.35e12, gpus_per_node=8,
    intra_link="nvlink", intra_bw=450e9, intra_latency_s=3e-6, inter_bw=50e9,
    inter_latency_s=8e-6, comm_efficiency=0.80, host_bw=50e9, gemm_efficiency=0.70,
    gemm_half_flops=1e9, attention_efficiency=0.45, attention_half_flops=3e9,
    memory_efficiency=0.85, op_overhead_s=4e-6, sm_count=132, gemm_tile=[128, 256],
    fp8_flops=1979e12, fp8_gemm_efficiency=0.62, overlap_slowdown=0.19,
    attention_kernels={"fa2": 0.28},
    sources={
        "peak_flops": "NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity)",
        "sm_count": "NVIDIA H100 SXM5: 132 SMs (H100 whitepaper)",
        "gemm_tile": _TILES + " (sm90_xmma_gemm_bf16 ... tilesize128x256x64)",
        "fp8_flops": "NVIDIA H100 SXM datasheet: 1,979 TFLOPS FP8 dense (3,958 with sparsity)",
        "fp8_gemm_efficiency": "FP8 MAMF 1402.6 of 1979 (70.9%, " + _MAMF + "), times the "
                               "bf16 ratio of sustained to MAMF efficiency (0.70 / 0.803)",
        "hbm": "H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s",
        "intra_bw": "NVLink 4: 900 GB/s total per GPU = 450 GB/s per direction",
        "inter_bw": "DGX H100: one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s",
        "host_bw": "PCIe 5.0 x16: ~50 GB/s per direction",
        "gemm_efficiency": _GEMM + ": ~650-750 of 989 TFLOPS; bf16 MAMF 794.5 (80.3%, " +
                           _MAMF + ")",
        "attention_efficiency": "cuDNN's fused attention (Transformer Engine's, and PyTorch "
                                "SDPA's default on Hopper once cuDNN > 9.15): " + _FA3_FIGURES +
                                "cuDNN forward (causal) 484-539 and backward 465-518 TFLOPS, "
                                "~0.53 of peak forward+backward -> 0.45" + _FA_FLOPS,
        "attention_kernels": "fa2: " + _FA2_H100,
        "memory_efficiency": "STREAM-like device copies: ~2.8 of 3.35 TB/s",
        "comm_efficiency": _NCCL,
        "overlap_slowdown": _OVERLAP,
    })

H100_GT = dataclasses.replace(
    H100, name="h100-hbm2e-500w", peak_flops=912e12, hbm_bytes=96e9, hbm_bw=2.4e12,
    fp8_flops=1824e12,
    sources={**H100.sources,
             "peak_flops": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton "
                           "H100s at their default 500 W limit): the peak is between the SXM "
                           "part's 989 and the NVL's 835 TFLOPS bf16 dense (H100 NVL datasheet: "
                           "1,671 with sparsity) and not known exactly; their midpoint taken",
             "fp8_flops": "twice the bf16 peak, as on every H100 datasheet",
             "hbm": "the same page: 96 GB HBM2e, 2.4 TB/s",
             "gemm_efficiency": "as h100-sxm, of this part's peak",
             "attention_efficiency": "as h100-sxm, of this part's peak",
             "attention_kernels": "as h100-sxm, of this part's peak"})
"""The 500 W HBM2e H100 of Meta's Grand Teton hosts (torchtitan's H100 benchmarks); the rest
as h100-sxm (the same die, NVLink and 400 Gb/s RDMA per GPU)."""

H800 = DeviceProfile(
    name="h800", peak_flops=989e12, hbm_bytes=80e9, hbm_bw=3.35e12, gpus_per_node=8,
    intra_link="nvlink", intra_bw=200e9, intra_latency_s=3e-6, inter_bw=50e9,
    inter_latency_s=8e-6, comm_efficiency=0.80, host_bw=50e9, gemm_efficiency=0.70,
    gemm_half_flops=1e9, attention_efficiency=0.45, attention_half_flops=3e9,
    memory_efficiency=0.85, op_overhead_s=4e-6, sm_count=132, gemm_tile=[128, 256],
    fp8_flops=1979e12, fp8_gemm_efficiency=0.62, overlap_slowdown=0.19,
    attention_kernels={"fa2": 0.28},
    sources={
        "peak_flops": "H800 SXM: the H100 SXM compute die, 989 TFLOPS bf16 dense",
        "sm_count": "as h100-sxm (the same die)",
        "gemm_tile": "as h100-sxm",
        "fp8_flops": "as h100-sxm: 1,979 TFLOPS FP8 dense",
        "fp8_gemm_efficiency": "as h100-sxm",
        "hbm": "H800 SXM: 80 GB HBM3, 3.35 TB/s (as H100 SXM)",
        "intra_bw": "H800 NVLink: 400 GB/s total = 200 GB/s per direction (DeepSeek-V3 "
                    "report: ~160 GB/s achieved, i.e. comm_efficiency 0.8)",
        "inter_bw": "DeepSeek-V3 report: 400 Gb/s InfiniBand per GPU (50 GB/s)",
        "gemm_efficiency": _GEMM + " (as h100-sxm)",
        "attention_efficiency": "as h100-sxm",
        "attention_kernels": "as h100-sxm (the same die)",
        "comm_efficiency": "DeepSeek-V3 report: 160 of 200 GB/s NVLink",
        "overlap_slowdown": _OVERLAP,
    })

METAX_C500 = DeviceProfile(
    name="metax-c500", peak_flops=280e12, hbm_bytes=64e9, hbm_bw=1.8e12, gpus_per_node=8,
    intra_link="metalink", intra_bw=200e9, intra_latency_s=4e-6, inter_bw=25e9,
    inter_latency_s=10e-6, comm_efficiency=0.75, host_bw=25e9, gemm_efficiency=0.70,
    gemm_half_flops=3e8, attention_efficiency=0.45, attention_half_flops=1e9,
    memory_efficiency=0.80, op_overhead_s=6e-6, overlap_slowdown=0.19,
    sources={
        "peak_flops": "MetaX C500 public product figures: 280 TFLOPS fp16/bf16 dense "
                      "(not checked against a datasheet in this version: run --calibrate "
                      "on the device before trusting it)",
        "hbm": "MetaX C500 public product figures: 64 GB HBM2e, 1.8 TB/s (unverified)",
        "intra_bw": "MetaXLink: full mesh of 8 cards; per-card bandwidth assumed 200 GB/s "
                    "per direction (unverified placeholder; --calibrate measures it)",
        "inter_bw": "assumed one 200 Gb/s NIC per card",
        "gemm_efficiency": "assumed as A100-class (no published microbenchmark at hand)",
        "attention_efficiency": "assumed below A100's FlashAttention-2 share",
        "overlap_slowdown": "assumed as NVIDIA's GPUs (MCCL's kernels hold compute units as "
                            "NCCL's do): " + _OVERLAP,
    })

CPU = DeviceProfile(
    name="cpu", peak_flops=1.4e10, dtype="float32", hbm_bytes=22e9 / 4, hbm_bw=5e9,
    gpus_per_node=4, intra_link="loopback", intra_bw=1.25e8, intra_latency_s=1e-4,
    inter_bw=1.25e8, inter_latency_s=1e-4, shared_link=True, comm_efficiency=0.85,
    host_bw=5e9, gemm_efficiency=1.0, gemm_half_flops=2e6, attention_efficiency=0.5,
    attention_half_flops=4e6, memory_efficiency=1.0, memory_half_bytes=1e5,
    op_overhead_s=3e-5, flash_attention=False,
    sources={
        "all": "placeholder for 4 gloo ranks on 2 cores and a 1 Gbit/s shaped loopback; "
               "replace with mxgraph search --calibrate cpu --nproc 4 (writes a device TOML)",
    })

BUILTIN: dict[str, DeviceProfile] = {p.name: p for p in (A100, H100, H100_GT, H800, METAX_C500, CPU)}


def load_device(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name (`BUILTIN`) or a TOML device file; UserError naming the
    known profiles, the missing field, or the field of the wrong type."""
    if name_or_path in BUILTIN:
        return dataclasses.replace(BUILTIN[name_or_path])
    path = Path(name_or_path)
    if not path.suffix == ".toml" and not path.exists():
        raise UserError(f"--device {name_or_path!r} is neither a built-in profile "
                        f"({', '.join(BUILTIN)}) nor a TOML device file; pass one of those "
                        f"names or the path of a .toml file")
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"device file {path} does not exist; pass a built-in profile "
                        f"({', '.join(BUILTIN)}) or the path of a TOML device file") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"device file {path} is not valid TOML: {error}") from None
    return device_from_dict(data, str(path))


def device_from_dict(data: dict, source: str) -> DeviceProfile:
    """A profile from a TOML document's values; UserError for a missing or unknown field."""
    fields = {f.name: f for f in dataclasses.fields(DeviceProfile)}
    for key in data:
        if key not in fields:
            raise UserError(f"device file {source}: unknown field {key!r}; device fields: "
                            f"{', '.join(fields)}")
    examples = {"name": 'name = "my-gpu"', "peak_flops": "peak_flops = 312e12"}
    for key, example in examples.items():
        if key not in data:
            raise UserError(f"device file {source} misses the field {key!r}; add a line "
                            f"like {example}")
    for key, value in data.items():
        default = fields[key].default
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"device file {source}: {key} = {value!r} must be a number")
    try:
        return DeviceProfile(**data)
    except TypeError as error:
        raise UserError(f"device file {source}: {error}") from None
