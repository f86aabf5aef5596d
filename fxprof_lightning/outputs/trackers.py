"""A cycle's tables and files to the Trainer's experiment trackers, each in the form that tracker uses.

``LoggerSink``: the Trainer's loggers as the callback's sink. Scalars to every logger; to TensorBoard also the
tables as text, the pictures and a CUSTOM SCALARS layout. ``log_cycle_files(logger, report, display, views)`` is
called for every logger after the scalars (rank 0 only; ``views``: the report's, drawn once per cycle by
``CycleReport.views``). It looks at the logger's type:

- ``CSVLogger``: ``fx_nodes.csv``, ``fx_modules.csv`` and the cycle's other files (traces,
  ``cycle.json``, pictures) in ``<log_dir>/fxprof/<cycle>/``; nothing when the cycle's directory is
  already inside ``log_dir`` (the callback's default ``dirpath`` is ``<trainer.log_dir>/fxprof``).
- ``MLFlowLogger``: the node and module tables as MLflow tables (``log_table``:
  ``fxprof/<cycle>/nodes.json``, ``modules.json``), the Markdown texts (``layers.md``,
  ``modules.md``) and the cycle's files (``log_artifacts``), all under the run's ``fxprof/<cycle>/``.
- ``WandbLogger``: the tables as ``wandb.Table`` under ``fxprof/nodes`` and ``fxprof/modules``
  (validation: the validation prefix of ``sinks.tag_prefix``) at the cycle's last step, and the
  cycle's files as a version of the artifact ``fxprof-<run id>`` (validation: ``fxprof-val-<run id>``),
  type ``fxprof-cycle``, aliased with the cycle's name, with ``CycleReport.to_summary()`` as metadata.
- any other logger (TensorBoard gets its text and pictures elsewhere): nothing.

``<cycle>`` is the name of the cycle's directory (``cycle_0003``, ``val_cycle_0000``). The
packages ``mlflow`` and ``wandb`` are imported only when such a logger is in use. A tracker that
fails never stops training: the error is reported once per logger and kind of output
(``Display.warn``: the profiler's), and later cycles try again.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from fxprof_lightning.layout import MODULES_FILE, NODES_FILE, TREND_FILE
from fxprof_lightning.outputs.sinks import (
    Display,
    RunSummary,
    cycle_scalars,
    cycle_texts,
    log_to_summary_writer,
    log_trend_to_summary_writer,
    png_to_array,
    tag_prefix,
    trend_picture,
)
from fxprof_lightning.report import CycleReport, CycleViews, ModuleStats, NodeStats

__all__ = ["LoggerSink", "log_cycle_files", "log_trend", "module_table", "node_table"]

# What already failed, per logger: each kind of failure is reported once.
_reported: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def node_table(report: CycleReport) -> tuple[list[str], list[list[Any]]]:
    """The node table as columns (every ``NodeStats`` field) and rows, slowest first."""
    return _table(NodeStats, report.nodes)


def module_table(report: CycleReport) -> tuple[list[str], list[list[Any]]]:
    """The module table as columns (every ``ModuleStats`` field) and rows, depth first."""
    return _table(ModuleStats, report.modules)


def _table(record_type: type, records: list) -> tuple[list[str], list[list[Any]]]:
    columns = [f.name for f in fields(record_type)]
    return columns, [[getattr(record, c) for c in columns] for record in records]


def log_cycle_files(logger: Any, report: CycleReport, display: Display, views: CycleViews) -> None:
    """Send the cycle's tables and files to ``logger`` if it is a tracker that keeps them (see the module's doc)."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

    if isinstance(logger, CSVLogger):
        parts = _csv_parts(logger, report, views)
    elif isinstance(logger, MLFlowLogger):
        parts = _mlflow_parts(logger, report, views)
    elif isinstance(logger, WandbLogger):
        parts = _wandb_parts(logger, report, views)
    else:
        return
    for what, send in parts:
        try:
            send()
        except Exception as error:  # a tracker's failure must never break training
            _report_once(logger, display, what, report, error)


