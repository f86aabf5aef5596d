"""Profiling runs on disk: cycle directories read back into ``CycleReport``s.

A cycle directory is one that holds ``fx_nodes.csv`` (``CycleReport.to_csv``); it may also hold
``fx_modules.csv``, ``fsdp_ranges.csv``, ``cycle.jsonl`` (``CycleReport.to_summary`` as one JSON
line; a ``cycle.json`` object is read too) and torch.profiler traces. Its name says its stage,
index, piece and run (``engine.stage.cycle_name``): ``cycle_0003``, ``cycle_0003-p1`` (the second
piece of a cut cycle), ``cycle_0003-r1`` (a name an earlier run had taken), ``val_cycle_0000``.
A run directory holds cycle directories, directly (``fxprof/``) or a few levels down
(``lightning_logs/version_0/fxprof/cycle_0000``).

``load_cycle`` reads one directory, ``find_cycles`` lists the cycle directories under a path,
``load_run`` does both. Nothing here writes. Whatever cannot be read raises ``RunError``, whose
message names the path and what was expected.
"""

from __future__ import annotations

import csv
import json
import os
import re
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from fxprof_lightning.analysis.memory_plan import CheckpointPlan
from fxprof_lightning.analysis.regressions import Regression
from fxprof_lightning.layout import MODULES_FILE, NODES_FILE, RANGES_FILE, SUMMARY_FILES
from fxprof_lightning.report import CycleReport, ModuleStats, NodeStats, RangeStats

__all__ = ["CYCLE_NAME", "RunError", "cycle_key", "find_cycles", "load_cycle", "load_run"]

CYCLE_NAME = re.compile(r"(?P<val>val_)?cycle_(?P<index>\d+)(?:-p(?P<piece>\d+))?(?:-r(?P<run>\d+))?")
SEARCH_DEPTH = 4  # levels below the given path searched for cycle directories
SUMMARY_FIELDS = {  # taken from the summary as they are, when present: name -> accepted JSON types
    "index": (int,), "stage": (str,), "steps": (list,), "partial": (bool,), "ranks": (int,),
    "backward_wall_ms": (int, float, type(None)), "backward_outside_ms": (int, float, type(None)),
    "forward_wall_ms": (int, float, type(None)), "step_ms": (list,), "step_cpu_ms": (list,), "step_wait_ms": (list,),
    "advice": (list,),
    "distortion": (str, type(None)), "tracked": (list,), "phases": (dict,), "peaks": (str, type(None)),
    "batch_size": (int, type(None)), "dropped_steps": (dict,), "capture_s": (int, float),
    "trigger": (str,),
}


class RunError(ValueError):
    """Nothing to read at a path, or a file that is not what a cycle directory holds."""


def cycle_key(directory: Path) -> tuple[int, int, int, int, str]:
    """Sort key of a cycle directory: (stage: train 0 / val 1, index, piece, run, name), from its name.

    A directory named otherwise sorts after the named ones of its stage (from its ``cycle.jsonl``, if any).

    Example:
        >>> sorted(["cycle_0010", "val_cycle_0000", "cycle_0002-r1", "cycle_0002", "cycle_0002-p1"],
        ...        key=lambda name: cycle_key(Path(name)))
        ['cycle_0002', 'cycle_0002-r1', 'cycle_0002-p1', 'cycle_0010', 'val_cycle_0000']
    """
    match = CYCLE_NAME.fullmatch(directory.name)
    if match is None:
        _, summary = _read_summary(directory, strict=False)
        stage = 1 if summary.get("stage") == "val" else 0
        index = summary.get("index")
        return stage, index if isinstance(index, int) else 10**9, 0, 0, directory.name
    return (1 if match["val"] else 0, int(match["index"]), int(match["piece"] or 0), int(match["run"] or 0),
            directory.name)


