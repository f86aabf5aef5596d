"""The package's shape: the ``fxprof`` command loads without torch, no import cycle between the package's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "fxprof_lightning"


def test_reading_runs_loads_no_torch():
    """``fxprof report``/``compare`` read CSV and JSON files: starting them must not pay for importing torch."""
    code = ("import sys, fxprof_lightning.cli, fxprof_lightning.runs\n"
            "print(sorted(m for m in ('torch', 'lightning', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _imports(path: Path) -> set[str]:
    """The package modules a module imports at its top level (imports inside functions are lazy by intent)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxprof_lightning."):
            names.add(node.module.split(".", 1)[1])
    return names


def test_no_import_cycle():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for imported in graph.get(name, ()):
            visit(imported, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())
