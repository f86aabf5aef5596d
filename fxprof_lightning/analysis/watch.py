"""Watching a run: each cycle checked against the sound cycles before it, as the engine does during training and
``fxprof report`` afterwards (``RegressionWatch``), and what one check found (``Verdict``).

The comparisons themselves are ``regressions``' (pure functions over node tables); this module keeps the run's
state: the baseline of recent sound cycles, the flags waiting for the next cycle to confirm them, the cycle held out
of the baseline while its flags are in question. Load from other processes is told from work twice: a cycle whose
threads waited for a core too long is skipped (``trust.distortion``), and a slower row whose added time the
threads' extra waiting explains (they waited for a core at least half that much longer per step than in the sound
cycles before) waits for a cycle without that load to confirm it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from fxprof_lightning.analysis.regressions import (
    CONFIRM_SPREAD,
    MIN_ADDED_MS,
    MIN_BASELINE,
    ROWS_OUTSIDE,
    SAME_LEVEL,
    Regression,
    added_per_step,
    beyond_doubt,
    find_regressions,
    module_rows,
    new_rows,
    outside_explained,
    same_level,
    shared_factor,
)
from fxprof_lightning.analysis.trust import distortion, waited_out
from fxprof_lightning.report import ModuleStats, NodeStats, cpu_per_wall, step_spread, waited_share

__all__ = ["RegressionWatch", "Verdict"]


@dataclass
class Verdict:
    """What one cycle's check found (``RegressionWatch.check``).

    ``skipped`` says why the cycle was not checked (partial, distorted, baseline still short), None if it was;
    ``distortion`` the load signature when distorted. ``regressions`` are confirmed: flagged in this cycle and
    in the sound cycle before it, still adding at least ``same_level`` (``SAME_LEVEL`` by default) x what it added
    there (a change in the code stays or grows, load comes and goes: the plain loop's "other" phase rose 4x, then
    1.6x, in an identical run), or so large in this one that noise cannot explain it (``beyond_doubt``, the steps
    regular, the step slower by at least half the node's added time). Neither counts where the cycle's threads waited
    for a core at least half the row's added time per step longer than in the sound cycles before: that load explains
    it, and the row stays unconfirmed. Rows adding under ``MIN_ADDED_MS`` per step are not flagged. ``unconfirmed`` are flagged for the first time: the next cycle confirms them or not.
    """

    skipped: str | None = None
    distortion: str | None = None
    regressions: list[Regression] = field(default_factory=list)
    unconfirmed: list[Regression] = field(default_factory=list)


def _at_level_before(table: Sequence[NodeStats], regressions: list[Regression],
                     before: Sequence[NodeStats]) -> list[NodeStats]:
    """``table`` as it joins the baseline: each row of a confirmed regression at its level ``before`` (the last
    baseline table's row; a new row left out, and so are the new nodes of a module flagged as ``module <path>``), so
    that the slowdown stays flagged in every cycle while it lasts instead of becoming the level later cycles are
    compared with."""
    slower, old = {r.node for r in regressions}, {s.name: s for s in before}
    modules = [r.node.removeprefix("module ") for r in regressions if r.node.startswith("module ")]
    # A flagged module's new nodes stay new: the module, not they, is compared with the run before the slowdown.
    slower |= {s.name for s in table if s.name not in old and s.op not in ROWS_OUTSIDE and any(
        s.module_path == m or s.module_path.startswith(m + ".") for m in modules)}
    return [old.get(s.name, s) if s.name in slower else s for s in table if s.name not in slower or s.name in old]


class RegressionWatch:
    """Checks a run's cycles in order, as the engine does during training and ``fxprof report`` afterwards.

    Each cycle is checked against the last ``baseline_cycles`` sound cycles before it (once there are
    ``MIN_BASELINE``; with fewer, from one, only a change beyond doubt is flagged, and reported once the next sound
    cycle confirms it: a regression starting while the baseline is short is not taken into it as a level the run
    had, and a one-cycle jump of a node with two modes, such as ResNet18's ``layer4.0.conv2`` backward, is no
    alarm); a sound cycle (complete, not distorted by load, ``trust.distortion``) then joins the
    baseline. A flag is reported once confirmed (see ``Verdict``); a cycle whose only flags are unconfirmed
    joins the baseline only if the next sound cycle confirms them (a blip must not raise the baseline, nor
    hide the regression it was the start of). A confirmed regression's row joins at its level before, so the
    slowdown is flagged in every cycle while it lasts (a new row stays new), and no more once it is gone.

    >>> from fxprof_lightning.report import NodeStats
    >>> def table(fc, other=1.0):
    ...     return [NodeStats("fc", "call_module", "fc", "fc", 3, fc, fc, fc, fc, 3 * fc, 50.0)] + [
    ...         NodeStats(f"n{i}", "call_module", "n", "n", 3, other, other, other, other, 3 * other, 10.0) for i in range(5)]
    >>> watch = RegressionWatch()
    >>> [watch.check(table(1.0), [9.0, 9.1, 9.0]).skipped for _ in range(3)]
    ['baseline: 0 of 3 earlier cycles', 'baseline: 1 of 3 earlier cycles', 'baseline: 2 of 3 earlier cycles']
    >>> first = watch.check(table(1.8), [11.4, 11.5, 11.4])  # 1.8x: flagged, not yet confirmed
    >>> [r.node for r in first.unconfirmed], first.regressions
    (['fc'], [])
    >>> [r.node for r in watch.check(table(1.8), [11.4, 11.5, 11.4]).regressions]  # it persists: confirmed
    ['fc']
    >>> [r.node for r in watch.check(table(1.8), [11.4, 11.5, 11.4]).regressions]  # flagged while it lasts
    ['fc']
    >>> watch.check(table(1.0), [9.0, 9.1, 9.0]).regressions  # gone
    []
    """

    def __init__(self, baseline_cycles: int = 5, history: int = 20, same_level: float = SAME_LEVEL,
                 **options: float | bool) -> None:
        self.baseline_cycles, self.history, self.same_level, self.options = baseline_cycles, history, same_level, options
        self.baseline: list[Sequence[NodeStats]] = []  # the recent sound cycles' tables
        self.medians: list[float] = []  # and their median step ms
        self.cpu: list[float] = []  # and their CPU s per wall s
        self.wait: list[float] = []  # and the share of their wall time our threads waited for a core (where known)
        self._flagged: dict[tuple[str, str], float] = {}  # flagged in the last sound cycle: ms per call it added
        self._held: tuple[Sequence[NodeStats], float, float | None, float | None] | None = None  # that cycle, if only flags in question

    def _confirms(self, change: Regression) -> bool:
        """Whether the same row was flagged in the sound cycle before at the same level (``same_level``)."""
        return same_level(self._flagged.get((change.node, change.direction)), change.now_ms - change.baseline_ms,
                          self.same_level)

    def check(self, nodes: Sequence[NodeStats], step_ms: list[float], step_cpu_ms: list[float] = (),
              partial: bool = False, modules: Sequence[ModuleStats] = (), steps: Sequence[NodeStats] = (),
              step_wait_ms: Sequence[float] = ()) -> Verdict:
        """``modules``: the cycle's module tree; a module slower per step that has nodes the last baseline cycle
        did not (a loop run more times, a branch taken) is flagged as ``"module <path>"`` (see ``module_rows``).
        ``steps``: the step's time outside the node rows as rows (``step_rows``), watched as the nodes are.
        ``step_wait_ms``: the process's threads' wait for a core in each recorded step, where Linux says (``trust``)."""
        if partial:
            return Verdict(skipped="partial")
        recent = self.baseline[-self.baseline_cycles:]
        shared = shared_factor(recent, nodes) if recent else 1.0
        cpu, wait = cpu_per_wall(step_ms, list(step_cpu_ms)), waited_share(step_ms, list(step_wait_ms))
        load = distortion(step_ms, self.medians, shared, cpu, self.cpu, wait, self.wait)
        if load is not None:
            return Verdict(skipped="distorted", distortion=load)
        verdict = Verdict()
        rows = [*nodes, *module_rows(modules), *steps]
        short = len(self.baseline) < MIN_BASELINE  # the cycle-to-cycle noise is not known yet: only the clear count
        if self.baseline:
            flagged = find_regressions(self.baseline, rows, self.baseline_cycles, min_baseline=1, **self.options)
            before = {s.name for s in self.baseline[-1] if s.op not in ROWS_OUTSIDE}
            new_in = {s.module_path for s in nodes if s.name not in before}  # modules with nodes the baseline lacks
            flagged = [r for r in flagged if not r.node.startswith("module ") or any(
                p == r.node[7:] or p.startswith(r.node[7:] + ".") for p in new_in)]  # else its nodes tell it better
            by_name = {s.name: s for s in rows}
            steps = max(len(step_ms), 1)
            median_step = statistics.median(step_ms) if step_ms else 0.0
            modules = [r.node.removeprefix("module ") for r in flagged if r.node.startswith("module ")]
            flagged += [d.regression() for d in new_rows(self.baseline, nodes, steps, median_step)  # (new nodes
                        if not any(by_name[d.node].module_path == m or by_name[d.node].module_path.startswith(m + ".")
                                   for m in modules)]  # of a module flagged as one: the module says it)
            flagged = outside_explained(flagged, by_name, steps, median_step)
            flagged = [r for r in flagged if added_per_step(by_name[r.node], r, steps) >= MIN_ADDED_MS]
            step_rise = median_step - statistics.median(self.medians) if step_ms and self.medians else 0.0
            regular = (step_spread(step_ms) or 0.0) <= CONFIRM_SPREAD
            for r in flagged:
                stats, added = by_name[r.node], added_per_step(by_name[r.node], r, steps)
                # (a row outside the nodes, one value per cycle, is confirmed by the next sound cycle only: it
                # moves with the nodes' work, and noise cannot be told from one cycle)
                explained = waited_out(added, wait, self.wait, median_step)  # (load: the next cycle tells)
                clear = (not explained and stats.op not in ("step", "unowned") and regular
                         and beyond_doubt(stats, r, steps, median_step) and step_rise >= added / 2)
                if not explained and (self._confirms(r) or (clear and not short)):
                    verdict.regressions.append(r)
                elif clear or not short:  # (on a short baseline, only a change beyond doubt is flagged at all)
                    verdict.unconfirmed.append(r)
            self._flagged = {(r.node, r.direction): r.now_ms - r.baseline_ms
                             for r in (*verdict.regressions, *verdict.unconfirmed)}
        if short and not verdict.regressions and not verdict.unconfirmed:
            verdict.skipped = f"baseline: {len(self.baseline)} of {MIN_BASELINE} earlier cycles"
        entry = (rows, statistics.median(step_ms or [0.0]), cpu, wait)
        if verdict.unconfirmed and not verdict.regressions:
            self._held = entry  # in question: kept out of the baseline until the next sound cycle decides
            return verdict
        held, self._held = self._held, None
        before = self.baseline[-1] if self.baseline else []
        for table, median, used, waited in ([held] if held is not None and verdict.regressions else []) + [entry]:
            table = _at_level_before(table, verdict.regressions, before)
            self.baseline = [*self.baseline, table][-self.history:]
            self.medians = [*self.medians, median][-self.history:]
            if used is not None:
                self.cpu = [*self.cpu, used][-self.history:]
            if waited is not None:
                self.wait = [*self.wait, waited][-self.history:]
        return verdict