def find_cycles(path: str | os.PathLike) -> list[Path]:
    """The cycle directories at or under ``path`` (up to 4 levels down), sorted by directory then ``cycle_key``.

    ``path`` is a cycle directory (it holds ``fx_nodes.csv``) or a directory holding cycle
    directories. Hidden directories are not searched. A path that does not exist raises ``RunError``;
    one with no cycle directory gives ``[]``.
    """
    root = Path(path)
    if not root.is_dir():
        raise RunError(f"{root}: {'not a directory' if root.exists() else 'no such directory'} (expected a cycle "
                       f"directory holding {NODES_FILE}, or a run directory holding cycle directories)")
    found = []
    for directory, subdirectories, files in os.walk(root):
        here = Path(directory)
        depth = len(here.relative_to(root).parts)
        if NODES_FILE in files:
            found.append(here)
            subdirectories[:] = []  # a cycle directory holds no cycles
            continue
        subdirectories[:] = [] if depth >= SEARCH_DEPTH else sorted(d for d in subdirectories if not d.startswith("."))
    return sorted(found, key=lambda d: (d.parent, *cycle_key(d)))


def load_cycle(directory: str | os.PathLike) -> CycleReport:
    """The ``CycleReport`` that a cycle directory holds.

    Node statistics come from ``fx_nodes.csv`` (typed by ``NodeStats``' fields; empty cells are
    None), the module tree from ``fx_modules.csv`` and FSDP ranges from ``fsdp_ranges.csv`` if
    present, everything else from ``cycle.jsonl`` (or ``cycle.json``) if present (``regressions`` as
    ``Regression``). Without it, the stage and index come from the directory's name and ``steps`` is
    empty (the per-step totals are then in the root row of ``modules``).
    """
    directory = Path(directory)
    nodes_path = directory / NODES_FILE
    if not nodes_path.is_file():
        raise RunError(f"{directory}: no {NODES_FILE} (expected a cycle directory written by fxprof_lightning's "
                       "CsvSink)")
    report = CycleReport(index=0, steps=[], directory=directory)
    report.nodes = _read_table(nodes_path, NodeStats)
    if (directory / MODULES_FILE).is_file():
        report.modules = _read_table(directory / MODULES_FILE, ModuleStats)
    if (directory / RANGES_FILE).is_file():
        report.ranges = _read_table(directory / RANGES_FILE, RangeStats)
    report.trace_paths = sorted(p for p in directory.iterdir() if ".pt.trace.json" in p.name and p.is_file())
    match = CYCLE_NAME.fullmatch(directory.name)
    if match is not None:
        report.index, report.stage = int(match["index"]), "val" if match["val"] else "train"
    summary_path, summary = _read_summary(directory, strict=True)
    known = {f.name for f in fields(CycleReport)}
    for name, types in SUMMARY_FIELDS.items():
        if name in summary and name in known:
            value = summary[name]
            if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
                expected = " or ".join(t.__name__ for t in types)
                raise RunError(f"{summary_path}: {name} is {value!r}, not a {expected}")
            if name in ("steps", "step_ms", "step_cpu_ms", "step_wait_ms") and not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in value):
                raise RunError(f"{summary_path}: {name} holds something other than numbers: {value!r}")
            if name == "phases" and not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
                raise RunError(f"{summary_path}: phases holds something other than numbers: {value!r}")
            if name == "dropped_steps":
                if not all(k.isdigit() and isinstance(v, str) for k, v in value.items()):
                    raise RunError(f"{summary_path}: dropped_steps is not step numbers with their reasons: {value!r}")
                value = {int(k): v for k, v in value.items()}
            setattr(report, name, value)
    report.regressions = [_regression(r, summary_path) for r in summary.get("regressions") or []]
    plan = summary.get("checkpoint_plan")
    if plan is not None:
        try:
            report.checkpoint_plan = CheckpointPlan(**{**plan, "modules": tuple(plan["modules"])})
        except (TypeError, KeyError) as error:
            raise RunError(f"{summary_path}: checkpoint_plan is not a plan ({error}): {plan!r}") from error
    return report


