"""Sinks: where a finished cycle's report goes (files, TensorBoard, the console).

A sink is any object with ``write_cycle(report, display)``, called on global rank 0 after each
cycle that timed nodes, and ``close(run)``, called on rank 0 when profiling ends. Sinks are
handed in (``Profiler(..., sinks=[...])``), as ``on_trace_ready`` is to ``torch.profiler``; they
are given the report and what to show (``Display``: the profiler's name, ``top_k``, ``module_depth``,
pictures, verbosity) or the run's cycles (``RunSummary``), never the profiler itself, and never reach
back into collection. The Lightning callback adds one that writes to the Trainer's loggers.

Tags are shared by every sink that logs scalars, text or pictures (``cycle_scalars``,
``cycle_texts``): the run's totals in the ``fxprof`` group (``fxprof/forward_ms_per_step``,
``fxprof/backward_ms_per_step``, ``fxprof/regressions``, ``fxprof/step_spread``,
``fxprof/cpu_per_wall``), the whole step's phases (``fxprof_step/<phase>_ms``, Lightning), the tracked nodes in ``fxprof_nodes`` (``fxprof_nodes/<node>/forward_ms_per_call``,
``.../backward_ms_per_call``), text ``fxprof/layers`` (the node table, regressions and advice), ``fxprof/modules`` and
pictures ``fxprof/slowest_layers``, ``fxprof/module_tree``, ``fxprof/trend``. Validation cycles
use ``fxprof_val`` and ``fxprof_val_nodes``. The step is the cycle's last recorded step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fxprof_lightning import FxprofWarning
from fxprof_lightning.layout import (
    HTML_FILE,
    MODULES_FILE,
    NODES_FILE,
    PICTURE_FILES,
    RANGES_FILE,
    STEP_FILE,
    SUMMARY_FILE,
    TREND_FILE,
    TREND_TAG,
    stage_tag,
)
from fxprof_lightning.report import CycleReport, CycleViews, last_sound, shorten

# What TensorBoard's summary writer would replace in a tag (with a warning each time): all but letters, digits, _ - . /
TAG_UNSAFE = re.compile(r"[^-\w./]+")
LINES_PER_CHART = 5  # TensorBoard gives the lines of one run in a CUSTOM SCALARS chart 5 symbols

__all__ = ["ConsoleSink", "CsvSink", "Display", "PictureSink", "RunSummary", "Sink", "TensorBoardSink", "cycle_pictures",
           "cycle_scalars", "cycle_texts", "tag_prefix"]


def _warn(message: str) -> None:
    warnings.warn(message, FxprofWarning, stacklevel=3)


@dataclass(frozen=True)
class Display:
    """What the sinks show, from the profiler's settings at the time (given with each call).

    Attributes:
        name: starts console lines and warnings (``Profiler``, ``FXProfilerCallback``).
        top_k: rows of the node tables.
        module_depth: deepest level of the module tree.
        pictures: draw the pictures.
        verbose: print every cycle's full tables.
        validation: validation cycles are profiled too (the CUSTOM SCALARS layout then has their charts).
        warn: how a sink warns (rank 0; the profiler's ``warn``).
    """

    name: str = "Profiler"
    top_k: int = 20
    module_depth: int = 3
    pictures: bool = True
    verbose: bool = False
    validation: bool = False
    warn: Callable[[str], None] = field(default=_warn, compare=False)


@dataclass(frozen=True)
class RunSummary:
    """What the sinks are given when profiling ends: the run's training cycles, where they were written, and
    ``display``."""

    cycles: list[CycleReport]
    dirpath: Path
    display: Display = field(default_factory=Display)
    cost: tuple[float, float] | None = None  # what profiling cost (its cycles, the capture made ready): s, share of wall


class Sink(Protocol):
    def write_cycle(self, report: CycleReport, display: Display) -> None: ...

    def close(self, run: RunSummary) -> None: ...


def tag_prefix(report: CycleReport) -> str:
    """``fxprof`` for training cycles, ``fxprof_val`` for validation cycles (``..._nodes`` for the node series)."""
    return stage_tag(report.stage)


def cycle_scalars(report: CycleReport) -> dict[str, float]:
    """The cycle's scalars: totals per step, trust figures, regressions, and the tracked nodes' ms (and MB saved for
    backward) per call.

    The tracked nodes (``CycleReport.tracked``) are the first cycle's slowest, and each later cycle's slowest joins
    them: a series has a point in every cycle from the one its node joined in.
    """
    prefix = tag_prefix(report)
    metrics = {f"{prefix}/forward_ms_per_step": report.forward_ms_per_step,
               f"{prefix}/regressions": float(len(report.regressions))}
    if report.backward_ms_per_step:
        metrics[f"{prefix}/backward_ms_per_step"] = report.backward_ms_per_step
    for name, value in (("step_spread", report.step_spread), ("cpu_per_wall", report.cpu_per_wall)):
        if value is not None:
            metrics[f"{prefix}/{name}"] = value
    for phase, ms in report.phases.items():  # the whole step (Lightning): one series per phase
        metrics[f"{prefix}_step/{phase}_ms"] = ms
    by_name = {n.name: n for n in report.nodes}
    for name in report.tracked:
        n = by_name.get(name)
        if n is None:
            continue
        tag = TAG_UNSAFE.sub("_", name)  # compiled rows: "layer1.0 + layer1.0.bn", "aten::addmm"
        metrics[f"{prefix}_nodes/{tag}/forward_ms_per_call"] = n.mean_ms
        if n.bwd_calls:
            metrics[f"{prefix}_nodes/{tag}/backward_ms_per_call"] = n.bwd_mean_ms
        if n.saved_bytes is not None:  # (memory measured: docs/memory.md)
            metrics[f"{prefix}_nodes/{tag}/saved_mb_per_call"] = n.saved_bytes / 1e6
    return metrics


def _run_name(writer: Any) -> str:
    """The writer's run as the layout's titles name it: its directory's last two parts (``name/version_N`` for
    Lightning's ``TensorBoardLogger``), so that experiments of one log dir stay apart too."""
    directory = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None) or ""
    return "/".join(Path(directory).parts[-2:])


