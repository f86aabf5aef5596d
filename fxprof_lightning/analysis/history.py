"""``StageHistory``: what a stage's analysis remembers across cycles (tracked nodes, recent node tables, the
regression watch), and ``analyse``, which turns a cycle's tables into what its report says beyond them (an
``Analysis``: values, the report itself is not changed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxprof_lightning.analysis.advice import advise
from fxprof_lightning.analysis.memory_growth import saved_growth
from fxprof_lightning.analysis.memory_plan import CheckpointPlan, checkpoint_plan
from fxprof_lightning.analysis.regressions import step_rows
from fxprof_lightning.analysis.roofline import Peaks, describe_peaks, raised_to, with_roofline
from fxprof_lightning.analysis.watch import RegressionWatch
from fxprof_lightning.report import CycleReport, NodeStats

__all__ = ["HISTORY", "Analysis", "StageHistory"]

HISTORY = 20  # recent cycles kept per stage for regressions and advice


@dataclass(frozen=True)
class Analysis:
    """What a cycle's report says beyond its tables (``StageHistory.analyse``); ``CycleReport``'s fields of the same
    names take them (the engine puts them in)."""

    nodes: list[NodeStats]  # the report's rows, with the roofline columns where the peaks are known
    tracked: list[str]
    peaks: str | None  # the peaks in words (``describe_peaks``)
    distortion: str | None
    regressions: list[Any]
    unconfirmed: list[Any]
    advice: list[str]
    checkpoint_plan: CheckpointPlan | None


@dataclass
class StageHistory:
    """The analysis history of one stage (training or validation steps) of a run."""

    tracked: list[str] | None = None  # the nodes whose scalar series the run logs (first cycle's top_k, then slowest)
    tables: list[list[NodeStats]] = field(default_factory=list)  # node tables of the recent cycles (advice)
    watch: RegressionWatch = field(default_factory=lambda: RegressionWatch(history=HISTORY))  # trust, regressions
    saved: list[tuple[list[NodeStats], int, int | None]] = field(default_factory=list)  # (nodes, steps, batch size)

    def analyse(self, report: CycleReport, peaks: Peaks | None, top_k: int,
                tracked: list[str] | None = None) -> tuple[Analysis, Peaks | None]:
        """The report's tracked nodes, roofline, trust, regressions and advice (rank 0), and the peaks, raised when a
        node beat a measured one (it was too low). The report is read, not changed. The tracked nodes: ``tracked``
        (another stage's, as it grows), else the stage's first cycle's ``top_k`` slowest, and each later cycle's
        slowest from that cycle on."""
        if tracked and (self.tracked is None or tracked[:len(self.tracked)] == self.tracked):
            self.tracked = list(tracked)
        elif self.tracked is None:
            self.tracked = [n.name for n in report.nodes[:top_k]]
        elif report.nodes and report.nodes[0].name not in self.tracked:
            self.tracked.append(report.nodes[0].name)
        nodes, described = report.nodes, report.peaks
        if peaks is not None:
            nodes = with_roofline(nodes, peaks)
            if peaks.source != "given" and any(n.pct_of_peak is not None and n.pct_of_peak > 100 for n in nodes):
                peaks = raised_to(peaks, nodes)
                nodes = with_roofline(nodes, peaks)
            described = describe_peaks(peaks)
        verdict = self.watch.check(nodes, report.step_ms, report.step_cpu_ms, report.partial, report.modules,
                                   step_rows(report), report.step_wait_ms)
        self.tables = [*self.tables, nodes][-HISTORY:]
        earlier = [(table, steps) for table, steps, batch in self.saved if batch == report.batch_size]
        grown = saved_growth(earlier, nodes, len(report.steps)) if earlier else []
        self.saved = [*self.saved, (nodes, len(report.steps), report.batch_size)][-HISTORY:]
        step_ms = sum(report.step_ms) / len(report.step_ms) if report.step_ms else 0.0
        plan = checkpoint_plan(report.modules, step_ms) if report.stage == "train" else None
        advice = advise(nodes, self.tables, verdict.regressions, report.ranks, phases=report.phases,
                        host_reads=getattr(report.capture, "host_reads", None),
                        on_cpu=peaks is not None and peaks.device.startswith("cpu"), plan=plan, grown=grown)
        analysis = Analysis(nodes, list(self.tracked), described, verdict.distortion, verdict.regressions,
                            verdict.unconfirmed, advice, plan)
        return analysis, peaks
