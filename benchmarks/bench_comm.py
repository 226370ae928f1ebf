"""Communication per rank and step, read from the compiled graphs, beside Megatron-LM's formulas.

Part 1. For llama2-7b, llama2-70b and deepseek-v3-671b under several plans,
`mxgraph.comm.comm_report` compiles the step for rank 0 of a paper mesh (meta device,
nothing runs) and reads the bytes each collective kind moves per parallel axis. Beside
each (axis, kind), the analytical volume, a sum of named terms: Megatron-LM's per-layer
formulas plus, with their own formula, the collectives those leave out (vocab-parallel
embedding and cross-entropy, the LM head's input gradient, SP's norm-weight gradients,
the loss average). Rows must agree within 1%: the script prints the rows that do not and
exits 1. Plans asking for a capability not built yet (`mxgraph.plan.NOT_BUILT`, checked at
run time) print "not built" and appear once it lands.

Depth: tracing 32-80 layers takes minutes on the CPU, so each model is traced at a few
layers and scaled per layer kind (the volume is linear in the count of each kind):
llamas at 1 and 2 layers; DeepSeek-V3 at 1 dense + 1 MoE, 2 + 1 and 1 + 2 layers, scaled
to its 3 dense + 58 MoE layers, routed experts as one grouped GEMM
(`expert_impl="grouped_mm"`). `--exact` traces the full depth instead.

DeepSeek-V3 runs without TP: mxgraph's TP layout of MLA and the routed experts is not
Megatron's (its q/kv down-projections are column-parallel, experts stay whole), so no
Megatron formula applies; `mxgraph inspect --comm` shows what that graph moves. CP: K/V
all-gathered per layer (Megatron's ring moves the same bytes); mxgraph gathers them
before the model's GQA repeat, at KV-head width.

Expert parallelism: the rows a rank receives are data-dependent (unbacked sizes); the
report counts them at their upper bound (ep x the rows it sends) unless told otherwise.
The table counts them under balanced routing (each rank receives what it sends, the
assumption of Megatron's formula); the JSON keeps the upper bound beside.

Notation: b micro-batch, s sequence, h width, L layers, V vocabulary, e bytes per element
(bf16: 2), t tp degree; volume convention of collectives.py (one call moves its full
tensor: the all-reduce's tensor, the all-gather's output, the reduce-scatter's and the
all-to-all's input).

Part 2 (skip with `--no-timing`): one training step (forward, backward, gradient
reduction, AdamW) of `--timing-model` (llama-20m) on gloo, 2 processes, tp=2 vs dp=2 at
the same global batch, median ms per step (printed, not asserted).

    python benchmarks/bench_comm.py [--models llama2-7b,llama2-70b,deepseek-v3-671b]
        [--plans tp2,dp8] [--batch-size 1] [--seq-len 4096] [--exact] [--no-timing]
        [--timing-model llama-20m] [--out bench_results/comm.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MODELS = ("llama2-7b", "llama2-70b", "deepseek-v3-671b")
LLAMA_PLANS = {
    "tp2": dict(tp=2), "tp4": dict(tp=4), "tp8": dict(tp=8),
    "tp8 sp": dict(tp=8, sequence_parallel=True),
    "dp8": dict(dp=8), "tp8 dp4": dict(tp=8, dp=4),
    "tp8 dp4 zero1": dict(tp=8, dp=4, zero1=True),
    "tp4 cp2": dict(tp=4, cp=2),
}
MOE_PLANS = {
    "dp8": dict(dp=8), "dp8 zero1": dict(dp=8, zero1=True),
    "ep8 dp8": dict(ep=8, dp=8), "ep4 dp8": dict(ep=4, dp=8),
    "ep4 dp8 zero1": dict(ep=4, dp=8, zero1=True),
}
TOLERANCE = 0.01
_MiB = 2 ** 20


@dataclass
class Term:
    """One analytical contribution: `bytes` on (axis, kind), and the formula in words."""

    axis: str
    kind: str
    bytes: int
    formula: str


# ---- part 1: graph vs formula ---------------------------------------------------------
def not_built(plan) -> list[str]:
    from mxgraph.plan import NOT_BUILT
    return [what for _, asks, what in NOT_BUILT if asks(plan)]


def graph_volume(config, plan, batch: int, seq: int, dtype, exact: bool) -> dict:
    """{(axis, kind): bytes} per rank and step at the config's full depth (see docstring)."""
    import models
    from mxgraph.comm import comm_report

    def balanced(upper: int) -> int:
        # The data-dependent sizes here are the rows an EP rank receives, bounded by
        # ep x (the rows it sends) when every rank routes everything to it. Megatron's
        # formula assumes balanced routing, each rank receiving what it sends: 1/ep of it.
        return upper // plan.ep

    def trace(**overrides) -> dict:
        model = models.build_from_config(dataclasses.replace(config, **overrides),
                                         device="meta", dtype=dtype)
        tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        rows = comm_report(model, plan, (tokens, tokens), unbacked=balanced).rows()
        return {(r["axis"], r["kind"], bound): r[bound] for r in rows
                for bound in ("total", "upper_bound")}

    def combine(base: dict, *steps: tuple[int, dict]) -> dict:
        keys = set(base).union(*(set(d) for _, d in steps))
        return {k: base.get(k, 0) + sum(n * (d.get(k, 0) - base.get(k, 0)) for n, d in steps)
                for k in keys}

    if exact:
        return trace()
    n_dense = getattr(config, "n_dense_layers", None)
    if n_dense:  # dense layers first, then MoE layers
        base = trace(n_layers=2, n_dense_layers=1)
        return combine(base, (n_dense - 1, trace(n_layers=3, n_dense_layers=2)),
                       (config.n_layers - n_dense - 1, trace(n_layers=3, n_dense_layers=1)))
    one = trace(n_layers=1)
    return combine(one, (config.n_layers - 1, trace(n_layers=2)))