def custom_scalars_layout(validation: bool = False, tracked: list[str] | None = None, run: str = "") -> dict:
    """A TensorBoard CUSTOM SCALARS page: the tracked layers' forward and backward ms per call, and the totals.

    With the training stage's ``tracked`` layers known (the layout is written once, at the first cycle, and
    TensorBoard reads only the first layout of a run), their charts hold ``LINES_PER_CHART`` layers each: a chart's
    lines share the run's colour and TensorBoard tells them apart by one of 5 symbols per chart, named in the
    chart's "Matches" list; one more chart per side holds the layers tracked later (each later cycle's slowest).
    Validation tracks the same layers (``StageHistory.analyse``), in charts of the same layers. Otherwise (a run
    whose first cycle is a validation one) one chart per side holds every tracked layer. Titles end with ``run``
    (the run's directory): TensorBoard merges the layouts of the runs in a log dir, and charts of one title but
    other lines would show twice under that title.
    """
    charts = {}
    of_run = f" ({run})" if run else ""
    for stage, prefix in (("training", "fxprof"), ("validation", "fxprof_val"))[: 2 if validation else 1]:
        tags = [TAG_UNSAFE.sub("_", name) for name in tracked] if tracked else None
        groups = [tags[i:i + LINES_PER_CHART] for i in range(0, len(tags), LINES_PER_CHART)] if tags else [None]
        charts[f"fxprof ({stage})"] = {}
        for side in ("forward", "backward"):
            for i, group in enumerate(groups):
                title = f"{side} ms per call, tracked layers"
                if group is not None:
                    first, last = LINES_PER_CHART * i + 1, LINES_PER_CHART * i + len(group)
                    title += f" {first}-{last}" if last > first else f" {first}"
                names = "|".join(re.escape(tag) for tag in group) if group is not None else ".*"
                charts[f"fxprof ({stage})"][title + of_run] = ["Multiline", [rf"^{prefix}_nodes/({names})/{side}_ms_per_call$"]]
            if tags:
                first = "|".join(re.escape(tag) for tag in tags)
                charts[f"fxprof ({stage})"][f"{side} ms per call, layers tracked later{of_run}"] = [
                    "Multiline", [rf"^{prefix}_nodes/(?!(?:{first})/)[^/]+/{side}_ms_per_call$"]]
        charts[f"fxprof ({stage})"][f"ms per step{of_run}"] = ["Multiline", [rf"^{prefix}/(forward|backward)_ms_per_step$"]]
    return charts


def cycle_texts(report: CycleReport, views: CycleViews) -> dict[str, str]:
    """The cycle's text entries, by tag: the node table (Markdown) and, when there is one, the module tree (``views``:
    the report's, ``CycleReport.views(display.top_k, display.module_depth)``)."""
    prefix = tag_prefix(report)
    texts = {f"{prefix}/layers": views.markdown}
    if views.modules_text is not None:
        texts[f"{prefix}/modules"] = views.modules_text
    return texts


