"""The package's shape: the ``fxprof`` command loads without torch, no import cycle between the package's modules."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "fxprof_lightning"


def test_reading_runs_loads_no_torch():
    """``fxprof report``/``compare`` read CSV and JSON files: starting them must not pay for importing torch."""
    code = ("import sys, fxprof_lightning.cli, fxprof_lightning.outputs.runs, fxprof_lightning.outputs.html_report\n"
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


def _module(path: Path) -> str:
    """``capture/dynamo.py`` -> ``capture.dynamo`` (a folder's ``__init__.py`` -> the folder)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle():
    graph = {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}
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


# Over the limits below, each with the size it may not pass while it waits (none now).
WAITING: dict[str, int] = {}


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_over_250_lines_and_no_file_over_600():
    """A class past 250 lines, or a file past 600, holds more than one job: split it (as DynamoTimer was, into
    capture and timing, and the engine's file, into core, stage, ranks and settings)."""
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        sizes[_module(path)] = len(text.splitlines())
        sizes |= {f"{_module(path)}:{node.name}": _lines(node) for node in ast.walk(ast.parse(text))
                  if isinstance(node, ast.ClassDef)}
    too_long = [f"{name} ({size} lines)" for name, size in sizes.items()
                if size > WAITING.get(name, 250 if ":" in name else 600)]
    stale = [f"{name} ({limit} lines)" for name, limit in WAITING.items() if name not in sizes or sizes[name] < limit]
    assert not too_long
    assert not stale, "smaller than WAITING says: lower its entry (or drop it when under the limit)"


def test_the_engine_never_asks_which_timer_it_has():
    """The engine talks to timers through ``timers.Timer`` only: no timer class is imported into it."""
    imported = {alias.name for node in ast.walk(ast.parse((PACKAGE / "engine" / "core.py").read_text()))
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not imported & {"NodeTimer", "GuardedNodeTimer", "DynamoTimer", "KernelTimer", "ModuleHookTimer"}


def test_each_folder_holds_one_room():
    """The folders are the rooms of docs/architecture.md: what a module imports at top level comes from its own
    folder, a folder below it (capture -> timing; outputs -> analysis; the engine -> all of them) or the vocabulary
    at the top."""
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"capture", "timing", "analysis", "outputs", "engine"}
    below = {"capture": {"capture", "timing"}, "timing": {"timing"}, "analysis": {"analysis"},
             "outputs": {"outputs", "analysis"}, "engine": {"engine", "capture", "timing", "analysis", "outputs"}}
    vocabulary = {"nodes", "rows", "report", "layout", "schedule"}
    wrong = [f"{_module(p)} imports {name}" for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE
             for name in _imports(p) if name.split(".")[0] not in below[p.parent.name] | vocabulary]
    assert not wrong


def test_every_warning_of_the_package_is_an_fxprof_warning():
    """One category for all of the package's warnings: users filter them as one, and this suite makes them errors
    unless a test expects them (``helpers.notices``)."""
    plain = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("warnings.warn", "rank_zero_warn"):
                given = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "category")]
                if not any(ast.unparse(g) == "FxprofWarning" for g in given):
                    plain.append(f"{_module(path)}:{node.lineno}")
    assert not plain


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


AUTOGRAD_NODE_PRIVATE = re.compile(r"_sequence_nr|_raw_saved_\w+")  # an autograd node's private method, attributes


def _torch_private_names(source: str) -> list[str]:
    """The private torch names a module's code touches: an attribute of torch (``torch._C``,
    ``torch.autograd._get_sequence_nr``; a name imported from torch, ``nn`` or ``fx``, counts as torch), an import of
    one (``from torch.utils._pytree import tree_map``, ``from torch.fx._symbolic_trace import _assert_is_none``), an
    autograd node's private method (``grad_fn._sequence_nr()``, whatever holds the node) or
    a string beside a torch object in a call or tuple (``getattr(torch.nn.functional, "_check_key_padding_mask")``,
    ``(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator")``). Comments and docstrings are not code; a
    string naming a module (``nodes.describe_target`` reads a target's ``__module__``) is no lookup."""
    tree = ast.parse(source)
    roots, found = {"torch"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    roots.add(alias.asname or "torch")
                    found += [alias.name] if any(map(_private, alias.name.split("."))) else []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            roots.update(alias.asname or alias.name for alias in node.names)
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if any(map(_private, [*node.module.split("."), alias.name]))]

    def of_torch(expression: ast.AST) -> bool:
        while isinstance(expression, ast.Attribute):
            expression = expression.value
        return isinstance(expression, ast.Name) and expression.id in roots

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and (
                of_torch(node.value) or AUTOGRAD_NODE_PRIVATE.fullmatch(node.attr)):  # (a node: whatever holds it)
            found.append(ast.unparse(node))
        elif isinstance(node, (ast.Call, ast.Tuple)):
            items = node.args if isinstance(node, ast.Call) else node.elts
            strings = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
            found += [name for name in strings if _private(name) and any(of_torch(i) for i in items)]
    return found