def local_param_bytes(config, plan, dtype) -> tuple[int, int]:
    """(non-expert, routed-expert) parameter bytes on one rank by Megatron-LM's layout:
    matrices (embedding, linears, LM head) split over tp, norms whole, routed experts
    split over ep."""
    import models
    model = models.build_from_config(config, device="meta", dtype=dtype)
    dense = expert = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if "experts" in name.split("."):
            expert += n // plan.ep
        elif p.dim() >= 2 and "router" not in name:
            dense += n // plan.tp
        else:
            dense += n
    return dense, expert


def megatron_terms(config, plan, batch: int, seq: int, dtype) -> list[Term]:
    """The analytical volume per rank and step as named terms (see module docstring)."""
    e = torch.finfo(dtype).bits // 8
    b, s, h, L, t = batch, seq // plan.cp, config.dim, config.n_layers, plan.tp
    bsh = b * s * h * e  # s: this rank's part of the sequence under CP
    dp = plan.dp or 1
    terms = []
    if t > 1 and not plan.sequence_parallel:
        terms += [
            Term("tp", "all_reduce", 4 * L * bsh,
                 "4·L·b·s·h·e: per layer, forward all-reduces after attention and MLP, "
                 "backward ones of their inputs' gradients (Megatron)"),
            Term("tp", "all_reduce", bsh,
                 "b·s·h·e: vocab-parallel embedding, forward all-reduce of the partial rows"),
            Term("tp", "all_reduce", bsh,
                 "b·s·h·e: column-parallel LM head, backward all-reduce of its input gradient"),
        ]
    if t > 1 and plan.sequence_parallel:
        terms += [
            Term("tp", "all_gather", 4 * L * bsh,
                 "4·L·b·s·h·e: SP per layer, forward all-gathers before attention and MLP, "
                 "backward ones (conjugates of the reduce-scatters)"),
            Term("tp", "reduce_scatter", 4 * L * bsh,
                 "4·L·b·s·h·e: SP per layer, forward reduce-scatters after attention and "
                 "MLP, backward ones (conjugates of the all-gathers)"),
            Term("tp", "reduce_scatter", 2 * bsh,
                 "2·b·s·h·e: embedding forward reduce-scatter, LM head input backward"),
            Term("tp", "all_gather", 2 * bsh,
                 "2·b·s·h·e: LM head input forward all-gather, embedding backward"),
            Term("tp", "all_reduce", (2 * L + 1) * h * e,
                 "(2L+1)·h·e: gradients of the norm weights, replicated in the SP region"),
        ]
    if t > 1:
        terms.append(Term("tp", "all_reduce", 3 * b * s * 4,
                          "3·b·s·4: vocab-parallel cross-entropy, forward all-reduces of the "
                          "row max, the sum of exponentials and the target logit (fp32)"))
    if plan.cp > 1:
        head_dim = h // config.n_heads
        kv = config.n_kv_heads * head_dim // t  # this rank's K (or V) width
        full = b * seq * e  # per width element, over the whole sequence
        terms += [
            Term("cp", "all_gather", 2 * L * full * kv,
                 "2·L·b·S·kv·e/t: per layer, forward all-gather of K and V over the whole "
                 "sequence S (kv: KV heads x head dim)"),
            Term("cp", "reduce_scatter", 2 * L * full * kv,
                 "2·L·b·S·kv·e/t: per layer, backward reduce-scatter of their gradients"),
            Term("cp", "all_reduce", 4 + 8 + 4,
                 "16: mean cross-entropy over cp, forward all-reduces of the local loss sum "
                 "(fp32) and token count (int64), backward one of the sum's gradient"),
        ]
    if plan.ep > 1:
        n_moe = L - config.n_dense_layers
        rows = b * s * config.topk
        terms += [
            Term("ep", "all_to_all", 4 * n_moe * rows * h * e,
                 "4·L_moe·T·topk·h·e: per MoE layer, dispatch and combine of the routed rows "
                 "forward and backward"),
            Term("ep", "all_to_all", n_moe * config.n_routed_experts * 8,
                 "L_moe·E·8: per MoE layer, the per-expert row counts (int64)"),
        ]
    dense, expert = local_param_bytes(config, plan, dtype)
    # with cp > 1 gradients reduce over dp x cp at once (as Megatron-LM), summing the sequence parts
    cp, suffix = plan.cp, "_cp" if plan.cp > 1 else ""
    groups = [("dp" + suffix, dense + (expert if plan.ep == 1 else 0), dp * cp)]
    if plan.ep > 1:
        groups.append(("edp" + suffix, expert, dp // plan.ep * cp))
    for axis, grads, size in groups:
        if size == 1 or not grads:
            continue
        if plan.zero1:
            terms += [Term(axis, "reduce_scatter", grads,
                           "P·e: ZeRO-1 reduce-scatter of this rank's gradients"),
                      Term(axis, "all_gather", grads,
                           "P·e: ZeRO-1 all-gather of the updated parameters")]
        else:
            terms.append(Term(axis, "all_reduce", grads,
                              "P·e: all-reduce of this rank's gradients"))
    if dp > 1:
        terms.append(Term("dp", "all_reduce", 4, "4: the loss averaged over dp (fp32)"))
    return terms


def compare(graph: dict, terms: list[Term]) -> list[dict]:
    """Rows (axis, kind): graph bytes (and at the upper bound of data-dependent sizes)
    beside the formula's, their ratio, whether within TOLERANCE."""
    formula: dict = {}
    for term in terms:
        formula[(term.axis, term.kind)] = formula.get((term.axis, term.kind), 0) + term.bytes
    rows = []
    for axis, kind in sorted({k[:2] for k in graph} | set(formula)):
        g, f = graph.get((axis, kind, "total"), 0), formula.get((axis, kind), 0)
        ratio = g / f if f else (1.0 if g == 0 else None)  # None: no formula for it
        rows.append({"axis": axis, "kind": kind, "graph_bytes": g, "formula_bytes": f,
                     "graph_upper_bound_bytes": graph.get((axis, kind, "upper_bound"), 0),
                     "ratio": ratio, "ok": ratio is not None and abs(ratio - 1) <= TOLERANCE})
    return rows


def part1(args) -> list[dict]:
    import models
    dtype = getattr(torch, args.dtype)
    results = []
    for name in args.models.split(","):
        config = models.PRESETS[name][1]
        moe = hasattr(config, "n_routed_experts")
        if moe:
            config = dataclasses.replace(config, expert_impl="grouped_mm")
        seq = args.seq_len or config.max_seq_len
        for label, fields in (MOE_PLANS if moe else LLAMA_PLANS).items():
            if args.plans and label not in args.plans:
                continue
            from mxgraph.plan import Plan
            plan = Plan(**fields)
            result = {"model": name, "plan": label, "fields": fields, "batch": args.batch_size,
                      "seq": seq, "depth": "exact" if args.exact else "scaled per layer"}
            missing = not_built(plan)
            if missing:
                results.append({**result, "not_built": missing})
                print(f"{name} {label}: not built ({', '.join(missing)})", file=sys.stderr)
                continue
            start = time.perf_counter()
            graph = graph_volume(config, plan, args.batch_size, seq, dtype, args.exact)
            terms = megatron_terms(config, plan, args.batch_size, seq, dtype)
            result.update(rows=compare(graph, terms), terms=[dataclasses.asdict(t) for t in terms],
                          trace_s=round(time.perf_counter() - start, 1))
            print(f"{name} {label}: {result['trace_s']} s", file=sys.stderr, flush=True)
            results.append(result)
    return results


def print_part1(results: list[dict]) -> list[str]:
    """Print the table; returns the descriptions of the rows that differ."""
    print(f"{'model':<17} {'plan':<14} {'axis':<6} {'kind':<15} {'graph MiB':>12} "
          f"{'formula MiB':>12} {'ratio':>7}  status")
    differ = []
    for r in results:
        head = f"{r['model']:<17} {r['plan']:<14}"
        if "not_built" in r:
            print(f"{head} {'-':<6} {'-':<15} {'':>12} {'':>12} {'':>7}  not built "
                  f"({', '.join(r['not_built'])})")
            continue
        for row in r["rows"]:
            status = "ok" if row["ok"] else "DIFFERS"
            print(f"{head} {row['axis']:<6} {row['kind']:<15} {row['graph_bytes'] / _MiB:>12.2f} "
                  f"{row['formula_bytes'] / _MiB:>12.2f} {_ratio(row['ratio']):>7}  {status}")
            if not row["ok"]:
                differ.append(f"{r['model']} {r['plan']} {row['axis']} {row['kind']}: graph "
                              f"{row['graph_bytes']} B vs formula {row['formula_bytes']} B")
    return differ


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.4f}"


# ---- part 2: gloo step time, tp=2 vs dp=2 -----------------------------------------------
def _time_rank(rank, world, model_name, fields, batch, seq, steps, results):
    import models
    import mxgraph as mx
    torch.manual_seed(0)
    model = models.build_model(model_name)
    plan = mx.Plan(**fields)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=g)
    if plan.tp == 1:  # data parallel: each rank its half of the global batch
        tokens = tokens.chunk(world)[rank]
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    step = mx.compile(model, plan)
    step.prepare(x, y)  # parameters() are this rank's shards from here on
    opt = torch.optim.AdamW(step.parameters(), lr=1e-4)

    def one() -> float:
        start = time.perf_counter()
        step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    one()
    times = [one() for _ in range(steps)]
    if rank == 0:
        results.append({"plan": " ".join(f"{k}={v}" for k, v in fields.items()),
                        "fields": fields,
                        "ms_per_step": statistics.median(times) * 1e3,
                        "per_rank_batch": list(x.shape)})


