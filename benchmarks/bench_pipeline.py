"""Pipeline schedule benchmarks (simulated; run: python benchmarks/bench_pipeline.py --out r.json).

Parts, each a function returning JSON-ready results, called in order by `main`:
(1) `simulated_schedules`: bubble ratio, peak activation and step time per schedule for
    pp in {4, 8, 16} and m in {8, 16, 32}.
(3) `deepseek_v3_layout`: DeepSeek-V3's 61 layers at PP=8, VPP=2, padded to 64 slots vs
    uneven splits, simulated step time and the gain.
(2) with --real: the same llama on gloo processes, mxgraph's 1F1B, interleaved, ZB and
    DualPipeV against torch.distributed.pipelining's peers, as throughput ratios
    (`bench_pipeline_real.py`, which also runs alone with more options).

Cost model of part (1): every rank does F = B = W = 1 of work per microbatch (a stage
costs num_ranks / num_stages of that), BW = B + W, an overlapped F&B costs F + BW,
comm 0. "peak act" is the largest per-rank peak, in microbatches' worth of one rank's
layers (memory model in mxgraph/schedules/simulate.py, w_retained = 0.5).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mxgraph.errors import PlanError  # noqa: E402
from mxgraph.schedules import Costs, build_schedule, simulate  # noqa: E402
from mxgraph.schedules.layout import balance_layers, pad_empty_layers, stage_costs  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("dualpipev", 2)]


# ---------------------------------------------------------------------------------------
# (1) simulated bubble ratio and activation memory per schedule
# ---------------------------------------------------------------------------------------
def simulated_schedules(pps=(4, 8, 16), microbatches=(8, 16, 32)) -> list[dict]:
    rows = []
    for pp in pps:
        for m in microbatches:
            for name, vpp in SCHEDULES:
                try:
                    sched = build_schedule(name, pp, m, vpp)
                except PlanError as err:
                    rows.append({"schedule": name, "pp": pp, "microbatches": m, "vpp": vpp,
                                 "skipped": str(err)})
                    continue
                per_stage = pp / sched.num_stages
                tl = simulate(sched, Costs(f=per_stage, b=per_stage, w=per_stage))
                rows.append({"schedule": name, "pp": pp, "microbatches": m, "vpp": vpp, **tl.summary(),
                             "peak_activation_microbatches": max(tl.peak_activation_microbatches.values())})
    return rows


def print_schedule_table(rows: list[dict]) -> None:
    print("(1) simulated schedules: F = B = W = 1 per rank per microbatch, comm 0")
    print(f"{'schedule':<12}{'pp':>4}{'m':>4}{'step':>9}{'bubble':>9}{'peak act':>10}{'params':>8}")
    for r in rows:
        head = f"{r['schedule']:<12}{r['pp']:>4}{r['microbatches']:>4}"
        if "skipped" in r:
            print(f"{head}   n/a: {r['skipped']}")
            continue
        print(f"{head}{r['total_time']:>9.1f}{r['bubble_ratio']:>9.1%}"
              f"{r['peak_activation_microbatches']:>10.2f}{max(r['param_copies_per_rank']):>8.1f}")


# ---------------------------------------------------------------------------------------
# (3) DeepSeek-V3: 61 layers at PP=8, VPP=2 — empty-layer padding vs uneven stages
# ---------------------------------------------------------------------------------------
# Forward cost per layer, in units of one dense layer (assumptions, not measurements):
# - dense layer (layers 0-2: MLA + 18432-wide SwiGLU FFN) = 1.0;
# - MoE layer (layers 3-60: MLA + 1 shared + 8 of 256 routed 2048-wide experts, the same
#   activated FFN width 9 * 2048 = 18432) = 1.25: same GEMM FLOPs plus router, permute and
#   the all-to-all dispatch/combine that is not fully hidden;
# - embedding lookup = 0.05; head (7168 x 129280 output GEMM, ~0.93 GMAC/token, about one
#   layer at sequence 4096) + cross-entropy = 1.0; the MTP module is not modelled.
# B = W = F for every layer (so BW = 2F); comm 0; interleaved 1F1B schedule.
DSV3_LAYERS, DSV3_DENSE, DSV3_PP, DSV3_VPP = 61, 3, 8, 2
DENSE, MOE, EMBED, HEAD = 1.0, 1.25, 0.05, 1.0


def _dsv3_layer_costs() -> list[float]:
    return [DENSE if i < DSV3_DENSE else MOE for i in range(DSV3_LAYERS)]


def _contiguous_by_count(num_layers: int, num_stages: int) -> list[list[int]]:
    """The first num_layers % num_stages stages get one layer more (array_split style)."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (s < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def _step_time(stages: list[list[int | None]], vpp: int, m: int) -> dict:
    costs = stage_costs(stages, _dsv3_layer_costs(), EMBED, HEAD)
    sched = build_schedule("interleaved", DSV3_PP, m, vpp)
    per_stage = {s: {"F": c, "B": c, "W": c} for s, c in enumerate(costs)}
    tl = simulate(sched, Costs(per_stage=per_stage))
    rank_load = [sum(costs[s] for s in sched.stages_of(r)) for r in range(DSV3_PP)]
    return {"vpp": vpp, "layers_per_stage": [sum(x is not None for x in s) for s in stages],
            "max_stage_forward": max(costs), "max_rank_forward": max(rank_load),
            "step_time": tl.total_time, "bubble_ratio": tl.overall_bubble_ratio}


