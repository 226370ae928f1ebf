"""Auto Search against published GPU training runs: predicted vs published tokens/s/GPU.

Every row of `published_runs.toml` (beside this file; its header says what a row holds) is
predicted with `mxgraph.search.predict.predict` - no measuring, prediction only - for the
row's model, device profile, GPU count, batch, sequence length and layout as published (a
row trained in fp8 gets its layers' GEMMs at the profile's FP8 rate: `Setting.fp8`). One
table: what, layout, published and predicted tokens/s/GPU and the error; then the median
and max |error|, the rows within 15%, and per family (rows of one source that vary the
layout at a fixed model) whether the predicted order of its rows is the published one
(Spearman of the two, and "same" when the rankings are equal).

The rows are a check: no device-profile number may be fitted to them (issue #31). The
JSON keeps, per row, the prediction's parts too: step time and its breakdown by component
(`predict.BREAKDOWN`), bubble, exposed communication, peak memory, and MFU (3 x the traced
forward FLOPs, attention as traced, recompute not counted, / (step time x GPUs x the
profile's dense peak)).

    python benchmarks/bench_search_published.py [--run "MPT-7B, 8 H100" --run ...]
        [--file benchmarks/published_runs.toml] [--out bench_results/search_published.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import tomllib

RUNS_FILE = Path(__file__).resolve().parent / "published_runs.toml"
ROW_KEYS = {"what": str, "source": str, "family": str, "model": (str, dict), "device": str,
            "gpus": int, "global_batch": int, "seq_len": int, "precision": str,
            "published_tokens_per_s_per_gpu": (int, float), "layout": dict}
"""The fields of a [[run]] and their types (all required)."""
OPTIONAL_KEYS = {"mtp_layers": int, "fsdp": bool, "node_dispatch": bool, "attention_kernel": str}
"""Fields a [[run]] may set: `mtp_layers`, the multi-token-prediction modules the run trains
(`Setting.mtp_layers`; default 0); `fsdp`, parameters and gradients sharded as FSDP / ZeRO-3
shards them (`Setting.fsdp`; default false); `node_dispatch`, the expert all-to-all sends a
token once per node (DeepEP; `Setting.node_dispatch`; default false); `attention_kernel`,
the fused attention kernel the run used when not the profile's default
(`Setting.attention_kernel`, e.g. "fa2")."""
LAYOUT_KEYS = {"tp", "pp", "vpp", "ep", "cp", "sequence_parallel", "zero1", "recompute",
               "schedule", "overlap", "bucket_mb", "mbs", "a2a_overlap", "passes"}
"""The fields a [run.layout] may set: Plan fields, `mbs`, `a2a_overlap` and `passes`."""
WITHIN = 0.15
"""The error the summary counts rows within (the issue's median target)."""


def load_runs(path: Path | str = RUNS_FILE) -> list[dict]:
    """The [[run]] tables of `path`, each checked for its fields and their types (ValueError
    naming the row and the field)."""
    runs = tomllib.loads(Path(path).read_text())["run"]
    for i, run in enumerate(runs):
        name = run.get("what", f"run {i}")
        for key, kind in {**ROW_KEYS, **OPTIONAL_KEYS}.items():
            if key not in run:
                if key in ROW_KEYS:
                    raise ValueError(f"{path}: {name!r} misses {key!r}")
                continue
            if not isinstance(run[key], kind) or (isinstance(run[key], bool) and kind is not bool):
                raise ValueError(f"{path}: {name!r}: {key} = {run[key]!r} has the wrong type")
        unknown = set(run) - set(ROW_KEYS) - set(OPTIONAL_KEYS) or set(run["layout"]) - LAYOUT_KEYS
        if unknown:
            raise ValueError(f"{path}: {name!r}: unknown field(s) {sorted(unknown)}")
        if "mbs" not in run["layout"]:
            raise ValueError(f"{path}: {name!r}: [run.layout] misses mbs")
    names = [run["what"] for run in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: two rows share a name: {sorted(n for n in names if names.count(n) > 1)}")
    return runs


def model_config(run: dict, library):
    """The models config of a row: a preset, or its [run.model] table."""
    from mxgraph.search.model_spec import model_from_dict
    if isinstance(run["model"], str):
        return library.preset_config(run["model"])
    return model_from_dict(run["model"], f"published run {run['what']!r} [run.model]", library)


def plan_of(run: dict):
    """(Plan, micro-batch size, dp) of a row: dp = gpus / (tp pp cp), micro_batches =
    global_batch / dp / mbs; ValueError when they do not divide."""
    from mxgraph.plan import Plan
    layout = dict(run["layout"])
    mbs = layout.pop("mbs")
    a2a_overlap = layout.pop("a2a_overlap", False)
    passes = layout.pop("passes", 1)
    model_ranks = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    dp, rest = divmod(run["gpus"], model_ranks)
    if rest or run["global_batch"] % (dp * mbs * passes) or dp % layout.get("ep", 1):
        raise ValueError(f"{run['what']!r}: {run['gpus']} GPUs, tp x pp x cp = {model_ranks}, "
                         f"ep {layout.get('ep', 1)}, batch {run['global_batch']}, mbs {mbs} and "
                         f"passes {passes} do not divide")
    plan = Plan(**layout, dp=dp, micro_batches=run["global_batch"] // passes // dp // mbs)
    if a2a_overlap:
        plan = dataclasses.replace(plan, moe=dataclasses.replace(plan.moe, a2a_overlap=True))
    plan.validate(run["gpus"])
    return plan, mbs, dp


def layout_text(run: dict, dp: int) -> str:
    """A compact layout: 'tp8 pp2 dp48 sp zero1 full mbs1 x4'."""
    layout = run["layout"]
    parts = [f"{axis}{layout[axis]}" for axis in ("tp", "pp", "vpp", "cp", "ep")
             if layout.get(axis, 1) > 1]
    parts.insert(2 if layout.get("pp", 1) > 1 else 1 if layout.get("tp", 1) > 1 else 0, f"dp{dp}")
    parts += [flag for flag, on in (("sp", layout.get("sequence_parallel")),
                                    ("zero1", layout.get("zero1"))) if on]
    if layout.get("schedule", "1f1b") != "1f1b" and layout.get("pp", 1) > 1:
        parts.append(layout["schedule"])
    if layout.get("recompute"):
        parts.append(layout["recompute"])
    passes = layout.get("passes", 1)
    micro_batches = run["global_batch"] // passes // dp // layout["mbs"]
    parts.append(f"mbs{layout['mbs']}x{micro_batches}" + (f"x{passes}" if passes > 1 else ""))
    return " ".join(parts)


def predict_run(run: dict, library) -> dict:
    """Predict one row; the result row the table and JSON print."""
    from mxgraph.devices.catalog import load_device
    from mxgraph.search.predict import predict
    from mxgraph.search.setting import Setting
    plan, mbs, dp = plan_of(run)
    passes = run["layout"].get("passes", 1)
    setting = Setting(model_config(run, library), load_device(run["device"]), run["gpus"],
                      run["global_batch"] // passes, run["seq_len"], library,
                      fp8=run["precision"] == "fp8", mtp_layers=run.get("mtp_layers", 0),
                      fsdp=run.get("fsdp", False),
                      node_dispatch=run.get("node_dispatch", False),
                      attention_kernel=run.get("attention_kernel", ""))
    started = time.perf_counter()
    p = repeat_passes(predict(setting, plan, mbs), passes)
    published = run["published_tokens_per_s_per_gpu"]
    fields = {**{k: v for k, v in run["layout"].items() if k != "mbs"}, "dp": dp,
              "micro_batches": plan.micro_batches}
    return {"what": run["what"], "family": run["family"], "device": run["device"],
            "precision": run["precision"], "layout": layout_text(run, dp), "plan": fields,
            "micro_batch_size": mbs, "published_tokens_per_s_per_gpu": published,
            "predicted_tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "error": p.tokens_per_s_per_gpu / published - 1, "predicted_mfu": p.mfu,
            "predicted_step_s": p.step_s, "bubble": p.bubble,
            "exposed_comm_s": p.exposed_comm_s, "peak_memory_gib": p.peak_memory_gib,
            "breakdown_s": p.breakdown_s,
            "predict_s": round(time.perf_counter() - started, 2), "source": run["source"]}


def repeat_passes(prediction, passes: int):
    """A step of `passes` pipeline passes from the prediction of one (a step of the global
    batch / passes): every part but the optimizer `passes` times; tokens/s/GPU and MFU are
    the same work over the longer step. Gradient accumulation around the pipeline schedule,
    as AutoModel's and torchtitan's pipelines run a local batch larger than the schedule's
    micro-batches: each pass fills and drains the pipeline, and FSDP gathers its units and
    reduce-scatters their gradients in each (the units reshard after a pass's last backward)."""
    if passes == 1:
        return prediction
    optimizer = prediction.parts_s["optimizer"]
    step = passes * (prediction.step_s - optimizer) + optimizer
    scale = passes * prediction.step_s / step
    return dataclasses.replace(
        prediction, step_s=step, tokens_per_s_per_gpu=prediction.tokens_per_s_per_gpu * scale,
        mfu=prediction.mfu * scale, exposed_comm_s=prediction.exposed_comm_s * passes,
        parts_s={k: v if k == "optimizer" else v * passes for k, v in prediction.parts_s.items()},
        breakdown_s={k: v if k == "optimizer" else v * passes
                     for k, v in prediction.breakdown_s.items()})


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman rank correlation (None under two values; ties ranked by position)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out
    n = len(xs)
    if n < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def family_orders(rows: list[dict]) -> dict[str, dict]:
    """Per family of two or more rows: the published and the predicted order (fastest
    first), their Spearman, and whether the orders are the same."""
    out = {}
    for family in dict.fromkeys(r["family"] for r in rows):
        members = [r for r in rows if r["family"] == family]
        if len(members) < 2:
            continue
        published = [r["published_tokens_per_s_per_gpu"] for r in members]
        predicted = [r["predicted_tokens_per_s_per_gpu"] for r in members]

        def order(values, members=members):
            return [members[i]["what"] for i in sorted(range(len(values)), key=lambda i: -values[i])]
        out[family] = {"published_order": order(published), "predicted_order": order(predicted),
                       "spearman": spearman(published, predicted),
                       "same_order": order(published) == order(predicted)}
    return out


def summary_of(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    families = family_orders(rows)
    return {"rows": len(rows), "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors), "within_15pct": sum(e <= WITHIN for e in errors),
            "families": families,
            "families_in_order": sum(f["same_order"] for f in families.values())}


def print_table(rows: list[dict], summary: dict) -> None:
    width = max(len(r["what"]) for r in rows)
    layout_width = max(len(r["layout"]) for r in rows)
    device_width = max(len(r["device"]) for r in rows)
    print(f"{'run':<{width}}  {'device':<{device_width}} {'layout':<{layout_width}}  {'published':>9} "
          f"{'predicted':>9} {'error':>7}")
    for r in rows:
        print(f"{r['what']:<{width}}  {r['device']:<{device_width}} {r['layout']:<{layout_width}}  "
              f"{r['published_tokens_per_s_per_gpu']:>9.1f} "
              f"{r['predicted_tokens_per_s_per_gpu']:>9.1f} {r['error']:>+7.1%}")
    print(f"tokens/s/GPU over {summary['rows']} rows: median |error| "
          f"{summary['median_abs_error']:.1%}, max |error| {summary['max_abs_error']:.1%}, "
          f"within {WITHIN:.0%}: {summary['within_15pct']}/{summary['rows']}")
    for family, f in summary["families"].items():
        rho = "n/a" if f["spearman"] is None else f"{f['spearman']:+.2f}"
        print(f"family {family}: order {'same' if f['same_order'] else 'DIFFERENT'} "
              f"(Spearman {rho}); published {' > '.join(f['published_order'])}; predicted "
              f"{' > '.join(f['predicted_order'])}")


def predict_rows(runs: list[dict]) -> list[dict]:
    import models
    return [predict_run(run, models) for run in runs]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", default=str(RUNS_FILE), help="the published runs (TOML)")
    parser.add_argument("--run", action="append", default=None, dest="runs",
                        help="a row's name (`what`) to predict; repeat for more (default: all)")
    parser.add_argument("--out", default="bench_results/search_published.json")
    args = parser.parse_args(argv)
    runs = load_runs(args.file)
    if args.runs is not None:
        unknown = sorted(set(args.runs) - {run["what"] for run in runs})
        if unknown:
            parser.error(f"unknown run(s) {unknown}; rows: {', '.join(r['what'] for r in runs)}")
        runs = [run for run in runs if run["what"] in args.runs]
    started = time.perf_counter()
    rows = predict_rows(runs)
    summary = summary_of(rows)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print_table(rows, summary)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"file": str(args.file), "rows": rows,
                                          "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
