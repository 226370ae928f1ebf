"""`mxgraph inspect DIR`: print a dump's summary, and the op-count difference of two passes."""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from mxgraph.dump import read_summary


def op_counts(entry: Path) -> Counter:
    with open(entry / "nodes.tsv") as f:
        return Counter(row["op"] for row in csv.DictReader(f, delimiter="\t"))


def find_entry(directory: Path, name: str) -> Path:
    matches = [p for p in sorted(directory.iterdir())
               if p.is_dir() and (p.name == name or p.name.split("_", 1)[-1] == name)]
    if not matches:
        known = [p.name for p in sorted(directory.iterdir()) if p.is_dir()]
        raise SystemExit(f"no pass {name!r} in {directory}; entries: {known}")
    return matches[0]


def diff_text(directory: Path, first: str, second: str) -> str:
    a, b = op_counts(find_entry(directory, first)), op_counts(find_entry(directory, second))
    lines = [f"{'op':<60} {first:>12} {second:>12}"]
    for op in sorted(set(a) | set(b)):
        if a[op] != b[op]:
            lines.append(f"{op:<60} {a[op]:>12} {b[op]:>12}")
    if len(lines) == 1:
        lines.append("(same op counts)")
    return "\n".join(lines)


def summary_text(directory: Path) -> str:
    records = read_summary(directory)
    header = f"{'#':>3} {'pass':<22} {'phase':<8} {'nodes':>7} {'GFLOP':>10} " \
             f"{'peak MiB':>9} {'ms':>8}  unknown ops"
    lines = [header]
    for r in records:
        lines.append(f"{r['index']:>3} {r['pass']:<22} {r['phase']:<8} {r['nodes']:>7} "
                     f"{int(r['flops']) / 1e9:>10.4f} {int(r['peak_mem']) / 2**20:>9.2f} "
                     f"{float(r['time_ms']):>8.1f}  {r['unknown_ops']}")
    return "\n".join(lines)


def memory_main(args) -> int:
    """`mxgraph inspect --memory --model NAME [--plan plan.toml]`."""
    import torch

    from mxgraph.memory_plan import estimate_memory, format_table, plot
    from mxgraph.plan import Plan
    if not args.model:
        raise SystemExit("--memory needs --model NAME (a preset, e.g. llama2-70b)")
    plan = Plan.from_toml(args.plan) if args.plan else Plan()
    dtype = getattr(torch, args.dtype)
    stages = estimate_memory(args.model, plan, batch_size=args.batch_size,
                             seq_len=args.seq_len, dtype=dtype)
    print(f"{args.model}  {plan.to_toml().strip().replace(chr(10), '; ') or 'default plan'}")
    print(format_table(stages))
    plot(stages, args.png, title=f"{args.model} ({args.dtype}, mbs={args.batch_size})")
    print(f"bar chart: {args.png}")
    return 0


def main(args) -> int:
    if getattr(args, "memory", False):
        return memory_main(args)
    if not args.dump_dir:
        raise SystemExit("inspect needs a dump directory (or --memory --model NAME)")
    directory = Path(args.dump_dir)
    if not (directory / "summary.txt").exists():
        raise SystemExit(f"{directory} has no summary.txt; was it written by "
                         "Plan(dump_dir=...) or MXGRAPH_DUMP?")
    print(summary_text(directory))
    if args.diff:
        print()
        print(diff_text(directory, *args.diff))
    return 0