def cycle_pictures(report: CycleReport, display: Display) -> dict[str, bytes]:
    """The cycle's pictures as PNG, by tag: the slowest layers and the module tree (rendered once per cycle).

    Empty when ``display.pictures`` is off or matplotlib is missing (warned once per process).
    """
    if not display.pictures or not report.nodes:
        return {}
    if not report.pictures:
        plots = _plots(display)
        if plots is None:
            return {}
        prefix = tag_prefix(report)
        report.pictures[f"{prefix}/slowest_layers"] = plots.png_bytes(plots.slowest_layers(report, display.top_k))
        if report.modules:
            report.pictures[f"{prefix}/module_tree"] = plots.png_bytes(plots.module_icicle(report, display.module_depth))
    return report.pictures


def trend_picture(run: RunSummary) -> bytes | None:
    """The trend of the top layers over the run's training cycles, as PNG (None without 2 cycles or matplotlib)."""
    cycles = [c for c in run.cycles if c.nodes]
    if not run.display.pictures or len(cycles) < 2:
        return None
    if TREND_TAG not in cycles[-1].pictures:
        plots = _plots(run.display)
        if plots is None:
            return None
        cycles[-1].pictures[TREND_TAG] = plots.png_bytes(plots.trend(cycles))
    return cycles[-1].pictures[TREND_TAG]


_NO_PICTURES: list[str] = []  # why pictures cannot be drawn, once known (said once per process)


def _plots(display: Display) -> Any:
    try:
        import matplotlib  # noqa: F401  (the plots module imports it lazily)

        from fxprof_lightning.outputs import plots
    except ImportError as error:
        if not _NO_PICTURES:
            _NO_PICTURES.append(str(error))
            display.warn(f"no pictures: {error}")
        return None
    return plots


def png_to_array(png: bytes) -> Any:
    """An H x W x 3 uint8 array of a PNG (for ``SummaryWriter.add_image(..., dataformats="HWC")``)."""
    import io

    from matplotlib import image

    pixels = image.imread(io.BytesIO(png), format="png")[..., :3]
    return (pixels * 255).round().astype("uint8") if pixels.dtype.kind == "f" else pixels


def log_to_summary_writer(writer: Any, report: CycleReport, display: Display, views: CycleViews) -> None:
    """Scalars, text and pictures of a cycle to a ``SummaryWriter`` (also what the callback sends to a TensorBoardLogger;
    ``views``: the report's, as for ``cycle_texts``)."""
    step = report.steps[-1]
    if not getattr(writer, "_fxprof_layout", False):
        writer.add_custom_scalars(custom_scalars_layout(display.validation,
                                                        report.tracked if report.stage == "train" else None,
                                                        _run_name(writer)))
        writer._fxprof_layout = True
    for tag, value in cycle_scalars(report).items():
        writer.add_scalar(tag, value, global_step=step)
    for tag, text in cycle_texts(report, views).items():
        writer.add_text(tag, text, global_step=step)
    for tag, png in cycle_pictures(report, display).items():
        writer.add_image(tag, png_to_array(png), global_step=step, dataformats="HWC")
    writer.flush()


def log_trend_to_summary_writer(writer: Any, run: RunSummary) -> None:
    png = trend_picture(run)
    if png is not None:
        writer.add_image(TREND_TAG, png_to_array(png), global_step=run.cycles[-1].steps[-1], dataformats="HWC")
    writer.flush()


class CsvSink:
    """``fx_nodes.csv``, ``fx_modules.csv``, ``cycle.jsonl`` (and ``fsdp_ranges.csv``, and ``fx_step.csv``: the
    step's phases and the time no row owns) in the cycle's directory,
    written atomically. ``cycle.jsonl`` holds the rest of the report (``CycleReport.to_summary``) as one JSON line:
    not ``.json``, because HolisticTraceAnalysis reads every ``.json`` file of a directory as a trace."""

    def write_cycle(self, report: CycleReport, display: Display) -> None:
        write_atomically(report.directory / NODES_FILE, report.to_csv(), display.name)
        if report.modules:
            write_atomically(report.directory / MODULES_FILE, report.modules_to_csv(), display.name)
        if report.ranges:
            write_atomically(report.directory / RANGES_FILE, report.ranges_to_csv(), display.name)
        if report.phases or report.unowned():
            write_atomically(report.directory / STEP_FILE, report.step_to_csv(), display.name)
        summary = json.dumps(report.to_summary(), default=str) + "\n"
        write_atomically(report.directory / SUMMARY_FILE, summary, display.name)

    def close(self, run: RunSummary) -> None:
        pass


