"""The project's import graph, read from the source (function-local imports included).

    python -m tests.import_graph            # prints "module -> module" edges, sorted
    python -m tests.import_graph --names    # with the imported names

Its last line lists the import circles ("circles: none" when there are none).

`tests/test_layering.py` checks the layering rules on these edges.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mxgraph", "models")


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    names: tuple[str, ...]  # names taken from it (empty: `import target`)
    line: int
    local: bool  # inside a function or method


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path) -> list[Import]:
    """Every import of a project module in `path` (absolute and relative)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found = []

    def visit(node, local: bool):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        found.append(Import(source, alias.name, (), child.lineno, local))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] not in PACKAGES:
                    continue
                plain = []
                for alias in child.names:  # `from pkg import module` imports a module
                    if _is_module(f"{base}.{alias.name}"):
                        found.append(Import(source, f"{base}.{alias.name}", (), child.lineno,
                                            local))
                    else:
                        plain.append(alias.name)
                if plain:
                    found.append(Import(source, base, tuple(plain), child.lineno, local))
            visit(child, inner)
    visit(tree, False)
    return found


def all_imports() -> list[Import]:
    return [imp for path in source_files() for imp in imports_of(path)]


def cycles(imports: list[Import]) -> list[list[str]]:
    """Every import circle between modules (function-local imports included)."""
    import networkx as nx
    graph = nx.DiGraph((imp.source, imp.target) for imp in imports if imp.source != imp.target)
    return sorted(nx.simple_cycles(graph))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    edges = sorted({(i.source, i.target) + ((i.names,) if "--names" in argv else ())
                    for i in all_imports() if i.source != i.target})
    for edge in edges:
        print(f"{edge[0]} -> {edge[1]}" + (f"  {', '.join(edge[2])}" if len(edge) > 2 and
                                            edge[2] else ""))
    circles = cycles(all_imports())
    print("circles: " + ("; ".join(" -> ".join(c + c[:1]) for c in circles) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
