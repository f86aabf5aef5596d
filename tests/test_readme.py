"""The README as a user reads it: its two quickstarts run exactly as written, its set-up and test commands are what
CI runs, it stays short, and the docs site it points to builds with `mkdocs build --strict`."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def _code_block(heading: str, language: str) -> str:
    """The first ```language block after the README heading `heading`, before the next heading."""
    lines = README.read_text().splitlines(keepends=True)
    assert f"{heading}\n" in [line.lstrip("#").lstrip() for line in lines if line.startswith("#")], heading
    in_section = in_fence = False
    block: list[str] | None = None
    for line in lines:
        if line.startswith("```"):
            if in_section and block is None and line.strip() == f"```{language}":
                block = []
            elif block is not None:
                return "".join(block)
            in_fence = not in_fence
        elif block is not None:
            block.append(line)
        elif not in_fence and line.startswith("#"):
            if in_section:
                break
            in_section = line.lstrip("#").strip() == heading
    raise AssertionError(f"README.md has no ```{language} block under {heading!r}")


def test_readme_is_at_most_12_kib():
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: move details to docs/ (the limit is 12 KiB)"


def test_readme_setup_and_test_commands_are_what_ci_runs():
    first, second = _code_block("Set up and test on a fresh machine", "bash").splitlines()
    ci = (ROOT / ".ci" / "run").read_text().replace(" --quiet", "")
    # The first installs what the example needs, nothing only the tests need, and runs it.
    venv, light, example = first.split(" && ")
    assert venv == "python3 -m venv .venv" and example == ".venv/bin/python examples/train_resnet18.py"
    assert light == ".venv/bin/pip install -e '.[examples,plots]'"
    # The second installs what CI installs and runs CI's command.
    install, tests = second.split(" && ")
    assert install == ".venv/bin/pip install -e '.[examples,plots,test]' -r docs/requirements.txt" and install in ci
    assert tests == ".venv/bin/python -m pytest" and f"{tests} ||" in ci
    assert '-m "not slow"' in README.read_text()


def test_plain_loop_quickstart_runs_as_written(tmp_path, monkeypatch):
    """The README's "Without Lightning" block, pasted into a session started in an empty directory."""
    snippet = _code_block("Without Lightning: `Profiler`", "python")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    (cycle,) = namespace["prof"].cycles
    assert cycle.steps == [51, 52, 53] and {"0", "1", "2"} <= {n.name for n in cycle.nodes}
    assert (tmp_path / "fxprof" / "cycle_0000" / "fx_nodes.csv").is_file()


def test_plain_loop_quickstart_with_too_few_steps_warns_and_raises_nothing(tmp_path, monkeypatch, capsys):
    snippet = _code_block("Without Lightning: `Profiler`", "python").replace("range(60)", "range(20)")
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"stopped after 20 step\(s\), before any recorded step \(the first is step 51"):
        exec(compile(snippet, "README.md", "exec"), {})
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_lightning_quickstart_with_too_few_steps_warns_and_raises_nothing(tmp_path):
    (tmp_path / "quickstart.py").write_text(_code_block("Quickstart", "python").replace("max_steps=60", "max_steps=20"))
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FXProfilerCallback: stopped after 20 step(s), before any recorded step (the first is step 31" in run.stderr


@pytest.mark.slow
def test_lightning_quickstart_runs_as_written(tmp_path):
    """The README's Lightning quickstart saved as a script and run with `python quickstart.py` in an empty directory."""
    (tmp_path / "quickstart.py").write_text(_code_block("Quickstart", "python"))
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # What the README says it gives: two cycles of 3 recorded steps, each with its files, and the last one's table.
    assert "FXProfilerCallback: cycle 1, steps 55-57" in run.stdout + run.stderr
    fxprof = tmp_path / "lightning_logs" / "version_0" / "fxprof"
    assert sorted(p.name for p in fxprof.iterdir()) == ["cycle_0000", "cycle_0001", "fxprof_cycles.jsonl", "fxprof_job.json"]
    for cycle in fxprof.glob("cycle_*"):
        assert (cycle / "fx_nodes.csv").is_file() and list(cycle.glob("rank0.*.pt.trace.json.gz"))
    rows = [line for line in run.stdout.splitlines() if line.startswith("| `")]
    assert {row.split("|")[1].strip() for row in rows} == {"`0 (Linear)`", "`1 (ReLU)`", "`2 (Linear)`"}


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")),
    reason="the docs tools are not installed: the README's second command installs them, as .ci/run does",
)
def test_docs_build_strict(tmp_path):
    """`mkdocs build --strict`, as .ci/run runs it: no broken link or anchor, every README snippet section found,
    every public name documented from its docstring."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("FXProfilerCallback", "Profiler", "CycleReport", "NodeStats", "Schedule", "CsvSink", "PictureSink",
                 "TensorBoardSink", "ConsoleSink"):
        assert f'id="fxprof_lightning.{name}"' in api, name
    assert "LitClassifier" in (tmp_path / "site" / "index.html").read_text()  # the quickstarts, taken from README.md


def test_the_schedule_recipes_record_the_steps_they_promise():
    """docs/recipes.md: the options of its first two recipes, read from the page, give the steps its text names."""
    import ast

    from fxprof_lightning.engine.settings import Settings
    from fxprof_lightning.schedule import Schedule

    text = (ROOT / "docs" / "recipes.md").read_text()
    calls = re.findall(r"^FXProfilerCallback\((.*)\)", text, flags=re.MULTILINE)

    def schedule(call: str) -> Schedule:
        tree = ast.parse(f"f({call})").body[0].value
        options = {k.arg: ast.literal_eval(k.value) for k in tree.keywords if k.arg != "module"}
        return Settings.of("FXProfilerCallback", options).schedule  # (the callback's defaults for what is left out)

    once, sampled = schedule(calls[0]), schedule(calls[1])
    assert once.traced_steps(0) == [4999, 5000, 5001, 5002] and once.cycle_of(5003) is None
    assert [sampled.recorded_steps(i) for i in range(2)] == [[997, 998, 999], [1997, 1998, 1999]]