class TensorBoardSink:
    """Scalars, text and pictures to a ``torch.utils.tensorboard.SummaryWriter``, with the callback's tags.

    Example:
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> Profiler(model, sinks=[CsvSink(), TensorBoardSink(SummaryWriter("runs/exp1"))])
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write_cycle(self, report: CycleReport, display: Display) -> None:
        log_to_summary_writer(self.writer, report, display, report.views(display.top_k, display.module_depth))

    def close(self, run: RunSummary) -> None:
        log_trend_to_summary_writer(self.writer, run)


class PictureSink:
    """``slowest_layers.png`` and ``module_tree.png`` in each cycle's directory; at the end ``trend.png`` in the last
    cycle's (a directory of this run: a later run in the same ``dirpath`` leaves it alone)."""

    def write_cycle(self, report: CycleReport, display: Display) -> None:
        for tag, png in cycle_pictures(report, display).items():
            write_atomically(report.directory / PICTURE_FILES[tag.rsplit('/', 1)[1]], png, display.name)

    def close(self, run: RunSummary) -> None:
        png = trend_picture(run)
        if png is not None:
            write_atomically(run.cycles[-1].directory / TREND_FILE, png, run.display.name)


class ConsoleSink:
    """One line per cycle as it is written, and a summary when profiling ends.

    The line gives the steps, forward and backward ms per step, the slowest node, the regressions
    and a distortion warning; with ``verbose`` (``Display``) the full node table and module tree follow.

    Args:
        every_cycle: print the line per cycle (the end-of-run summary always comes).
        logdir: the directory to name in the ``tensorboard --logdir`` hint (default: the profiler's ``dirpath``).
        write: prints a text (the Lightning callback: the progress bar's ``print``, so that a line never lands
            inside the bar's).
    """

    def __init__(self, every_cycle: bool = True, logdir: str | os.PathLike | None = None,
                 write: Callable[[str], None] = print) -> None:
        self.every_cycle = every_cycle
        self.logdir = logdir
        self.write = write

    def write_cycle(self, report: CycleReport, display: Display) -> None:
        if self.every_cycle:
            self.write(cycle_line(report, display.name))
        if display.verbose:
            for text in cycle_texts(report, report.views(display.top_k, display.module_depth)).values():
                self.write(f"\n{text}\n")

    def close(self, run: RunSummary) -> None:
        if run.cycles:
            self.write(summary(run.cycles, run.display.name, run.dirpath, self.logdir or run.dirpath, run.cost))


def cycle_line(report: CycleReport, name: str) -> str:
    """One line about a cycle: steps, ms per step, the slowest node, regressions, distortion."""
    stage = "validation cycle" if report.stage == "val" else "cycle"
    partial = " (partial)" if report.partial else ""
    line = f"{name}: {stage} {report.label}{partial}, steps {report.steps[0]}-{report.steps[-1]}"
    line += f" ({report.trigger})" if report.trigger != "schedule" else ""
    line += f": node rows forward {report.forward_ms_per_step:.2f} ms"
    if report.backward_ms_per_step:
        line += f", backward {report.backward_ms_per_step:.2f} ms"
    line += " per step (summed)"
    if report.nodes:
        top = report.nodes[0]
        grand = sum(n.total_ms + n.bwd_total_ms for n in report.nodes) or 1.0
        line += f"; slowest {top.layer or top.name}: {100 * (top.total_ms + top.bwd_total_ms) / grand:.0f}% of them"
    if report.phases:
        total = sum(report.phases.values()) or 1.0
        biggest = sorted(report.phases.items(), key=lambda item: -item[1])[:2]
        line += f"; measured step {total:.1f} ms: " + ", ".join(f"{phase} {100 * ms / total:.0f}%" for phase, ms in biggest)
    if report.dropped_steps or report.capture_s:
        line += f"; {report.dropped_text()}"
    if report.regressions:
        worst = report.regressions[0]
        more = f" and {len(report.regressions) - 1} more" if len(report.regressions) > 1 else ""
        line += f"; REGRESSION {worst.node} {worst.direction} {worst.ratio:.2f}x{more}"
    if report.distortion:
        line += f"; WARNING: distorted by other load ({report.distortion}), left out of the regression baseline"
    return line


