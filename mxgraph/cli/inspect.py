"""`mxgraph inspect DIR`: print a dump's summary (communication included), and the op-count
difference of two passes; `--memory` and `--comm` estimate a preset under a plan;
`--overlap TRACE` reads a profiler trace's communication-compute overlap."""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from mxgraph.dump import read_summary
from mxgraph.errors import UserError


def add_inspect_parser(commands, parents) -> None:
    """Register `inspect` on the CLI's subparsers."""
    inspect = commands.add_parser("inspect", parents=parents,
                                  help="summarise a dump directory, estimate memory "
                                  "(--memory) or communication (--comm) per rank, or read "
                                  "a profiler trace's overlap (--overlap)")
    inspect.add_argument("dump_dir", nargs="?", help="directory written by Plan(dump_dir=...)")
    inspect.add_argument("--memory", action="store_true",
                         help="estimate memory per pipeline rank for --model under --plan "
                              "(meta device, nothing allocated): table + bar chart PNG")
    inspect.add_argument("--comm", action="store_true",
                         help="bytes per collective kind and parallel axis per rank and step "
                              "for --model under --plan, read from the graphs compiled on a "
                              "paper mesh (meta device, nothing runs); set dp in the plan")
    inspect.add_argument("--model", help="preset name for --memory/--comm (e.g. llama2-70b)")
    inspect.add_argument("--plan", help="plan TOML file for --memory/--comm (default: Plan())")
    inspect.add_argument("--batch-size", type=int, default=1,
                         help="micro-batch size (--memory), batch size (--comm)")
    inspect.add_argument("--seq-len", type=int, default=None,
                         help="sequence length (--memory/--comm; default: the model's "
                              "max_seq_len)")
    inspect.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                         help="parameter dtype (--memory/--comm; default: that of the plan's "
                         "precision, else bfloat16)")
    inspect.add_argument("--layers", type=int, default=None,
                         help="trace this many layers instead of the preset's (--comm)")
    inspect.add_argument("--overlap", metavar="TRACE",
                         help="communication vs compute in a profiler trace (a file, or the "
                              "directory of mxgraph train --profile DIR): per collective "
                              "kind the count, comm ms, exposed ms (compute lane idle) and "
                              "the hidden fraction; --png OUT.png draws the timeline")
    inspect.add_argument("--png", default=None,
                         help="bar chart path (--memory; default memory.png), timeline path "
                              "(--overlap; default: none)")
    inspect.add_argument("--diff", nargs=2, metavar=("PASS_A", "PASS_B"),
                         help="show which ops two passes' graphs differ in")
    inspect.set_defaults(run=main)


def op_counts(entry: Path) -> Counter:
    with open(entry / "nodes.tsv") as f:
        return Counter(row["op"] for row in csv.DictReader(f, delimiter="\t"))


def find_entry(directory: Path, name: str) -> Path:
    matches = [p for p in sorted(directory.iterdir())
               if p.is_dir() and (p.name == name or p.name.split("_", 1)[-1] == name)]
    if not matches:
        known = [p.name for p in sorted(directory.iterdir()) if p.is_dir()]
        raise UserError(f"no pass {name!r} in {directory}; --diff takes two of: "
                        f"{', '.join(known)} (or the names after the NN_ prefix)")
    return matches[0]


def diff_text(directory: Path, first: str, second: str) -> str:
    entries = [find_entry(directory, first), find_entry(directory, second)]  # both named
    a, b = op_counts(entries[0]), op_counts(entries[1])
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
             f"{'peak MiB':>9} {'comm MiB':>9} {'ms':>8}  unknown ops"
    lines = [header]
    for r in records:
        comm = sum(int(v) for k, v in r.items() if k.startswith("comm_"))
        lines.append(f"{r['index']:>3} {r['pass']:<22} {r['phase']:<8} {r['nodes']:>7} "
                     f"{int(r['flops']) / 1e9:>10.4f} {int(r['peak_mem']) / 2**20:>9.2f} "
                     f"{comm / 2**20:>9.2f} {float(r['time_ms']):>8.1f}  {r['unknown_ops']}")
    return "\n".join(lines)


def comm_totals_text(directory: Path) -> str:
    """The graph collectives of the last pass, bytes per kind (summary.txt's comm_*)."""
    last = read_summary(directory)[-1]
    kinds = {k.removeprefix("comm_"): int(v) for k, v in last.items() if k.startswith("comm_")}
    if not kinds:
        return "(no comm_* fields in summary.txt: written by an older mxgraph)"
    return f"collectives in the graph after {last['pass']} (MiB): " + ", ".join(
        f"{kind} {value / 2**20:.2f}" for kind, value in kinds.items())


