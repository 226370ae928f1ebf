"""Dumps: after every pass, the generated code, a node table and one summary line.

Layout of a dump directory:
    summary.txt             one line per pass: index, name, nodes, FLOPs, peak memory, time
    NN_<pass>/code.py       the graph as the Python code that runs it
    NN_<pass>/nodes.tsv     op, shape, dtype, bytes, flops, layer, module, created_by
"""
from __future__ import annotations

from pathlib import Path

import torch

from mxgraph.cost import node_cost, tensor_meta, value_bytes


def node_rows(gm: torch.fx.GraphModule) -> list[list[str]]:
    rows = [["name", "op", "shape", "dtype", "bytes", "flops", "layer", "stage", "module",
             "tags", "created_by"]]
    for node in gm.graph.nodes:
        tensors = tensor_meta(node.meta.get("val"))
        custom = node.meta.get("custom") or {}
        rows.append([
            node.name,
            node.op if node.op != "call_function" else str(node.target),
            ";".join(str(list(t.shape)) for t in tensors),
            ";".join(str(t.dtype).removeprefix("torch.") for t in tensors),
            str(value_bytes(node)),
            str(node_cost(node).flops),
            str(custom.get("layer", "")),
            str(custom.get("stage", "")),
            str(custom.get("module", "")),
            ",".join(custom.get("tags", ())),
            str(node.meta.get("created_by", "")),
        ])
    return rows


def write_dump(directory: Path, index: int, name: str,
               graphs: list[tuple[str, torch.fx.GraphModule]], summary_line: str) -> None:
    """One entry for a step: the code of each graph it left (under a `# ---- label`
    line when there are several) and their nodes (names prefixed `label:`)."""
    entry = directory / f"{index:02d}_{name}"
    entry.mkdir(parents=True, exist_ok=True)
    several = len(graphs) > 1
    code, rows = [], []
    for label, gm in graphs:
        code.append(f"# ---- {label}\n{gm.code}" if several else gm.code)
        table = node_rows(gm)
        rows += ([] if rows else table[:1]) + [
            [f"{label}:{r[0]}" if several else r[0]] + r[1:] for r in table[1:]]
    (entry / "code.py").write_text("\n".join(code))
    (entry / "nodes.tsv").write_text("\n".join("\t".join(r) for r in rows) + "\n")
    with open(directory / "summary.txt", "a") as f:
        f.write(summary_line + "\n")


def read_summary(directory: str | Path) -> list[dict]:
    """Parse summary.txt back into records (key=value fields after index and name)."""
    records = []
    for line in Path(directory, "summary.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        record = {"index": int(parts[0]), "pass": parts[1]}
        for part in parts[2:]:
            key, _, value = part.partition("=")
            record[key] = value
        records.append(record)
    return records
