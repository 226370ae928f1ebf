"""`mxgraph search --calibrate DEVICE`: measure this machine and write a device TOML.

    mxgraph search --calibrate cpu --nproc 4 --out cpu.toml     # 4 ranks, gloo collectives
    python -m mxgraph.search.calibrate --name cpu --out cpu.toml --quick   # one process

Every rank runs the same microbenchmarks at the same time (so shared cores and links are
shared as in training; the numbers kept are the mean over ranks):
* GEMM: square fp32 (bf16 on cuda) `mm` of several sizes; t = a + FLOPs / rate is fitted
  by least squares: peak_flops = rate (gemm_efficiency = 1), gemm_half_flops from the
  intercept beyond the per-op overhead. On cuda (sizes 1024-8192) the profile times GEMMs
  by shape instead: `sm_count` from the device, `gemm_tile` by architecture (128x256 from
  Hopper on, 256x128 before), and peak_flops the rate of whole tiles (`tile_rate`).
* attention: causal `scaled_dot_product_attention` forward (on cuda forward and backward,
  at LLM shapes: 8 x 16 heads x 128, sequences 512-4096), FLOPs by cost.py's rule, the
  same fit: attention_efficiency = its rate / peak_flops.
* memory-bound: `add` of growing tensors (on cuda 1M-128M elements), bytes read + written;
  hbm_bw = the fitted rate.
* op overhead: the median time of an `add` of one element. On cuda each sample queues 10
  calls before it synchronises, so a time is the kernels' back to back (as a step issues
  them), not the host's wait for one.
* optimizer: `torch.optim.AdamW.step()` and `clip_grad_norm_` per parameter element.
* each compute sample repeats its op for about 0.1 s, every rank at once: ranks that share
  cores (the CPU) measure the shared rate training sees.
* overlap (nproc > 1): a loop of GEMMs timed alone and again while all-gathers over every
  rank run beside it for its whole length (async, on the collective library's own stream
  or threads); overlap_slowdown = beside / alone - 1, the mean over ranks (the
  collective's kernels hold SMs on a GPU, its transport threads share the cores on the CPU).
* collectives (nproc > 1, gloo on the CPU, nccl on cuda): all_reduce, all_gather,
  reduce_scatter, all_to_all and send/recv, on groups of 2 neighbouring ranks and of all
  ranks, every group at once, several sizes up to 16 MiB (beyond a shaped link's burst, as
  gradient buckets are); one alpha-beta fit per kind and group size
  (bytes: the full tensor, the comm report's convention) written as `[[collective]]`.
The default takes about a minute; `--quick` a few seconds (fewer sizes and repeats).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mxgraph.errors import UserError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def calibrate_command(args) -> int:
    """The CLI's --calibrate: run the measurement (through torchrun for --nproc > 1)."""
    out = args.out or f"{args.calibrate}.toml"
    if args.nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.nproc}", "-m", "mxgraph.search.calibrate",
                   "--name", args.calibrate, "--out", out] + (["--quick"] if args.quick else [])
        code = subprocess.call(command)
        if code:
            raise UserError(f"calibration over {args.nproc} ranks failed (status {code}); "
                            f"see the output above, or calibrate with --nproc 1")
    else:
        write_profile(measure(args.calibrate, args.quick), out)
    print(f"wrote device profile {out}")
    return 0


def _timed(fn, repeats: int, barrier=None, min_s: float = 0.0, longest=None) -> float:
    """Median seconds of one `fn()` over `repeats` samples, each after `barrier`. With
    `min_s` a sample is a window of at least `min_s` (and 10 calls) in which `fn` runs back
    to back, the same window on every rank (`longest(x)`: the largest x over ranks), so ranks
    sharing cores contend for the whole sample: a fixed count of calls lets the first rank
    done leave its core to the others, and one short call finds its core free. Without
    `min_s`, one call per sample (collectives: every rank calls alike)."""
    start = time.perf_counter()
    fn()
    window = max(min_s, 10 * (time.perf_counter() - start)) if min_s else 0.0
    if window and longest is not None:
        window = longest(window)
    times = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= window:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of t = a + b x over (x, t) points; the slope is kept
    at least half the largest point's t / x (a noisy fit cannot claim an absurd rate)."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / var
    x_last, t_last = max(points)
    slope = max(slope, 0.5 * t_last / x_last)  # noise: rate at most 2x the largest size's
    return max(0.0, mt - slope * mx), slope


