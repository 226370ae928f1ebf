"""One MoE layer's routed experts alone, in one process: grouped GEMM vs capacity-padded
batched GEMM vs a loop over experts, forward + backward (bench_moe.py's single-process
section; runnable alone).

The single-process section times one MoE layer's routed experts at the model's shapes
(E experts, D = dim, F = moe_ffn_dim; N = `--kernel-tokens` x topk rows, by default the
tokens of one step of all ranks) forward + backward (SwiGLU: three GEMMs each way) as
`torch.ops.mxgraph.grouped_mm` over the rows sorted by expert, `torch.bmm` over
capacity-padded [E, C, D] (C = ceil(N / E x 1.25); it drops the rows past C, many under
skewed routing), and a Python loop of `F.linear` per expert: median ms of `--kernel-reps`
interleaved rounds on `--kernel-threads` threads.

    python benchmarks/bench_moe_kernels.py [--model moe-20m] [--kernel-tokens 1024]
        [--kernel-reps 10] [--kernel-threads 1]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

ROUTINGS = ("balanced", "skewed")
CAPACITY_FACTOR = 1.25


def expert_kernels(args) -> dict:
    """Single process: one MoE layer's routed experts, forward + backward, three ways."""
    import torch

    import models
    import mxgraph.codegen.kernels  # noqa: F401 - registers torch.ops.mxgraph.grouped_mm
    cfg = models.preset_config(args.model)
    E, D, F_dim = cfg.n_routed_experts, cfg.dim, cfg.moe_ffn_dim
    N = args.kernel_tokens * cfg.topk
    C = math.ceil(N / E * CAPACITY_FACTOR)
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(E, F_dim, D, generator=g) * 0.02).requires_grad_(),
               (torch.randn(E, F_dim, D, generator=g) * 0.02).requires_grad_(),
               (torch.randn(E, D, F_dim, generator=g) * 0.02).requires_grad_()]
    x_ND, grad_ND = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    results = {"E": E, "D": D, "F": F_dim, "N": N, "C": C, "threads": torch.get_num_threads()}
    for routing in ROUTINGS:
        if routing == "balanced":
            ids = torch.randint(0, E, (N,), generator=g)
        else:  # --skew-share of the rows to experts 0 and 1, the rest uniform over the others
            ids = torch.where(torch.rand(N, generator=g) < args.skew_share,
                              torch.randint(0, 2, (N,), generator=g),
                              torch.randint(2, E, (N,), generator=g))
        counts = torch.bincount(ids, minlength=E)
        variants = _expert_variants(weights, x_ND, grad_ND, counts, C)
        times, fastest = _interleaved_ms(variants, weights, args.kernel_reps)
        results[routing] = {
            "ms": times, "min_ms": fastest,
            "rows_computed": {"grouped_mm": N, "bmm": E * C, "loop": N},
            "bmm_dropped": float((counts - C).clamp(min=0).sum() / N),
            "grouped_over_bmm": times["grouped_mm"] / times["bmm"],
            "loop_over_bmm": times["loop"] / times["bmm"],
            "loop_over_grouped": times["loop"] / times["grouped_mm"]}
    return results


def _expert_variants(weights, x_ND, grad_ND, counts, C: int) -> dict:
    """Forward + backward of SwiGLU experts over rows sorted by expert (`counts` per
    expert) as grouped_mm, bmm over [E, C, D] (each expert's first C rows, padded; the
    padding copy is not timed) and a loop of F.linear per expert."""
    import torch
    import torch.nn.functional as F
    w_gate, w_up, w_down = weights
    E, D = counts.shape[0], x_ND.shape[1]
    offs = counts.cumsum(0)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    x_ECD = torch.zeros(E, C, D)
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        x_ECD[e, :min(C, t - s)] = x_ND[s:min(t, s + C)]
    grad_ECD = torch.randn(E, C, D, generator=torch.Generator().manual_seed(1))
    gmm = torch.ops.mxgraph.grouped_mm

    def grouped():
        x = x_ND.detach().requires_grad_()
        h = F.silu(gmm(x, w_gate.transpose(1, 2), offs)) * gmm(x, w_up.transpose(1, 2), offs)
        gmm(h, w_down.transpose(1, 2), offs).backward(grad_ND)

    def batched():
        x = x_ECD.detach().requires_grad_()
        h = F.silu(torch.bmm(x, w_gate.transpose(1, 2))) * torch.bmm(x, w_up.transpose(1, 2))
        torch.bmm(h, w_down.transpose(1, 2)).backward(grad_ECD)

    def loop():
        x = x_ND.detach().requires_grad_()
        outs = [F.linear(F.silu(F.linear(x[s:t], w_gate[e])) * F.linear(x[s:t], w_up[e]),
                         w_down[e]) for e, (s, t) in enumerate(zip(starts, ends, strict=True))]
        torch.cat(outs).backward(grad_ND)
    return {"grouped_mm": grouped, "bmm": batched, "loop": loop}


def _interleaved_ms(variants: dict, weights, reps: int) -> tuple[dict, dict]:
    """(median, min) ms per variant over `reps` rounds that run every variant once, in
    turn (so load from other processes falls on all of them alike), after two warm-up
    rounds; gradients cleared before each run."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(reps + 2):
        for name, fn in variants.items():
            for w in weights:
                w.grad = None
            start = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append((time.perf_counter() - start) * 1e3)
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: min(t) for name, t in times.items()})



def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="moe-20m", help="MoE model preset (its shapes)")
    parser.add_argument("--kernel-tokens", type=int, default=1024,
                        help="tokens routed to the layer (rows = tokens x topk)")
    parser.add_argument("--kernel-reps", type=int, default=10, help="timed rounds")
    parser.add_argument("--kernel-threads", type=int, default=1, help="torch threads")
    parser.add_argument("--skew-share", type=float, default=0.5,
                        help="skewed routing: share of rows sent to experts 0 and 1")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(args.kernel_threads)
    result = expert_kernels(args)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
