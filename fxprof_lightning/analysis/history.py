"""``StageHistory``: what a stage's analysis remembers across cycles (tracked nodes, recent node tables, the
regression watch), and ``analyse``, which turns a cycle's tables into what its report says beyond them."""

from __future__ import annotations

from dataclasses import dataclass, field

from fxprof_lightning.analysis.advice import advise
from fxprof_lightning.analysis.regressions import RegressionWatch, step_rows
from fxprof_lightning.analysis.roofline import Peaks, describe_peaks, raised_to, with_roofline
from fxprof_lightning.report import CycleReport, NodeStats

__all__ = ["HISTORY", "StageHistory"]

HISTORY = 20  # recent cycles kept per stage for regressions and advice


@dataclass
class StageHistory:
    """The analysis history of one stage (training or validation steps) of a run."""

    tracked: list[str] | None = None  # the nodes whose scalar series the run logs (first cycle's top_k, then slowest)
    tables: list[list[NodeStats]] = field(default_factory=list)  # node tables of the recent cycles (advice)
    watch: RegressionWatch = field(default_factory=lambda: RegressionWatch(history=HISTORY))  # trust, regressions

    def analyse(self, report: CycleReport, peaks: Peaks | None, top_k: int,
                tracked: list[str] | None = None) -> Peaks | None:
        """Fill in the report's tracked nodes, roofline, trust, regressions and advice (rank 0). Returns the peaks,
        raised when a node beat a measured one (it was too low). The tracked nodes: ``tracked`` (another stage's, as
        it grows), else the stage's first cycle's ``top_k`` slowest, and each later cycle's slowest from that cycle on."""
        if tracked and (self.tracked is None or tracked[:len(self.tracked)] == self.tracked):
            self.tracked = list(tracked)
        elif self.tracked is None:
            self.tracked = [n.name for n in report.nodes[:top_k]]
        elif report.nodes and report.nodes[0].name not in self.tracked:
            self.tracked.append(report.nodes[0].name)
        report.tracked = list(self.tracked)
        if peaks is not None:
            report.nodes = with_roofline(report.nodes, peaks)
            if peaks.source != "given" and any(n.pct_of_peak is not None and n.pct_of_peak > 100 for n in report.nodes):
                peaks = raised_to(peaks, report.nodes)
                report.nodes = with_roofline(report.nodes, peaks)
            report.peaks = describe_peaks(peaks)
        verdict = self.watch.check(report.nodes, report.step_ms, report.step_cpu_ms, report.partial, report.modules,
                                   step_rows(report))
        report.distortion, report.regressions, report.unconfirmed = verdict.distortion, verdict.regressions, verdict.unconfirmed
        self.tables = [*self.tables, report.nodes][-HISTORY:]
        report.advice = advise(report.nodes, self.tables, report.regressions, report.ranks, phases=report.phases,
                               host_reads=getattr(report.capture, "host_reads", None),
                               on_cpu=peaks is not None and peaks.device.startswith("cpu"))
        return peaks