def measure(name: str, quick: bool = False):
    """A `DeviceProfile` of this machine (every rank of the job measures; rank 0's view of
    the mean is returned on every rank)."""
    import torch
    import torch.distributed as dist

    from mxgraph.devices.profile import DeviceProfile
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) \
        if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    barrier = dist.barrier if world > 1 else None
    repeats = 3 if quick else 7

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def longest(x: float) -> float:
        top = torch.tensor([x], dtype=torch.float64, device=device)  # nccl: on the device
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return top.item()

    queued = 10 if device.type == "cuda" else 1
    # a GPU runs kernels behind the host: `queued` calls between two synchronisations, so a
    # sample times the kernels back to back (as a step issues them), not the host's wait

    def run(fn):
        def calls():
            for _ in range(queued):
                fn()
            sync()
        return _timed(calls, repeats, barrier, min_s=0.02 if quick else 0.1,
                      longest=longest if world > 1 else None) / queued

    one = torch.ones(1, device=device)
    overhead = run(lambda: one + one)
    shape_model = {}
    if device.type == "cuda":  # GEMMs by shape: the SMs and the tile the device computes in
        props = torch.cuda.get_device_properties(device)
        shape_model = {"sm_count": props.multi_processor_count,
                       "gemm_tile": [128, 256] if props.major >= 9 else [256, 128]}
        sizes = (2048, 8192) if quick else (1024, 2048, 4096, 8192)
        attention_sizes = (8, 16, (1024, 4096) if quick else (512, 1024, 2048, 4096), 128)
        memory_sizes = (2 ** 22, 2 ** 27) if quick else (2 ** 20, 2 ** 22, 2 ** 25, 2 ** 27)
    else:
        sizes = (64, 256) if quick else (128, 256, 512, 768)
        attention_sizes = (1, 4, (64, 128) if quick else (128, 256, 512), 64)
        memory_sizes = (10 ** 4, 10 ** 6) if quick else (10 ** 4, 10 ** 5, 10 ** 6, 4 * 10 ** 6)
    gemm = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        gemm.append((2.0 * n ** 3, run(lambda a=a: a @ a)))
    gemm_a, gemm_b = fit(gemm)
    peak = 1 / gemm_b
    if shape_model:
        peak = tile_rate([(n, t) for n, (_, t) in zip(sizes, gemm, strict=True)], overhead,
                         **shape_model)
        gemm_a = overhead
    attention = []
    batch, heads, seqs, head_dim = attention_sizes
    backward = device.type == "cuda"  # a GPU's flash backward runs below its forward's rate
    for seq in seqs:  # causal; FLOPs as the cost rules count them (backward: 2x forward)
        q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype,
                        requires_grad=backward)
        flops = (3 if backward else 1) * 2 * batch * heads * seq * seq * 2 * head_dim / 2

        def attend(q=q):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            if backward:
                out.backward(q.detach())
        attention.append((flops, run(attend)))
    attn_a, attn_b = fit(attention)
    memory = []
    for numel in memory_sizes:
        x = torch.ones(numel, device=device, dtype=dtype)
        # on cuda two tensors: x + x reads x from memory once (an H200 gave 6.2 TB/s for
        # 3 bytes counted per 2 moved, against its measured 4.2 TB/s copy bandwidth)
        y = x.clone() if device.type == "cuda" else x
        memory.append((3.0 * numel * x.element_size(), run(lambda x=x, y=y: x + y)))
    mem_a, mem_b = fit(memory)
    adamw, clip = optimizer_times(run, device, overhead, quick)
    values = [peak, overhead, max(0.0, gemm_a - overhead) * peak, 1 / attn_b / peak,
              max(0.0, attn_a - overhead) / attn_b, 1 / mem_b, max(0.0, mem_a - overhead) / mem_b,
              adamw, clip]
    fits = collective_fits(world, device, quick, barrier) if world > 1 else []
    burst = link_burst(world, device, fits, barrier) if world > 1 else 0.0
    values.append(overlap_slowdown(world, device, dtype, quick, barrier) if world > 1 else 0.0)
    if world > 1:
        mean = torch.tensor(values, dtype=torch.float64, device=device)  # nccl: on the device
        dist.all_reduce(mean)
        values = (mean / world).tolist()
    peak, overhead, gemm_half, attn_eff, attn_half, bw, mem_half, adamw, clip, slowdown = values
    total_memory = _host_memory() if device.type == "cpu" else \
        torch.cuda.get_device_properties(device).total_memory * world
    ar = [f for f in fits if f["kind"] == "all_reduce" and f["group_size"] == world]
    link = (2 * (world - 1) / world) / ar[0]["beta_s_per_byte"] if ar else 1e9
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return DeviceProfile(
        name=name, peak_flops=peak, dtype=str(dtype).split(".")[-1],
        hbm_bytes=total_memory / max(1, world), hbm_bw=bw, gpus_per_node=max(1, world),
        intra_link="loopback" if device.type == "cpu" else "nvlink", intra_bw=link,
        intra_latency_s=ar[0]["alpha_s"] / max(1, 2 * (world - 1)) if ar else 1e-5,
        inter_bw=link, shared_link=device.type == "cpu", comm_efficiency=1.0, host_bw=bw,
        gemm_efficiency=1.0, gemm_half_flops=gemm_half, attention_efficiency=min(4.0, attn_eff),
        attention_half_flops=attn_half, memory_efficiency=1.0, memory_half_bytes=mem_half,
        op_overhead_s=overhead, adamw_s_per_element=adamw, clip_s_per_element=clip,
        flash_attention=device.type != "cpu", link_burst_s=burst,
        overlap_slowdown=max(0.0, slowdown), **shape_model,
        sources={"all": f"measured by mxgraph search --calibrate {name} on {world} rank(s), "
                        f"{stamp}{' (quick)' if quick else ''}; see mxgraph/search/calibrate.py"},
        collective=fits)


