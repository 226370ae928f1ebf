"""The results file (`bench_results/hf_zoo.json`: cells by model type and plan, merged run
after run) and its Markdown report: the architecture x plan table, totals per plan, and the
failures grouped by cause."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

OUTCOMES = ("pass", "refused", "crash", "wrong", "timeout")
EAGER_OUTCOMES = ("pass", "eager fails", "skipped")


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"cells": {}}


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def record(data: dict, model_type: str, plan: str, result: dict) -> None:
    data["cells"].setdefault(model_type, {})[plan] = result


def markdown(data: dict, plans: list[str], models: list[str] | None = None, moe_only=()) -> str:
    """The table (rows: model types; columns: eager, then `plans`; "n/a": a `moe_only` plan
    of a dense model), the totals per plan and the failures grouped by cause."""
    cells = data["cells"]
    models = sorted(cells) if models is None else [m for m in models if m in cells]
    lines = ["| model type | eager | " + " | ".join(plans) + " |",
             "|---|---|" + "---|" * len(plans)]
    for model in models:
        row = cells[model]
        eager = row.get("eager", {}).get("status", "")
        dense = not row.get("eager", {}).get("moe")
        marks = ["n/a" if eager == "pass" and dense and plan in moe_only and plan not in row
                 else _mark(row.get(plan), eager) for plan in plans]
        lines.append(f"| {model} | {_EAGER_MARK.get(eager, eager)} | " + " | ".join(marks) + " |")
    lines += ["", totals(cells, plans, models, moe_only), "", failures(cells, plans, models)]
    return "\n".join(lines)


_EAGER_MARK = {"pass": "pass", "eager fails": "FAILS", "skipped": "skip"}


def _mark(result: dict | None, eager: str) -> str:
    if eager != "pass":
        return "—"
    if result is None:
        return ""
    return {"pass": "pass", "refused": "refused", "crash": "**crash**", "wrong": "**wrong**",
            "timeout": "timeout"}.get(result["status"], result["status"])


def totals(cells: dict, plans: list[str], models: list[str], moe_only=()) -> str:
    """Per plan: how many cells of each outcome (and the models eager excluded; a moe_only
    plan counts MoE models only)."""
    eager = defaultdict(int)
    for model in models:
        eager[cells[model].get("eager", {}).get("status", "not run")] += 1
    lines = ["| plan | " + " | ".join(OUTCOMES) + " | not run | eager fails | skipped |",
             "|---|" + "---|" * (len(OUTCOMES) + 3),
             f"| eager | {eager['pass']} |" + " |" * (len(OUTCOMES) - 1) +
             f" {eager['not run']} | {eager['eager fails']} | {eager['skipped']} |"]
    for plan in plans:
        count = defaultdict(int)
        for model in models:
            status = cells[model].get("eager", {}).get("status")
            if plan in moe_only and status == "pass" and not cells[model]["eager"].get("moe"):
                continue
            if status == "pass":
                count[cells[model].get(plan, {}).get("status", "not run")] += 1
            elif status is not None:
                count[status] += 1
        lines.append(f"| {plan} | " + " | ".join(str(count[o]) for o in OUTCOMES) +
                     f" | {count['not run']} | {count['eager fails']} | {count['skipped']} |")
    return "\n".join(lines)


def failures(cells: dict, plans: list[str], models: list[str]) -> str:
    """Eager failures, crashes, refusals, wrong results and timeouts, grouped by cause."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for model in models:
        row = cells[model]
        eager = row.get("eager", {})
        if eager.get("status") in ("eager fails", "skipped"):
            groups[(eager["status"], _cause(eager))].append(model)
        for plan in plans:
            result = row.get(plan)
            if eager.get("status") == "pass" and result and result["status"] != "pass":
                label = f"{model}/{plan}" + (f" ({result['detail']})" if result["status"] == "wrong" else "")
                groups[(result["status"], _cause(result))].append(label)
            if result and result["status"] == "pass" and result.get("fallbacks"):
                groups[("pass without mxgraph's passes (the backend's loud fallback)",
                        f"`{result['fallbacks'][0][:160]}`")].append(f"{model}/{plan}")
    order = ("crash", "wrong", "timeout", "refused",
             "pass without mxgraph's passes (the backend's loud fallback)", "eager fails", "skipped")
    lines = []
    for status in order:
        found = sorted(((cause, where) for (s, cause), where in groups.items() if s == status),
                       key=lambda item: -len(item[1]))
        if not found:
            continue
        lines.append(f"### {status} ({sum(len(w) for _, w in found)})")
        lines += [f"- {cause} — {len(where)}: {', '.join(where)}" for cause, where in found]
        lines.append("")
    return "\n".join(lines)


def _cause(result: dict) -> str:
    """A crash by its exception and innermost mxgraph frame, a wrong result by what differs."""
    detail = result.get("detail", "")
    if result.get("status") == "wrong":
        detail = ", ".join(sorted({part.split(" ")[0] for part in detail.split("; ") if part})) + " differ"
    elif result.get("status") == "timeout":
        detail = "timeout"
    detail = " ".join(detail.split())[:160]
    where = result.get("mxgraph_at") or result.get("raised_at")
    return f"`{detail}` at {where}" if where else f"`{detail}`"
