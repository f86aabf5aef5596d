"""Sinks: where a finished cycle's report goes (files, TensorBoard, the console).

A sink is any object with ``write_cycle(report, profiler)``, called on global rank 0 after each
cycle that timed nodes, and ``close(profiler)``, called on rank 0 when profiling ends. Sinks are
handed in (``Profiler(..., sinks=[...])``), as ``on_trace_ready`` is to ``torch.profiler``; they
read the report and the profiler's settings (``top_k``, ``module_depth``) and never reach back
into collection. The Lightning callback adds one that writes to the Trainer's loggers.

Tags are shared by every sink that logs scalars or text (``cycle_scalars``, ``cycle_texts``):
``fxprof/fwd_ms/<node>``, ``fxprof/bwd_ms/<node>``, ``.../total``, ``fxprof/nodes``,
``fxprof/modules``; validation cycles use ``fxprof/val/...``. The step is the cycle's last
recorded step.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fxprof_lightning.report import CycleReport

if TYPE_CHECKING:
    from fxprof_lightning.engine import Profiler

__all__ = ["ConsoleSink", "CsvSink", "Sink", "TensorBoardSink", "cycle_scalars", "cycle_texts", "tag_prefix"]


class Sink(Protocol):
    def write_cycle(self, report: CycleReport, profiler: Profiler) -> None: ...

    def close(self, profiler: Profiler) -> None: ...


def tag_prefix(report: CycleReport) -> str:
    """``fxprof`` for training cycles, ``fxprof/val`` for validation cycles."""
    return "fxprof/val" if report.stage == "val" else "fxprof"


def cycle_scalars(report: CycleReport, top_k: int) -> dict[str, float]:
    """The cycle's scalars: mean ms per call of the ``top_k`` slowest nodes, and the totals per step."""
    prefix, top = tag_prefix(report), report.nodes[:top_k]
    metrics = {f"{prefix}/fwd_ms/{n.name}": n.mean_ms for n in top}
    metrics[f"{prefix}/fwd_ms/total"] = report.forward_ms_per_step
    if report.backward_ms_per_step:
        metrics.update({f"{prefix}/bwd_ms/{n.name}": n.bwd_mean_ms for n in top if n.bwd_calls})
        metrics[f"{prefix}/bwd_ms/total"] = report.backward_ms_per_step
    return metrics


def cycle_texts(report: CycleReport, top_k: int, module_depth: int) -> dict[str, str]:
    """The cycle's text entries: the node table (Markdown) and, when there is one, the module tree."""
    prefix = tag_prefix(report)
    texts = {f"{prefix}/nodes": report.to_markdown(top_k)}
    if report.modules:
        texts[f"{prefix}/modules"] = report.modules_to_text(module_depth)
    return texts


class CsvSink:
    """``fx_nodes.csv``, ``fx_modules.csv`` (and ``fsdp_ranges.csv``) in the cycle's directory, written atomically."""

    def write_cycle(self, report: CycleReport, profiler: Profiler) -> None:
        write_atomically(report.directory / "fx_nodes.csv", report.to_csv(), profiler.name)
        if report.modules:
            write_atomically(report.directory / "fx_modules.csv", report.modules_to_csv(), profiler.name)
        if report.ranges:
            write_atomically(report.directory / "fsdp_ranges.csv", report.ranges_to_csv(), profiler.name)

    def close(self, profiler: Profiler) -> None:
        pass


class TensorBoardSink:
    """Scalars and text to a ``torch.utils.tensorboard.SummaryWriter``, with the callback's tags.

    Example:
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> Profiler(model, sinks=[CsvSink(), TensorBoardSink(SummaryWriter("runs/exp1"))])
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write_cycle(self, report: CycleReport, profiler: Profiler) -> None:
        step = report.steps[-1]
        for tag, value in cycle_scalars(report, profiler.top_k).items():
            self.writer.add_scalar(tag, value, global_step=step)
        for tag, text in cycle_texts(report, profiler.top_k, profiler.module_depth).items():
            self.writer.add_text(tag, text, global_step=step)
        self.writer.flush()

    def close(self, profiler: Profiler) -> None:
        self.writer.flush()


class ConsoleSink:
    """Prints a summary of the slowest nodes when profiling ends (and, with ``every_cycle``, one line per cycle).

    Args:
        every_cycle: also print one line as each cycle is written.
        logdir: the directory to name in the ``tensorboard --logdir`` hint (default: the profiler's ``dirpath``).
    """

    def __init__(self, every_cycle: bool = False, logdir: str | os.PathLike | None = None) -> None:
        self.every_cycle = every_cycle
        self.logdir = logdir

    def write_cycle(self, report: CycleReport, profiler: Profiler) -> None:
        if self.every_cycle:
            stage = "validation cycle" if report.stage == "val" else "cycle"
            partial = " (partial)" if report.partial else ""
            line = (f"{profiler.name}: {stage} {report.index}{partial}, steps {report.steps[0]}-{report.steps[-1]}: "
                    f"forward {report.forward_ms_per_step:.3f} ms")
            if report.backward_ms_per_step:
                line += f", backward {report.backward_ms_per_step:.3f} ms"
            print(f"{line} per step over {len(report.nodes)} nodes -> {report.directory}")

    def close(self, profiler: Profiler) -> None:
        if profiler.cycles:
            print(summary(profiler.cycles, profiler.name, profiler.dirpath, self.logdir or profiler.dirpath))


def summary(cycles: list[CycleReport], name: str, out_dir: Path, logdir: str | os.PathLike) -> str:
    """The end-of-run text: how many cycles, the slowest nodes of the last one, where the traces are."""
    last = cycles[-1]
    lines = [f"{name}: {len(cycles)} cycle(s) recorded; output in {out_dir}"]
    if last.nodes:
        partial = ", partial" if last.partial else ""
        lines.append(
            f"Slowest nodes of cycle {last.index} (steps {last.steps[0]}-{last.steps[-1]}{partial}), "
            "mean ms per call (share of all nodes):"
        )
        for n in last.nodes[:5]:
            lines.append(f"  {n.name:<28} {n.op:<14} forward {n.mean_ms:9.3f} ({n.pct:4.1f} %)  "
                         f"backward {n.bwd_mean_ms:9.3f} ({n.bwd_pct:4.1f} %)")
    if any(c.trace_paths for c in cycles):
        lines.append(f"Traces: {last.directory}. View them with: tensorboard --logdir {logdir}")
    return "\n".join(lines)


def write_atomically(path: Path, text: str, name: str = "fxprof") -> None:
    """Write ``text`` to ``path`` in one ``os.replace``; on failure warn and go on."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        warnings.warn(f"{name}: could not write {path}: {error}", stacklevel=2)
