"""Device profiles for Auto Search: what one accelerator and its links can do.

    device = load_device("h800")             # profiles.py: a built-in profile, or a TOML file
    device.gemm_time(flops=2**31)             # seconds
    device.collective_time("all_reduce", nbytes=2**26, group_size=8, spans_nodes=False)

A profile is a `DeviceProfile`; a TOML device file holds its fields at the top level (every
field has a default except `name` and `peak_flops`; units: FLOP/s, bytes, bytes/s, seconds),
plus optional `[[collective]]` tables of measured alpha-beta fits that `--calibrate`
writes (`kind`, `group_size`, `alpha_s`, `beta_s_per_byte`, `spans_nodes`).

Time model. A GEMM whose shape the trace gave, on a profile with `sm_count`, takes
`gemm_shape_time`: whole `gemm_tile`s in waves of `sm_count` SMs at the large-shape rate
(`gemm_efficiency`, or FP8's), or its bytes at the memory rate when that is longer. Any
other kernel of x FLOPs (x bytes for memory-bound kernels) takes
`op_overhead_s + (x + half) / (peak * efficiency)`: the rate grows with size as
`peak * efficiency * x / (x + half)` (the "efficiency curve"; `half` is the size at which
half the best efficiency is reached), which is a straight line in x, so a calibration fits
it by least squares. A collective over `n` ranks of `B` bytes (the full tensor, the comm
report's convention) takes `alpha * steps + factor * B / bandwidth`, where `factor` is the
ring's wire share (all-reduce 2(n-1)/n, all-gather/reduce-scatter/all-to-all (n-1)/n,
broadcast/reduce/send 1), `steps` the ring's latency hops (2(n-1) / (n-1); a tree's
2 log2 n for an all-reduce across nodes; a ring across nodes leaves a node once per node, the
other hops are intra-node), and the bandwidth that of the link level the
group spans (intra-node link; across nodes the NICs of the group's ranks in one node
together, one ring per NIC, at most the intra-node link: `inter_node_bandwidth`; an
all-to-all's cross-node share goes through each rank's own NIC), times
`comm_efficiency`. With `shared_link` (the CPU's loopback: every rank of a node sends
through one link) the bandwidth is divided by the ranks of a node sending at once.
Measured `[[collective]]` fits override the model for their kind and group size.
Overlap is not free: a collective hidden behind compute slows that compute by
`overlap_slowdown` of the time it runs beside it (`overlap_cost`).

Sources of the built-in numbers are noted beside each; peak FLOP/s, HBM and link figures
come from the vendors' datasheets, efficiencies from published microbenchmarks (cuBLAS
GEMM, FlashAttention kernels, STREAM-like copies, nccl-tests bus bandwidth), never from
end-to-end training throughputs. The `cpu` profile was measured on this machine with
`mxgraph search --calibrate cpu --nproc 4` (4 gloo ranks on 2 cores, 1 Gbit/s shaped link).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mxgraph.errors import UserError

LINK_KINDS = ("nvlink", "metalink", "pcie", "loopback")
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0}


@dataclass(kw_only=True)
class CollectiveFit:
    """A measured alpha-beta fit of one collective kind on one group size."""

    kind: str
    group_size: int
    alpha_s: float
    """Seconds per call at zero bytes."""
    beta_s_per_byte: float
    """Seconds per byte of the full tensor (the comm report's volume convention)."""
    spans_nodes: bool = False


@dataclass(kw_only=True)
class DeviceProfile:
    """One accelerator kind and its links (see the module docstring for the time model)."""

    name: str
    """Profile name, shown in tables."""
    peak_flops: float
    """Dense bf16/fp16 peak FLOP/s of one device (fp32 for the cpu profile)."""
    dtype: str = "bfloat16"
    """Parameter dtype the profile's numbers are for (bfloat16, float16 or float32)."""
    hbm_bytes: float = 80e9
    """Device memory in bytes."""
    usable_memory_fraction: float = 0.92
    """Share of hbm_bytes a plan may use (the rest: allocator fragmentation, libraries)."""
    hbm_bw: float = 2.0e12
    """Device memory bandwidth, bytes/s."""
    gpus_per_node: int = 8
    """Devices per node (those joined by the intra-node link)."""
    intra_link: str = "nvlink"
    """Intra-node link kind: nvlink, metalink (full mesh), pcie or loopback."""
    intra_bw: float = 300e9
    """Intra-node bandwidth per device and direction, bytes/s."""
    intra_latency_s: float = 3e-6
    """Latency of one ring step on the intra-node link, seconds."""
    inter_bw: float = 25e9
    """Inter-node bandwidth per device and direction (its NIC), bytes/s."""
    inter_latency_s: float = 8e-6
    """Latency of one step across nodes, seconds."""
    shared_link: bool = False
    """Every rank of a node sends through one link of intra_bw (the CPU's loopback)."""
    link_burst_s: float = 0.0
    """Seconds of transfer the link passes at once after it idled at least as long (a token
    bucket's depth over its rate: the burst of the CPU's tc-tbf-shaped loopback; 0 for a
    fabric without one). A collective inside a layer follows that layer's compute, so it
    takes up to min(link_burst_s, the compute before it) less than back to back
    (`burst_saving`); gradient buckets run back to back and get none. --calibrate measures it."""
    comm_efficiency: float = 0.8
    """Achieved share of the link bandwidth (nccl-tests bus bandwidth / link)."""
    host_bw: float = 25e9
    """Device <-> host bandwidth for activation offload, bytes/s per device."""
    gemm_efficiency: float = 0.75
    """Best achieved share of peak_flops for GEMMs (large shapes)."""
    gemm_half_flops: float = 3e8
    """FLOPs of a GEMM that reaches half of gemm_efficiency (a GEMM of unknown shape)."""
    sm_count: int = 0
    """Streaming multiprocessors (compute units) of one device; 0: every GEMM is timed by
    its FLOPs alone (the efficiency curve), else a GEMM of known shape by `gemm_shape_time`."""
    gemm_tile: list = field(default_factory=lambda: [128, 256])
    """Output tile (rows, columns) one SM computes at once in the GEMM library's kernels for
    large shapes; a dimension shorter than it gets the power of two at or above it (>= 64)."""
    stream_k: bool = False
    """The GEMM library spreads the k-loop of a last, partial wave of tiles over the idle
    SMs (cuBLAS's stream-K kernels on Hopper), so a partial wave costs no idle SMs."""
    fp8_flops: float = 0.0
    """Dense FP8 peak FLOP/s of one device (0: no FP8 tensor cores)."""
    fp8_gemm_efficiency: float = 0.0
    """Best achieved share of fp8_flops for FP8 GEMMs (large shapes)."""
    attention_efficiency: float = 0.55
    """Best achieved share of peak_flops for fused attention (forward and backward)."""
    attention_half_flops: float = 1e9
    """FLOPs of an attention call that reaches half of attention_efficiency."""
    attention_kernels: dict = field(default_factory=dict)
    """Other fused attention kernels the device runs, by name, each with its
    attention_efficiency (e.g. {"fa2": 0.28}: FlashAttention-2 on a Hopper part, whose
    default is cuDNN's); `with_attention_kernel` prices a run that used one. In a TOML
    device file an [attention_kernels] table."""
    memory_efficiency: float = 0.85
    """Best achieved share of hbm_bw for memory-bound kernels."""
    memory_half_bytes: float = 1e6
    """Bytes of a memory-bound kernel that reaches half of memory_efficiency."""
    op_overhead_s: float = 4e-6
    """Fixed cost per kernel (launch and framework dispatch), seconds."""
    overlap_slowdown: float = 0.0
    """Share by which compute slows while a collective runs beside it: the communication
    library's kernels hold SMs (and memory bandwidth) the GEMMs would use. A collective
    that hides `h` seconds behind compute adds `overlap_slowdown * h` to it
    (`overlap_cost`); 0: overlap is free. `--calibrate` with --nproc > 1 measures it."""
    adamw_s_per_element: float = 0.0
    """Measured seconds of `torch.optim.AdamW.step()` per fp32 parameter element (what
    `mxgraph train` runs; --calibrate writes it); 0: AdamW is timed as a memory-bound pass
    over parameters, gradients and both moments (a fused kernel's traffic)."""
    clip_s_per_element: float = 0.0
    """Measured seconds of gradient-norm clipping per gradient element; 0: one read and one
    scaled write of the gradients, memory-bound."""
    step_overhead_s: float = 0.0
    """Fixed cost per training step outside the kernels (Python, optimizer loop), seconds."""
    flash_attention: bool = True
    """Attention is a fused kernel (no S x S matrix saved); False on the CPU for math attention."""
    sources: dict = field(default_factory=dict)
    """Field -> where its number comes from."""
    collective: list = field(default_factory=list)
    """Measured `CollectiveFit`s (from --calibrate); they override the alpha-beta model."""

    def with_attention_kernel(self, kernel: str) -> "DeviceProfile":
        """This profile with `kernel`'s attention efficiency (`attention_kernels`); "" or
        "default": unchanged. UserError naming the kernels it knows."""
        if kernel in ("", "default"):
            return self
        if kernel not in self.attention_kernels:
            known = ", ".join(["default", *self.attention_kernels])
            raise UserError(f"device {self.name} has no attention kernel {kernel!r}; it knows "
                            f"{known} (a device file lists more under [attention_kernels])")
        return dataclasses.replace(self, attention_efficiency=self.attention_kernels[kernel])

    def __post_init__(self):
        self.collective = [c if isinstance(c, CollectiveFit) else CollectiveFit(**c)
                           for c in self.collective]
        if len(self.gemm_tile) != 2 or not all(isinstance(t, int) and t > 0
                                               for t in self.gemm_tile):
            raise UserError(f"device {self.name}: gemm_tile = {self.gemm_tile!r} must be two "
                            f"positive integers (rows, columns), e.g. gemm_tile = [128, 256]")
        if self.intra_link not in LINK_KINDS:
            raise UserError(f"device {self.name}: intra_link = {self.intra_link!r} is unknown; "
                            f"choose one of {', '.join(LINK_KINDS)}")
        for name in ("peak_flops", "hbm_bytes", "hbm_bw", "intra_bw", "inter_bw", "host_bw"):
            if not getattr(self, name) > 0:
                raise UserError(f"device {self.name}: {name} must be > 0")
        for kernel, efficiency in self.attention_kernels.items():
            if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or \
                    not 0 < efficiency <= 4:
                raise UserError(f"device {self.name}: attention_kernels.{kernel} = "
                                f"{efficiency!r} must be a share of peak_flops, e.g. 0.33")

    # ---- kernels -----------------------------------------------------------------------
    def gemm_time(self, flops: float, fp8: bool = False) -> float:
        """Seconds of a GEMM of `flops` whose shape is unknown (the efficiency curve)."""
        return self.op_overhead_s + (flops + self.gemm_half_flops) / self.gemm_rate(fp8)

    def gemm_rate(self, fp8: bool = False) -> float:
        """FLOP/s of a large GEMM: bf16 (the profile's dtype), or FP8 where the device has it."""
        if fp8 and self.fp8_flops:
            return self.fp8_flops * self.fp8_gemm_efficiency
        return self.peak_flops * self.gemm_efficiency

    def gemm_shape_time(self, shape: tuple, sequences: int = 1, element: int = 2,
                        fp8: bool = False) -> float:
        """Seconds of one GEMM of `shape` = (batch, m, n, k, grows) for `sequences` of the
        traced one (the `grows` dimension times `sequences`; -1: the time times them),
        `element` bytes per input element (1 under FP8). Tile and wave quantization (NVIDIA's
        "Matrix Multiplication Background" guide): the SMs compute whole `gemm_tile`s, in
        waves of `sm_count` (a partial last wave idles SMs unless `stream_k`), at the large-
        shape efficiency (fewer tiles than SMs: the library splits k over the idle SMs, as
        cuBLAS's split-K kernels do); a memory-bound GEMM (few rows: a small expert's)
        takes its bytes (inputs and a bf16 output) at the memory rate instead."""
        batch, m, n, k, grows = shape
        dims = [batch, m, n, k]
        repeat = sequences
        if grows >= 0:
            dims[grows] *= sequences
            repeat = 1
        batch, m, n, k = dims
        rows, cols = (min(t, max(64, 1 << (d - 1).bit_length())) for t, d in
                      zip(self.gemm_tile, (m, n), strict=True))
        tiles = batch * math.ceil(m / rows) * math.ceil(n / cols)
        spread = self.stream_k or tiles < self.sm_count  # under one wave: split-K fills the SMs
        slots = tiles if spread else math.ceil(tiles / self.sm_count) * self.sm_count
        work = 2.0 * slots * rows * cols * k
        rate = self.gemm_rate(fp8)
        moved = batch * (element * (m * k + k * n) + 2 * m * n)
        return repeat * (self.op_overhead_s + max(work / rate, moved / (
            self.hbm_bw * self.memory_efficiency)))

    def attention_time(self, flops: float) -> float:
        return self.op_overhead_s + (flops + self.attention_half_flops) / (
            self.peak_flops * self.attention_efficiency)

    def overlap_cost(self, hidden_s: float) -> float:
        """Seconds that `hidden_s` of communication hidden behind compute add to that compute
        (`overlap_slowdown`): the compute beside it runs that much slower."""
        return self.overlap_slowdown * max(0.0, hidden_s)

    def memory_time(self, nbytes: float) -> float:
        return self.op_overhead_s + (nbytes + self.memory_half_bytes) / (
            self.hbm_bw * self.memory_efficiency)

    # ---- collectives ---------------------------------------------------------------------
    def collective_time(self, kind: str, nbytes: float, group_size: int,
                        spans_nodes: bool, ranks_sending: int | None = None,
                        ranks_per_node: int = 1, leaves_node: float | None = None) -> float:
        """Seconds for one collective of `nbytes` (full tensor) over `group_size` ranks;
        `ranks_sending`: ranks of one node sending at once (shared links), default all;
        `ranks_per_node`: ranks of the group in each node when it spans nodes, each with
        its own NIC (`inter_node_bandwidth`); `leaves_node`: an all-to-all's share of
        `nbytes` that leaves the node when not (n - local) / n, that of uniform
        destinations (a dispatcher sending a token once per node: `node_dispatch_share`),
        the rest then forwarded over the intra-node link."""
        if group_size <= 1 and kind != "send":
            return 0.0
        fit = self._fit(kind, group_size, spans_nodes)
        if fit is not None:
            return fit.alpha_s + fit.beta_s_per_byte * nbytes
        n = max(group_size, 2)
        factor = RING_FACTOR.get(kind, RING_FACTOR["all_reduce"])(n)
        if spans_nodes:  # a ring through the nodes: one hop in gpus_per_node leaves a node
            local = max(1, min(ranks_per_node, n))
            nodes = max(2, math.ceil(n / local))
            if kind == "all_reduce":
                latency = 2 * math.log2(n) * self.inter_latency_s
            else:
                latency = (nodes - 1) * self.inter_latency_s + (n - nodes) * self.intra_latency_s
            if kind == "all_to_all":  # each rank's own NIC carries what leaves its node
                leaving, inside = (n - local) / n, (local - 1) / n
                if leaves_node is not None:  # one copy a node, forwarded to its experts there
                    leaving, inside = leaves_node, (n - 1) / n
                return latency + max(leaving * nbytes / self.inter_bw,
                                     inside * nbytes / self.intra_bw) / self.comm_efficiency
            bw = self.inter_node_bandwidth(local)
            return latency + factor * nbytes / (bw * self.comm_efficiency)
        bw, alpha = self.intra_bw, self.intra_latency_s
        steps = {"all_reduce": 2 * (n - 1), "send": 1}.get(kind, n - 1)
        if self.shared_link:
            bw /= max(1, ranks_sending or self.gpus_per_node)
        return alpha * steps + factor * nbytes / (bw * self.comm_efficiency)

    def inter_node_bandwidth(self, ranks_per_node: int) -> float:
        """Bus bandwidth of a ring (reduce-scatter, all-gather, all-reduce) through nodes
        that hold `ranks_per_node` of its ranks each: NCCL runs one channel (ring) per NIC,
        so the traffic leaving a node is spread over the group's NICs in it, while each rank
        still moves the whole ring traffic over the intra-node link:
        min(intra_bw, ranks_per_node x inter_bw). Source: NCCL's own cost model,
        src/graph/tuning.cc `ncclTopoTuneModel` (busBw = nChannels x speedInter, one
        channel per rail NIC); nccl-tests all_reduce on 8 x 400 Gb/s H100 nodes reaches a
        bus bandwidth of ~400 GB/s, 8 NICs' worth. A group with one rank per node (dp
        across tp-8 nodes) gets one NIC: inter_bw."""
        return min(self.intra_bw, max(1, ranks_per_node) * self.inter_bw)

    def burst_saving(self, transfer_s: float, idle_s: float) -> float:
        """Seconds a collective whose bytes take `transfer_s` back to back saves after
        `idle_s` without traffic on the link (`link_burst_s`)."""
        return min(self.link_burst_s, idle_s, transfer_s)

    def _fit(self, kind: str, group_size: int, spans_nodes: bool) -> CollectiveFit | None:
        fits = [c for c in self.collective if c.kind == kind and c.spans_nodes == spans_nodes]
        if not fits:
            return None
        exact = [c for c in fits if c.group_size == group_size]
        if exact:
            return exact[0]
        near = min(fits, key=lambda c: abs(math.log2(c.group_size) - math.log2(max(1, group_size))))
        scale = RING_FACTOR.get(kind, RING_FACTOR["all_reduce"])(max(group_size, 2)) / \
            RING_FACTOR.get(kind, RING_FACTOR["all_reduce"])(max(near.group_size, 2))
        return CollectiveFit(kind=kind, group_size=group_size, alpha_s=near.alpha_s,
                             beta_s_per_byte=near.beta_s_per_byte * scale,
                             spans_nodes=spans_nodes)

    # ---- TOML ----------------------------------------------------------------------------
    def to_toml(self) -> str:
        """The profile as a TOML device file (what `load_device` reads back)."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("sources", "collective", "attention_kernels"):
                continue
            lines.append(f"{f.name} = {_toml(value)}")
        if self.attention_kernels:
            lines.append("\n[attention_kernels]")
            lines += [f"{k} = {_toml(v)}" for k, v in self.attention_kernels.items()]
        if self.sources:
            lines.append("\n[sources]")
            lines += [f"{k} = {_toml(v)}" for k, v in self.sources.items()]
        for fit in self.collective:
            lines.append("\n[[collective]]")
            lines += [f"{k} = {_toml(v)}" for k, v in dataclasses.asdict(fit).items()]
        return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