def test_private_torch_names_are_found():
    """The check below finds each way of touching one (and passes public names and strings that only name one)."""
    source = ("import torch\nimport torch._dynamo.utils\nfrom torch import nn\nfrom torch.utils._pytree import tree_map\n"
              "from torch.fx import _symbolic_trace\nfrom torch.utils import _pytree as pytree\n"
              "a = torch._C._current_graph_task_id()\nb = nn.functional._check_key_padding_mask\n"
              "c = getattr(torch.ops.aten, '_grouped_mm', None)\nd = ((torch.utils.checkpoint, '_generator'),)\n"
              "e = torch.__version__, torch.autograd.grad, nn.Module, 'torch._C._nn', obj._private\n"
              "f = loss.grad_fn._sequence_nr()\n")
    assert sorted(_torch_private_names(source)) == sorted([
        "torch._dynamo.utils", "torch.utils._pytree.tree_map", "torch.fx._symbolic_trace", "torch.utils._pytree",
        "torch._C", "torch._C._current_graph_task_id", "nn.functional._check_key_padding_mask", "_grouped_mm",
        "_generator", "loss.grad_fn._sequence_nr"])


def test_no_module_but_torch_api_touches_a_private_torch_name():
    """torch's private surface is looked up in ``torch_api`` alone, each name with what it is for, the versions that
    have it and what the package does without it (issue 39): everywhere else, through ``torch_api``."""
    touched = {_module(path): names for path in PACKAGE.rglob("*.py") if path.name != "torch_api.py"
               if (names := _torch_private_names(path.read_text()))}
    assert not touched


def test_no_module_imports_another_modules_underscore_names():
    """A name with a leading underscore is its module's own (issue 43): what another module needs is public there.
    ``torch_api`` is the one door to torch's private names, which it gives under their own names."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fxprof_lightning"):
                found += [f"{_module(path)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and node.module != "fxprof_lightning.torch_api"]
    assert not found, found


def _classes() -> dict[str, tuple[str, list[str]]]:
    """Every class the package defines: ``module:Class`` -> (its module, the bases it names, as written)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[f"{_module(path)}:{node.name}"] = (_module(path), [ast.unparse(b) for b in node.bases])
    return found


def _own_bases(classes: dict[str, tuple[str, list[str]]], name: str) -> list[str]:
    """The bases of a class that are classes of the package (``module:Class``): a base named as defined in its own
    module or imported from one of ours; torch's, typing's (``Protocol``, ``NamedTuple``), ``enum``'s, exceptions and
    the rest are not ours."""
    module = classes[name][0]
    path = PACKAGE.joinpath(*module.split("."))
    source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    imported = {alias.asname or alias.name: f"{node.module.removeprefix('fxprof_lightning.')}:{alias.name}"
                for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("fxprof_lightning.") for alias in node.names}
    own = []
    for base in classes[name][1]:
        base = base.split("[")[0]  # (Generic[T]-like subscripts)
        for candidate in (f"{module}:{base}", imported.get(base, "")):
            if candidate in classes:
                own.append(candidate)
                break
    return own


def _depth(classes: dict[str, tuple[str, list[str]]], name: str) -> int:
    return max((1 + _depth(classes, base) for base in _own_bases(classes, name)), default=0)


def test_no_class_is_more_than_two_of_ours_below_another():
    """Inheritance at most two levels deep among the package's own classes (issue 43): a class's parts are held
    (``NodeTimer.samples``), not inherited from a chain of mixins. ``DynamoTimer`` -> ``DynamoGraphs`` ->
    ``NodeTimer`` is as deep as it goes."""
    classes = _classes()
    assert _depth(classes, "capture.dynamo:DynamoTimer") >= 2  # (the check sees a chain where there is one)
    deep = {name: _depth(classes, name) for name in classes if _depth(classes, name) > 2}
    assert not deep, f"more than two of our classes above: {deep}"
