"""Layering that checks itself: the import rules of DESIGN.md on every module's imports
(function-local ones too: `tests/import_graph.py`), file sizes and line lengths."""
from __future__ import annotations

import tomllib

from tests.import_graph import ROOT, Import, all_imports, cycles, imports_of, source_files

# Layers, lowest first; a module may import its own layer and those below, never above.
# ir knows only torch; the analyses, capture/joint, runtime, codegen and schedules sit on
# it; the passes on those; the driver runs the passes; the public entrances use the driver.
# The application (`mxgraph train` and its CLI) sits above the compiler, in its own order.
ENTRANCES = {"mxgraph", "mxgraph.compile", "mxgraph.step", "mxgraph.step_adaptive",
             "mxgraph.backend", "mxgraph.comm", "mxgraph.memory_plan"}
APPLICATION = ("mxgraph.hf", "mxgraph.data", "mxgraph.train", "mxgraph.cli")
"""The application's packages, lowest first: one may import those before it, never those
after it; no compiler module imports any of them."""
PUBLIC = ("mxgraph", "mxgraph.compile", "mxgraph.step", "mxgraph.plan", "mxgraph.errors",
          "mxgraph.memory_plan", "mxgraph.comm", "mxgraph.dump", "mxgraph.cost",
          "mxgraph.runtime.", "mxgraph.devices.", "mxgraph.search.")
"""What the application may import of the compiler: `mxgraph.compile` and `Plan`, the step,
errors, the memory and communication estimates, dumps, the FLOP rules (`mxgraph.cost`, which
the telemetry's model FLOPs derive from), named runtime modules, device profiles and the
Auto Search; never the passes, codegen, the driver or the IR (a name ending in "." takes its
package's modules)."""
MODELS_ALLOWED = {"mxgraph.memory_plan"}
"""Besides the application, the entrances that build presets by name may import `models`;
the compiler may not."""
LINE_BUDGET = 500
OVER_BUDGET: dict[str, int] = {}
"""Files over the budget today, each held to its present size (none: the sharding core
split shard_tp.py)."""
PACKAGE_ORDER = {
    "mxgraph.passes": ("sharding", "moe", "fusion", "memory", "overlap"),
    "mxgraph.runtime": ("checkpoint", "collectives", "cluster", "monitor", "data_parallel",
                        "pipeline"),
}
"""The sub-packages of `passes/` and `runtime/` by concern, lowest first: one may import the
public names of those before it, never of those after it (so no circle between them), and
never the modules loose in its parent (the driver's steps, runner and pipeline table in
`passes/`; those may import every sub-package)."""


def sub_package(module: str) -> tuple[str, str | None] | None:
    """(parent, sub-package or None for a loose module) of a module of passes/ or runtime/."""
    for parent, order in PACKAGE_ORDER.items():
        if module.startswith(parent + "."):
            name = module[len(parent) + 1:].split(".")[0]
            return parent, name if name in order else None
    return None


def application_package(module: str) -> str | None:
    return next((p for p in APPLICATION if module == p or module.startswith(p + ".")), None)


def is_public(module: str) -> bool:
    return any(module.startswith(p) if p.endswith(".") else module == p for p in PUBLIC)


def layer(module: str) -> int:
    if module.startswith("models"):
        return 5
    if application_package(module):
        return 6 + APPLICATION.index(application_package(module))
    if module in ("mxgraph.ir", "mxgraph.errors"):
        return 0
    if module.startswith("mxgraph.passes"):
        return 2
    if module == "mxgraph.driver":
        return 3
    if module in ENTRANCES or module.startswith("mxgraph.search"):
        return 4
    return 1


def violations(imports: list[Import]) -> list[str]:
    found = []
    for imp in imports:
        where = f"{imp.source}:{imp.line} imports {imp.target}"
        src, dst = imp.source, imp.target
        if dst.startswith("models"):
            if src.startswith("mxgraph") and src not in MODELS_ALLOWED and \
                    not application_package(src):
                found.append(f"{where}: the compiler never imports models (only the "
                             f"application and the entrances {sorted(MODELS_ALLOWED)})")
        elif application_package(dst) and not application_package(src):
            found.append(f"{where}: the compiler never imports the application")
        elif application_package(src) and dst.startswith("mxgraph") and \
                not application_package(dst) and not is_public(dst):
            found.append(f"{where}: the application reaches the compiler through its public "
                         f"surface only ({', '.join(PUBLIC)})")
        elif application_package(src) and application_package(dst) and layer(dst) > layer(src):
            found.append(f"{where}: {application_package(src)} sits below "
                         f"{application_package(dst)} in the application ({', '.join(APPLICATION)})")
        elif src.startswith("mxgraph") and layer(dst) > layer(src):
            found.append(f"{where}: layer {layer(src)} imports layer {layer(dst)}")
        if src.startswith("mxgraph.runtime") and dst.startswith(("mxgraph.codegen", "mxgraph.passes")):
            found.append(f"{where}: runtime never imports codegen or passes")
        if src.startswith("mxgraph.schedules") and not dst.startswith(
                ("mxgraph.schedules", "mxgraph.errors")):
            found.append(f"{where}: schedules are data and know no graph")
        found += sub_package_violations(where, src, dst)
        private = [n for n in imp.names if n.startswith("_")]
        if private:
            found.append(f"{where}: private name(s) {private} across modules")
        last = dst.rsplit(".", 1)[-1]
        if last.startswith("_") and not last.startswith("__") and \
                dst.rsplit(".", 1)[0] != src.rsplit(".", 1)[0]:
            found.append(f"{where}: private module outside its package")
    return found