def load_run(path: str | os.PathLike, stage: str | None = None) -> list[CycleReport]:
    """Every cycle under ``path`` (``find_cycles``), loaded; only those of ``stage`` ("train"/"val") if given."""
    reports = [load_cycle(d) for d in find_cycles(path)]
    return [r for r in reports if stage is None or r.stage == stage]


# ------------------------------------------------------------------ reading


def _read_summary(directory: Path, strict: bool) -> tuple[Path | None, dict[str, Any]]:
    """The cycle's summary file and what it holds ({} without one; ``strict``: a bad one raises ``RunError``)."""
    path = next((directory / name for name in SUMMARY_FILES if (directory / name).is_file()), None)
    if path is None:
        return None, {}
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        summary = json.loads(lines[-1] if path.suffix == ".jsonl" and lines else "\n".join(lines))
    except (OSError, ValueError) as error:
        if not strict:
            return path, {}
        raise RunError(f"{path}: not readable as JSON ({error})") from error
    if not isinstance(summary, dict):
        if not strict:
            return path, {}
        raise RunError(f"{path}: expected a JSON object (CycleReport.to_summary), got {type(summary).__name__}")
    return path, summary


def _regression(entry: Any, path: Path | None) -> Regression:
    names = {f.name for f in fields(Regression)}
    try:
        return Regression(**{k: v for k, v in entry.items() if k in names})
    except (AttributeError, TypeError) as error:
        raise RunError(f"{path}: a regression is not one ({entry!r})") from error


def _read_table(path: Path, record_type: type) -> list:
    """Rows of a CSV written by ``report._csv`` as ``record_type`` records; unknown columns are ignored."""
    converters = {f.name: _converter(hint) for f, hint in _hints(record_type)}
    required = [f.name for f in fields(record_type) if f.default is MISSING and f.default_factory is MISSING]
    defaults = {f.name: f.default for f in fields(record_type) if f.default is not MISSING}
    try:
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            missing = [name for name in required if name not in (reader.fieldnames or [])]
            if missing:
                raise RunError(f"{path}: not a {record_type.__name__} table (no column {', '.join(missing)})")
            records = []
            for line, row in enumerate(reader, start=2):
                values = {}
                for name, convert in converters.items():
                    text = row.get(name)
                    if text is None:  # a column this version has and the file's does not
                        continue
                    try:
                        values[name] = convert(text, defaults.get(name, MISSING))
                    except ValueError as error:
                        raise RunError(f"{path}, line {line}, column {name}: {error}") from error
                records.append(record_type(**values))
            return records
    except OSError as error:
        raise RunError(f"{path}: {error.strerror or error}") from error
    except (csv.Error, UnicodeDecodeError) as error:
        raise RunError(f"{path}: not a CSV file ({error})") from error


def _hints(record_type: type) -> list[tuple[Any, Any]]:
    hints = typing.get_type_hints(record_type)
    return [(f, hints[f.name]) for f in fields(record_type)]


def _converter(hint: Any) -> Any:
    """text, default -> value, for a field annotated ``hint`` (``int``, ``float | None``, ``str``...)."""
    options = typing.get_args(hint) or (hint,)
    optional = type(None) in options
    kind = next((o for o in options if o is not type(None)), str)

    def convert(text: str, default: Any) -> Any:
        if text == "":
            if optional:
                return None
            if kind is str:
                return ""
            if default is not MISSING:
                return default
            raise ValueError("empty, a number was expected")
        if kind is bool:
            return text.strip().lower() in ("true", "1", "yes")
        if kind is int:
            try:
                return int(text)
            except ValueError:
                return float(text)  # merge_ranks averages some int fields over ranks
        if kind is float:
            return float(text)
        return text

    return convert