def tile_rate(samples: list[tuple[int, float]], overhead: float, sm_count: int,
              gemm_tile: list) -> float:
    """The rate (FLOP/s) at which a device computes whole GEMM tiles, from `samples` of
    square n x n x n GEMMs and their seconds: each sample's tile-and-wave padded work
    (`DeviceProfile.gemm_shape_time`'s) over its time less `overhead`; the median, so
    that the shape model times the measured GEMMs back."""
    from mxgraph.devices.profile import DeviceProfile
    unit = DeviceProfile(name="unit", peak_flops=1.0, gemm_efficiency=1.0, op_overhead_s=0.0,
                         hbm_bw=1e30, sm_count=sm_count, gemm_tile=list(gemm_tile))
    rates = [unit.gemm_shape_time((1, n, n, n, -1)) / max(1e-12, seconds - overhead)
             for n, seconds in samples]
    return statistics.median(rates)


def optimizer_times(run, device, overhead: float, quick: bool) -> tuple[float, float]:
    """(AdamW step, gradient-norm clip) seconds per fp32 element, per-tensor overheads
    apart: `torch.optim.AdamW` as `mxgraph train` builds it (the default implementation
    for the device) and the clip a compiled step runs (`runtime.grad_norm.clip_pieces_`,
    its norm's all-reduce apart), over 16 tensors."""
    import torch

    from mxgraph.runtime.grad_norm import clip_pieces_
    numel = 2 ** 18 if quick else 2 ** 23  # past the caches, as a model's parameters are
    if device.type == "cuda":  # past a GPU's L2 and its per-launch costs
        numel = 2 ** 24 if quick else 2 ** 26
    params = [torch.nn.Parameter(torch.randn(numel // 16, device=device)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    adamw = run(optimizer.step)
    pieces = [(p.grad, 1) for p in params]
    clip = run(lambda: clip_pieces_(pieces, 1e9, device, reduce=False))
    adamw_tensors = len(params) if device.type == "cpu" else 0  # cuda's AdamW is foreach
    return (max(0.0, adamw - 12 * adamw_tensors * overhead) / numel,
            max(0.0, clip - 2 * len(params) * overhead) / numel)  # the clip launches per tensor


def _host_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16e9


def collective_fits(world: int, device, quick: bool, barrier) -> list[dict]:
    """Alpha-beta fits per collective kind on groups of 2 and of `world` ranks."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    groups = {world: None}
    if world > 2 and world % 2 == 0:
        pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
        groups[2] = pairs[rank // 2]
    sizes = (2 ** 16, 2 ** 20) if quick else (2 ** 14, 2 ** 17, 2 ** 20, 2 ** 22, 2 ** 24)
    repeats = 3 if quick else 5
    fits = []
    for n, group in sorted(groups.items()):
        for kind in KINDS:
            points = []
            for nbytes in sizes:
                numel = nbytes // 4
                numel -= numel % n
                x = torch.ones(numel, device=device)
                fn = _collective(kind, x, n, group, rank)
                points.append((numel * 4.0, _timed(fn, repeats, barrier)))
            times = torch.tensor([t for _, t in points], dtype=torch.float64, device=device)
            dist.all_reduce(times)
            alpha, beta = fit([(b, t / world) for (b, _), t in zip(points, times.tolist(), strict=True)])
            fits.append({"kind": kind, "group_size": n, "alpha_s": alpha,
                         "beta_s_per_byte": beta, "spans_nodes": False})
    return fits


def overlap_slowdown(world: int, device, dtype, quick: bool, barrier) -> float:
    """This rank's share by which GEMMs slow while all-gathers over every rank run beside
    them (module docstring): a loop of GEMMs alone, then the same loop right after enough
    async all-gathers were queued to outlast it (from one all-gather's time), in pairs; the
    median of the pairs' ratios - 1. On cuda only the compute stream is waited for the
    GEMMs' time."""
    import torch
    import torch.distributed as dist
    cuda = device.type == "cuda"
    n, calls = (4096, 10 if quick else 30) if cuda else (512, 4 if quick else 10)
    a = torch.randn(n, n, device=device, dtype=dtype)

    def gemms(after_barrier: bool = True) -> float:
        if after_barrier:  # not beside queued collectives: a barrier would wait for them
            barrier()
        start = time.perf_counter()
        for _ in range(calls):
            a @ a
        if cuda:
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter() - start

    alone = min(gemms() for _ in range(2))
    numel = (2 ** 24 if cuda else 2 ** 20) // world * world
    out = torch.ones(numel, device=device)
    part = out[: numel // world].clone()
    barrier()
    start = time.perf_counter()
    dist.all_gather_into_tensor(out, part)
    if cuda:
        torch.cuda.synchronize(device)
    one = max(1e-6, time.perf_counter() - start)
    count = torch.tensor([min(200, max(2, math.ceil(2 * alone / one)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank queues as many
    ratios = []
    for _ in range(3 if quick else 7):
        alone = gemms()
        barrier()
        works = [dist.all_gather_into_tensor(out, part, async_op=True)
                 for _ in range(int(count.item()))]
        ratios.append(gemms(after_barrier=False) / alone)
        for work in works:
            work.wait()
        if cuda:
            torch.cuda.synchronize(device)
    return statistics.median(ratios) - 1


def link_burst(world: int, device, fits: list[dict], barrier, idle_s: float = 0.1) -> float:
    """Seconds of transfer a link passes at once after idling (a token bucket's depth over
    its rate: tc tbf's burst on a shaped loopback; about 0 on a fabric without one): the
    largest gap between an all-reduce's time back to back (the fit) and its time after
    `idle_s` without traffic, over sizes up to 4 MiB, the mean over ranks."""
    import torch
    import torch.distributed as dist
    fit_ar = [f for f in fits if f["kind"] == "all_reduce" and f["group_size"] == world][0]
    saved = 0.0
    for nbytes in (2 ** 18, 2 ** 20, 2 ** 22):
        x = torch.ones(nbytes // 4, device=device)
        samples = []
        for _ in range(5):
            barrier()
            time.sleep(idle_s)
            start = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        streamed = fit_ar["alpha_s"] + fit_ar["beta_s_per_byte"] * nbytes
        saved = max(saved, streamed - statistics.median(samples))
    mean = torch.tensor([max(0.0, saved)], dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    return mean.item() / world


def _collective(kind: str, x, n: int, group, rank: int):
    import torch
    import torch.distributed as dist
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":  # bytes: the output (the full tensor)
        part = x[: x.numel() // n].clone()
        return lambda: dist.all_gather_into_tensor(x, part, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(x.numel() // n, device=x.device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    peer = rank + 1 if rank % 2 == 0 else rank - 1  # send: pairs of neighbours

    def exchange():
        if rank % 2 == 0:
            dist.send(x, peer)
        else:
            dist.recv(x, peer)
    return exchange


def write_profile(profile, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(profile.to_toml())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="cpu", help="profile name to write")
    parser.add_argument("--out", default="cpu.toml", help="device TOML to write")
    parser.add_argument("--quick", action="store_true", help="few sizes and repeats")
    args = parser.parse_args(argv)
    profile = measure(args.name, args.quick)
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_profile(profile, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