def sub_package_violations(where: str, src: str, dst: str) -> list[str]:
    src_at, dst_at = sub_package(src), sub_package(dst)
    if src_at is None or dst_at is None or src_at[0] != dst_at[0] or src_at[1] is None or \
            src_at[1] == dst_at[1]:
        return []
    parent, order = src_at[0], PACKAGE_ORDER[src_at[0]]
    if dst_at[1] is None:
        if parent == "mxgraph.passes":
            return [f"{where}: a pass package never imports the driver's modules of passes/"]
        return []
    if order.index(dst_at[1]) > order.index(src_at[1]):
        return [f"{where}: {src_at[1]} sits below {dst_at[1]} in {parent} ({', '.join(order)})"]
    return []


def test_layering_holds():
    assert violations(all_imports()) == []


def test_no_import_circle():
    assert cycles(all_imports()) == []


def test_cycle_check_catches_a_circle():
    """Two hand-written modules, one importing the other inside a function, are a circle."""
    texts = {"mxgraph/hf/bad_a.py": "from mxgraph.hf.bad_b import x\n",
             "mxgraph/hf/bad_b.py": "def f():\n    from mxgraph.hf.bad_a import y\n"}
    paths = [ROOT / relative for relative in texts]
    assert not any(path.exists() for path in paths)
    try:
        for path, text in zip(paths, texts.values(), strict=True):
            path.write_text(text)
        found = cycles([imp for path in paths for imp in imports_of(path)])
        assert [sorted(circle) for circle in found] == [["mxgraph.hf.bad_a", "mxgraph.hf.bad_b"]]
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def test_layering_test_catches_forbidden_imports(tmp_path):
    """Each rule fails on a hand-written module that breaks it (checked as if it lived at
    the path in its name)."""
    cases = {
        "mxgraph/runtime/bad.py": "def f():\n    from mxgraph.passes.memory.remat import remat_pass\n",
        "mxgraph/passes/bad.py": "from mxgraph.driver import compile_step\n",
        "mxgraph/codegen/bad.py": "import models\n",
        "mxgraph/passes/bad2.py": "from mxgraph.passes.sharding.tp import _reads_input\n",
        "mxgraph/schedules/bad.py": "from mxgraph.capture import capture\n",
        "mxgraph/ir_bad.py": "from mxgraph.step import Step\n",
        "mxgraph/passes/sharding/bad.py": "from mxgraph.passes.overlap.reorder import overlap_reorder_pass\n",
        "mxgraph/passes/fusion/bad.py": "from mxgraph.passes.steps import capture_step\n",
        "mxgraph/runtime/collectives/bad.py": "from mxgraph.runtime.pipeline.executor import PipelineExecutor\n",
        "mxgraph/passes/bad3.py": "def f():\n    from mxgraph.hf.models import TINY\n",
        "mxgraph/runtime/bad2.py": "import mxgraph.train.metrics\n",
        "mxgraph/train/bad.py": "from mxgraph.passes.sharding.tp import shard_tp_pass\n",
        "mxgraph/cli/bad.py": "from mxgraph.driver import compile_step\n",
        "mxgraph/hf/bad.py": "from mxgraph.ir import is_alias\n",
        "mxgraph/hf/bad2.py": "from mxgraph.data.packed import PackedBatches\n",
        "mxgraph/data/bad.py": "def f():\n    from mxgraph.train.config import TrainConfig\n",
        "mxgraph/train/bad2.py": "from mxgraph.cli.main import main\n",
    }
    for relative, text in cases.items():
        path = ROOT / relative
        assert not path.exists()
        try:
            path.write_text(text)
            assert violations(imports_of(path)), relative
        finally:
            path.unlink()


def test_file_sizes_and_line_lengths():
    with open(ROOT / "pyproject.toml", "rb") as f:
        line_length = tomllib.load(f)["tool"]["ruff"]["line-length"]
    too_long, too_big = [], []
    for path in source_files() + sorted((ROOT / "tests").rglob("*.py")) + \
            sorted((ROOT / "benchmarks").glob("*.py")):
        relative = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        if len(lines) > OVER_BUDGET.get(relative, LINE_BUDGET):
            too_big.append(f"{relative}: {len(lines)} lines")
        too_long += [f"{relative}:{i}" for i, line in enumerate(lines, 1) if len(line) > line_length]
    assert too_big == [], f"over the {LINE_BUDGET}-line budget: split them"
    assert too_long == [], f"lines over {line_length} characters"