def summary(cycles: list[CycleReport], name: str, out_dir: Path, logdir: str | os.PathLike,
            cost: tuple[float, float] | None = None) -> str:
    """The end-of-run text: how many cycles, what they cost, the slowest nodes of the last sound one
    (``report.last_sound``), where the traces are."""
    last = last_sound(cycles)
    lines = [f"{name}: {len(cycles)} cycle(s) recorded; output in {out_dir}"]
    if cost is not None:
        lines[0] += f"; profiling cost {cost[0]:.2f} s, {100 * cost[1]:.2f}% of the run's wall time"
    if last.nodes:
        partial = ", partial" if last.partial else ""
        lines.append(
            f"Slowest nodes of cycle {last.index} (steps {last.steps[0]}-{last.steps[-1]}{partial}"
            f"{', the last not distorted by other load' if last is not cycles[-1] else ''}), "
            "mean ms per call (share of all nodes):"
        )
        for n in last.nodes[:5]:
            lines.append(f"  {shorten(n.layer or n.name, 42):<42} forward {n.mean_ms:9.3f} ({n.pct:4.1f} %)  "
                         f"backward {n.bwd_mean_ms:9.3f} ({n.bwd_pct:4.1f} %)")
    untimed = [c for c in cycles if not c.nodes and c.untimed]
    if untimed:
        lines.append(f"No node timed in cycle(s) {', '.join(str(c.index) for c in untimed)}: {untimed[-1].untimed}")
    regressed = [(c.index, r) for c in cycles for r in c.regressions]
    if regressed:
        lines.append(f"Regressions in {len({i for i, _ in regressed})} cycle(s): "
                     + "; ".join(f"cycle {i} {r.node} {r.direction} {r.ratio:.2f}x" for i, r in regressed[:5])
                     + (" ..." if len(regressed) > 5 else ""))
    distorted = [c.index for c in cycles if c.distortion]
    if distorted:
        lines.append(f"Distorted by other load: cycle(s) {', '.join(map(str, distorted))}")
    if last.advice:
        lines.append(f"What to try (cycle {last.index}): {last.advice[0]}")
    lines.append(f"Look first: {command('python')} -m fxprof_lightning report {out_dir} --html  (one offline page, "
                 f"written to {out_dir / HTML_FILE}: the step split, the slowest layers, the trend, regressions, advice)")
    lines.append(f"TensorBoard: {command('tensorboard')} --logdir {logdir}  (scalars, tables, pictures; its PyTorch "
                 "Profiler tab needs internet access)")
    if any(c.trace_paths for c in cycles):
        lines.append(f"Traces: {last.directory} (drag a file into https://ui.perfetto.dev)")
    return "\n".join(lines)


def command(name: str) -> str:
    """``python`` or ``tensorboard`` as the user can run it from where they are: the bare name when their PATH finds the
    one beside the interpreter running us (a venv activated), else that file's path (``.venv/bin/tensorboard``, relative
    under the working directory); the bare name when there is none."""
    beside = Path(sys.executable).parent / name
    if name == "python" and not beside.exists():
        beside = Path(sys.executable)
    found = shutil.which(name)
    if not beside.exists() or (found is not None and Path(found).absolute() == beside.absolute()):
        return name
    try:
        return str(beside.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(beside.absolute())


def write_atomically(path: Path, data: str | bytes, name: str = "fxprof") -> None:
    """Write ``data`` to ``path`` in one ``os.replace``; on failure warn and go on."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        if isinstance(data, bytes):
            partial.write_bytes(data)
        else:
            partial.write_text(data)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        warnings.warn(f"{name}: could not write {path}: {error}", FxprofWarning, stacklevel=2)


def checked_sinks(sinks: Sequence[Sink]) -> list[Sink]:
    """The sinks as a list, or a ValueError naming one that is not a sink (``write_cycle`` and ``close``)."""
    if callable(getattr(sinks, "write_cycle", None)) or isinstance(sinks, str | bytes):
        raise ValueError(f"sinks must be a list of sinks, got {sinks!r}: pass sinks=[{type(sinks).__name__}(...)]")
    sinks = list(sinks)
    for sink in sinks:
        if isinstance(sink, type):
            raise ValueError(f"sinks: {sink.__name__} is a class: pass an instance, {sink.__name__}(...)")
        if not (callable(getattr(sink, "write_cycle", None)) and callable(getattr(sink, "close", None))):
            raise ValueError(f"sinks: {sink!r} is not a sink: a sink has write_cycle(report, display) and close(run) "
                             "methods (see fxprof_lightning.outputs.sinks.Sink and the CsvSink there)")
    return sinks