def log_trend(logger: Any, png: bytes, report: CycleReport, display: Display) -> None:
    """Send the end-of-run trend picture (PNG bytes; it belongs to ``report``, the run's last cycle) to a tracker."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

    def send() -> None:
        if isinstance(logger, CSVLogger):
            inside = report.directory is not None and report.directory.resolve().is_relative_to(
                Path(logger.log_dir).resolve())
            target = report.directory if inside else Path(logger.log_dir) / "fxprof" / _cycle_name(report)
            target.mkdir(parents=True, exist_ok=True)
            if not (target / TREND_FILE).is_file():  # (a PictureSink of the same run writes the same picture)
                (target / TREND_FILE).write_bytes(png)
        elif isinstance(logger, MLFlowLogger):
            with tempfile.TemporaryDirectory() as staging:
                (Path(staging) / TREND_FILE).write_bytes(png)
                logger.experiment.log_artifact(logger.run_id, str(Path(staging) / TREND_FILE),
                                               f"fxprof/{_cycle_name(report)}")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=f"{tag_prefix(report)}/trend", images=[png_to_array(png)], step=report.steps[-1])

    try:
        send()
    except Exception as error:  # a tracker's failure must never break training
        _report_once(logger, display, "trend picture", report, error)


def _report_once(logger: Any, display: Display, what: str, report: CycleReport, error: Exception) -> None:
    try:
        reported = _reported.setdefault(logger, set())
    except TypeError:  # not weak-referenceable: report every time
        reported = set()
    if what in reported:
        return
    reported.add(what)
    display.warn(f"{type(logger).__name__} could not log the {what} of {_cycle_name(report)} "
                  f"({type(error).__name__}: {error}); training goes on, later cycles try again and further failures "
                  "of this kind are not reported")


def _cycle_name(report: CycleReport) -> str:
    if report.directory is not None:
        return report.directory.name
    return f"{'val_' if report.stage == 'val' else ''}cycle_{report.index:04d}"


def _has_files(report: CycleReport) -> bool:
    return report.directory is not None and report.directory.is_dir()


# ---------------------------------------------------------------- CSVLogger


def _csv_parts(logger: Any, report: CycleReport, views: CycleViews) -> list[tuple[str, Callable[[], None]]]:
    log_dir = Path(logger.log_dir)
    if report.directory is not None and report.directory.resolve().is_relative_to(log_dir.resolve()):
        return []  # already where the user looks
    target = log_dir / "fxprof" / _cycle_name(report)

    def files() -> None:
        if _has_files(report):
            shutil.copytree(report.directory, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".*"))  # not the half-written ``.name.partial``

    def csv_tables() -> None:
        target.mkdir(parents=True, exist_ok=True)
        (target / NODES_FILE).write_text(views.nodes_csv)
        if views.modules_csv is not None:
            (target / MODULES_FILE).write_text(views.modules_csv)

    return [("cycle's files", files), ("node and module tables", csv_tables)]


# ---------------------------------------------------------------- MLFlowLogger


def _mlflow_parts(logger: Any, report: CycleReport, views: CycleViews) -> list[tuple[str, Callable[[], None]]]:
    base = f"fxprof/{_cycle_name(report)}"

    def tables() -> None:
        client, run_id = logger.experiment, logger.run_id
        _mlflow_table(client, run_id, node_table(report), f"{base}/nodes.json")
        if report.modules:
            _mlflow_table(client, run_id, module_table(report), f"{base}/modules.json")

    def texts() -> None:
        client, run_id = logger.experiment, logger.run_id
        for tag, text in cycle_texts(report, views).items():
            client.log_text(run_id, text, f"{base}/{tag.rsplit('/', 1)[-1]}.md")

    def files() -> None:
        if _has_files(report):
            logger.experiment.log_artifacts(logger.run_id, str(report.directory), artifact_path=base)

    return [("node and module tables", tables), ("Markdown tables", texts), ("cycle's files", files)]


def _mlflow_table(client: Any, run_id: str, table: tuple[list[str], list[list[Any]]], artifact_file: str) -> None:
    """An MLflow table (``log_table``: JSON, pandas' ``split`` layout, listed as a table in the UI).

    ``log_table`` needs pandas (``mlflow`` has it, ``mlflow-skinny`` does not): without it the same
    layout goes out through ``log_dict``.
    """
    columns, rows = table
    try:
        import pandas
    except ImportError:
        client.log_dict(run_id, {"columns": columns, "data": rows}, artifact_file)
        return
    with warnings.catch_warnings():  # mlflow 3.17 with pandas 3: a deprecation warning of pandas' at every table
        warnings.filterwarnings("ignore", message=".*select_dtypes.*")
        client.log_table(run_id, data=pandas.DataFrame(rows, columns=columns), artifact_file=artifact_file)


# ---------------------------------------------------------------- WandbLogger


def _wandb_parts(logger: Any, report: CycleReport, views: CycleViews) -> list[tuple[str, Callable[[], None]]]:
    prefix, step = tag_prefix(report), report.steps[-1] if report.steps else None

    def tables() -> None:
        for name, (columns, rows) in (("nodes", node_table(report)), ("modules", module_table(report))):
            if rows:
                logger.log_table(key=f"{prefix}/{name}", columns=columns, data=rows, step=step)

    def files() -> None:
        if not _has_files(report):
            return
        import wandb

        run = logger.experiment
        stage = "val-" if report.stage == "val" else ""
        artifact = wandb.Artifact(name=f"fxprof-{stage}{run.id}", type="fxprof-cycle", metadata=_metadata(views.summary))
        artifact.add_dir(str(report.directory))
        run.log_artifact(artifact, aliases=[_cycle_name(report), "latest"])

    return [("node and module tables", tables), ("cycle's files", files)]


def _metadata(summary: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return json.loads(json.dumps(summary, default=str))
    except Exception:  # metadata is a bonus: the files go without it
        return None


class LoggerSink:
    """The Trainer's loggers as a sink: scalars to every logger; to TensorBoard also the tables as text, the
    pictures and a CUSTOM SCALARS layout (``sinks.log_to_summary_writer``)."""

    def __init__(self, loggers: list[Any]) -> None:
        self.loggers = loggers

    def write_cycle(self, report: CycleReport, display: Display) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        if not self.loggers:
            return
        step, views = report.steps[-1], report.views(display.top_k, display.module_depth)  # (drawn once for all)
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                log_to_summary_writer(logger.experiment, report, display, views)
            else:
                logger.log_metrics(cycle_scalars(report), step=step)
            log_cycle_files(logger, report, display, views)  # tables and files to CSV, MLflow, W&B
            logger.save()

    def close(self, run: RunSummary) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        trend = trend_picture(run)  # (drawn once per run: every sink that shows it shares the same bytes)
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                log_trend_to_summary_writer(logger.experiment, run)
            elif trend is not None:
                log_trend(logger, trend, run.cycles[-1], run.display)
