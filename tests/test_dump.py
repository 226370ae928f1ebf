"""Dumps: one entry per pass plus summary.txt; disabling a pass removes it; inspect CLI."""
import torch

import models
import mxgraph as mx
from mxgraph.cli.main import main as cli_main
from mxgraph.dump import read_summary
from mxgraph.passes.pipeline import PIPELINE
from tests.helpers import batch


def compile_with_dump(directory, disable=()):
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=1)
    step = mx.compile(model, mx.Plan(dump_dir=str(directory), disable_passes=disable))
    step(*batch(seq_len=8))
    return read_summary(directory)


def test_dump_has_an_entry_per_pass(tmp_path):
    records = compile_with_dump(tmp_path)
    names = [r["pass"] for r in records]
    assert names == [s.name for s in PIPELINE]  # one stage: one entry per step
    for r in records:
        entry = tmp_path / f"{r['index']:02d}_{r['pass']}"
        assert "def forward" in (entry / "code.py").read_text()
        header = (entry / "nodes.tsv").read_text().splitlines()[0].split("\t")
        assert header[:6] == ["name", "op", "shape", "dtype", "bytes", "flops"]
        assert int(r["nodes"]) > 0 and int(r["peak_mem"]) > 0
    assert (tmp_path / "step_code.py").exists()
    assert records[-1]["unknown_ops"] == "-"  # every op in the llama step has a cost rule


def test_disabling_a_pass_removes_it(tmp_path):
    records = compile_with_dump(tmp_path, disable=("remove_noop_joint",))
    assert "remove_noop_joint" not in [r["pass"] for r in records]
    assert "dead_code" in [r["pass"] for r in records]


def test_env_var_turns_dumps_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MXGRAPH_DUMP", str(tmp_path))
    torch.manual_seed(0)
    step = mx.compile(models.build_model("llama-tiny", n_layers=1))
    step(*batch(seq_len=8))
    assert (tmp_path / "summary.txt").read_text().count("\n") == len(PIPELINE)


def created_by(entry) -> list[str]:
    rows = [line.split("\t") for line in entry.read_text().splitlines()]
    column = rows[0].index("created_by")
    return [row[column] for row in rows[1:]]


def test_provenance_marks_created_nodes(tmp_path):
    torch.manual_seed(0)
    step = mx.compile(models.build_model("llama-tiny", n_layers=1),
                      mx.Plan(dump_dir=str(tmp_path), fusion=True))
    step(*batch(seq_len=8))
    entries = {p.name.split("_", 1)[1]: p / "nodes.tsv" for p in tmp_path.iterdir() if p.is_dir()}
    fused = created_by(entries["fuse"])
    assert fused.count("fuse") >= 4  # rmsnorm x3, rope, gqa, swiglu, loss: each a new node
    # remove_noop erases nodes and creates none: nothing may claim it created a node
    assert "remove_noop" not in created_by(entries["remove_noop"])


def test_inspect_prints_summary_and_diff(tmp_path, capsys):
    compile_with_dump(tmp_path)
    assert cli_main(["inspect", str(tmp_path), "--diff", "capture", "dead_code"]) == 0
    out = capsys.readouterr().out
    assert "remove_noop" in out and "aten.linear.default" in out and "aten.mm.default" in out