def part2(args) -> list[dict]:
    import torch.multiprocessing as mp
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
    import models
    from mxgraph.comm import comm_report
    from mxgraph.plan import Plan
    from tests.distributed import run_ranks
    results = mp.get_context("spawn").Manager().list()
    for fields in (dict(tp=2), dict(dp=2)):
        print(f"timing {args.timing_model} {fields} on gloo ...", file=sys.stderr, flush=True)
        run_ranks(2, _time_rank, args.timing_model, fields, args.timing_batch, args.timing_seq,
                  args.timing_steps, results)
    rows = list(results)
    for row in rows:
        model = models.build_model(args.timing_model, device="meta")
        tokens = torch.zeros(row["per_rank_batch"], dtype=torch.long, device="meta")
        row["comm_bytes"] = comm_report(model, Plan(**row["fields"]), (tokens, tokens)).total()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    parser.add_argument("--plans", default=None,
                        help="comma-separated plan labels to run (default all; labels: "
                             f"{', '.join(dict.fromkeys([*LLAMA_PLANS, *MOE_PLANS]))}); "
                             "a model runs those of its family's table")
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch size b")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length s (default: each model's max_seq_len)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--exact", action="store_true",
                        help="trace every layer instead of scaling per layer (slow)")
    parser.add_argument("--no-timing", action="store_true", help="skip part 2 (gloo timing)")
    parser.add_argument("--timing-batch", type=int, default=4,
                        help="global batch of the timed step")
    parser.add_argument("--timing-seq", type=int, default=128,
                        help="sequence length of the timed step")
    parser.add_argument("--timing-steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--timing-model", default="llama-20m",
                        help="llama preset of the timed step (tp=2 must divide its heads)")
    parser.add_argument("--out", default="bench_results/comm.json")
    args = parser.parse_args(argv)
    if args.plans is not None:
        args.plans = args.plans.split(",")
        unknown = [p for p in args.plans if p not in LLAMA_PLANS and p not in MOE_PLANS]
        if unknown:
            parser.error(f"unknown plan label(s) {unknown}")
    results = part1(args)
    differ = print_part1(results)
    timing = [] if args.no_timing else part2(args)
    if timing:
        print(f"\n{args.timing_model} on gloo, 2 processes, global batch {args.timing_batch} x "
              f"{args.timing_seq} tokens (ms per training step, median of "
              f"{args.timing_steps}):")
        for row in timing:
            print(f"  {row['plan']:<6} {row['ms_per_step']:>9.1f} ms   per-rank batch "
                  f"{row['per_rank_batch']}, {row['comm_bytes'] / _MiB:.2f} MiB moved per "
                  f"rank and step (report)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tolerance": TOLERANCE, "comm": results,
                                          "timing": timing, "differ": differ}, indent=2))
    print(f"\nwrote {args.out}")
    if differ:
        print("\ngraph and formula differ by more than 1% in:")
        print("\n".join(f"  {d}" for d in differ))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