def memory_main(args) -> int:
    """`mxgraph inspect --memory --model NAME [--plan plan.toml]`."""
    import torch

    from mxgraph.memory_plan import estimate_memory, format_table, plot
    _, plan = _model_and_plan(args, "--memory", "llama2-70b")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    stages = estimate_memory(args.model, plan, batch_size=args.batch_size,
                             seq_len=args.seq_len, dtype=dtype)
    print(f"{args.model}  {plan.to_toml().strip().replace(chr(10), '; ') or 'default plan'}")
    print(format_table(stages))
    png = args.png or "memory.png"
    plot(stages, png, title=f"{args.model} ({plan.precision or args.dtype or 'bfloat16'}, "
                            f"mbs={args.batch_size})")
    print(f"bar chart: {png}")
    return 0


def comm_main(args) -> int:
    """`mxgraph inspect --comm --model NAME [--plan plan.toml]`: compile on a paper mesh
    (meta device, nothing runs) and print the communication per axis and kind."""
    import dataclasses

    import torch

    import models
    from mxgraph.comm import comm_report
    from mxgraph.plan import Plan
    spec, plan = _model_and_plan(args, "--comm", "llama2-7b")
    config = spec.config
    if args.layers:
        config = dataclasses.replace(config, n_layers=args.layers)
    dtype = args.dtype or "bfloat16"
    model = models.build_from_config(config, device="meta", dtype=getattr(torch, dtype))
    tokens = torch.zeros(args.batch_size, args.seq_len or config.max_seq_len,
                         dtype=torch.long, device="meta")
    report = comm_report(model, plan, (tokens, tokens))
    layers = f", {config.n_layers} layers" if args.layers else ""
    default = Plan().to_dict()
    changed = [f"{k}={v}" for k, v in plan.to_dict().items() if v != default[k]]
    print(f"{args.model}{layers}, batch {tuple(tokens.shape)}, {dtype}: "
          f"Plan({', '.join(changed)})")
    print(report.table())
    return 0


def overlap_main(args) -> int:
    """`mxgraph inspect --overlap TRACE [--png OUT.png]`: the overlap table of each trace
    (TRACE, or the rank*.json in it), and their timeline."""
    from mxgraph.train.overlap_report import format_table, overlap_summary, plot_timeline, trace_files
    paths = trace_files(args.overlap)
    for i, path in enumerate(paths):
        print(("\n" if i else "") + format_table(overlap_summary(path)))
    if args.png:
        plot_timeline(paths, args.png)
        print(f"timeline: {args.png}")
    return 0


def _model_and_plan(args, flag: str, example: str):
    """`--model` resolved (`resolve_model`) and the plan of `--plan` (default Plan());
    UserError unless `--model` names a preset."""
    from mxgraph.plan import Plan
    from mxgraph.train.model_spec import resolve_model
    if not args.model:
        raise UserError(f"{flag} needs --model NAME (a preset, e.g. {example})")
    spec = resolve_model(args.model, command=f"inspect {flag}")
    return spec, Plan.from_toml(args.plan) if args.plan else Plan()


def main(args) -> int:
    if getattr(args, "memory", False):
        return memory_main(args)
    if getattr(args, "comm", False):
        return comm_main(args)
    if getattr(args, "overlap", None):
        return overlap_main(args)
    if not args.dump_dir:
        raise UserError("inspect needs a dump directory (mxgraph inspect DIR), --memory "
                        "or --comm with --model NAME, or --overlap TRACE")
    directory = Path(args.dump_dir)
    if not directory.exists():
        raise UserError(f"dump directory {directory} does not exist; write one with "
                        "Plan(dump_dir=...) or MXGRAPH_DUMP=DIR, then inspect it")
    if not (directory / "summary.txt").exists():
        raise UserError(f"{directory} has no summary.txt; was it written by "
                        "Plan(dump_dir=...) or MXGRAPH_DUMP?")
    diff = diff_text(directory, *args.diff) if args.diff else None  # bad names: no output
    print(summary_text(directory))
    print(comm_totals_text(directory))
    if (directory / "comm.txt").exists():
        print((directory / "comm.txt").read_text().rstrip())
    if diff:
        print()
        print(diff)
    return 0