def deepseek_v3_layout(num_microbatches: int = 32) -> dict:
    m, stages = num_microbatches, DSV3_PP * DSV3_VPP
    layer_costs = _dsv3_layer_costs()
    layouts = {
        "padded_64": (pad_empty_layers(DSV3_LAYERS, DSV3_PP, DSV3_VPP), DSV3_VPP),
        "uneven_by_count_vpp2": (_contiguous_by_count(DSV3_LAYERS, stages), DSV3_VPP),
        "balanced_vpp2": (balance_layers(layer_costs, stages, EMBED, HEAD), DSV3_VPP),
        "balanced_vpp1": (balance_layers(layer_costs, DSV3_PP, EMBED, HEAD), 1),
    }
    results = {name: _step_time(layout, vpp, m) for name, (layout, vpp) in layouts.items()}
    padded = results["padded_64"]["step_time"]
    gains = {f"padded_64_vs_{name}": results[name]["step_time"] / padded - 1
             for name in results if name != "padded_64"}
    return {"num_microbatches": m, "costs": {"dense": DENSE, "moe": MOE, "embed": EMBED, "head": HEAD,
                                             "b_over_f": 1.0, "w_over_f": 1.0},
            "layouts": results, "speedup": gains}


def print_deepseek_v3(result: dict) -> None:
    print(f"\n(3) DeepSeek-V3, 61 layers, PP={DSV3_PP}, interleaved, m={result['num_microbatches']} "
          f"(dense {DENSE}, MoE {MOE}, embed {EMBED}, head {HEAD}; B = W = F)")
    print(f"{'layout':<24}{'vpp':>4}{'max stage':>11}{'max rank':>10}{'step':>9}{'bubble':>9}")
    for name, r in result["layouts"].items():
        print(f"{name:<24}{r['vpp']:>4}{r['max_stage_forward']:>11.2f}{r['max_rank_forward']:>10.2f}"
              f"{r['step_time']:>9.1f}{r['bubble_ratio']:>9.1%}")
    for name, gain in result["speedup"].items():
        print(f"  {name}: {gain:+.1%} step-time gain")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--out", type=Path, help="write all results as JSON to this file")
    parser.add_argument("--microbatches", type=int, default=32,
                        help="microbatches per step for part (3) (a multiple of 8)")
    parser.add_argument("--real", action="store_true",
                        help="also run part (2): real gloo runs vs torch.distributed.pipelining")
    args = parser.parse_args(argv)
    results = {}
    results["simulated_schedules"] = simulated_schedules()
    print_schedule_table(results["simulated_schedules"])
    if args.real:
        import bench_pipeline_real
        results["real_vs_torch"] = bench_pipeline_real.main(["--seq-len", "64", "--steps", "2"])
    results["deepseek_v3_layout"] = deepseek_v3_layout(args.microbatches)
    print_deepseek_v3(results["deepseek_v3_layout"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
