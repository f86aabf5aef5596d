"""``Stage``: the schedule position and cycles of one loop (training steps or validation steps), and the names of
the cycles' directories (``cycle_name``). The engine (``profiler.Engine``) holds one per loop."""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fxprof_lightning.analysis.history import StageHistory
from fxprof_lightning.engine.cycle import Cycle
from fxprof_lightning.engine.follow import Follow, Trigger
from fxprof_lightning.engine.ranks import all_gather
from fxprof_lightning.layout import CYCLE_PREFIXES
from fxprof_lightning.report import CycleReport
from fxprof_lightning.schedule import ProfilerAction, Schedule

__all__ = ["IDLE_FOREVER", "RECORDING", "Stage", "cycle_name"]

RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
IDLE_FOREVER = 2**62  # ``idle_steps_ahead`` when no step will be traced again


@dataclass
class Stage:
    """Schedule position and cycles of one loop: training steps or validation steps."""

    name: str  # "train" or "val"
    step: int = 0
    open: Cycle | None = None
    in_step: bool = False  # begin_step was called and end_step not yet
    cycles: list[CycleReport] = field(default_factory=list)
    directories: list[Path] = field(default_factory=list)  # written in this run, oldest first
    last_index: tuple[int, int] | None = None  # the cycle opened last (index, triggered), to name a cut cycle's pieces
    piece: int = 0
    history: StageHistory = field(default_factory=StageHistory)  # what the analysis remembers across cycles
    extra: list[int] = field(default_factory=list)  # steps the open cycle records in place of dropped ones (``_extend``)
    planned: dict[int, ProfilerAction] = field(default_factory=dict)  # a cycle out of the schedule (``plan``)
    trigger: Trigger | None = None  # why the planned (or next scheduled) cycle runs, when not the schedule alone
    triggered: int = 0  # cycles out of the schedule so far (``-tN`` in their directories' names)
    skipped: set[int | None] = field(default_factory=set)  # scheduled cycles the budget left out (``within``)

    def directory_for(self, dirpath: Path, index: int, taken: set[str]) -> Path:
        """The directory of the cycle ``index`` opening now (a new piece of a cycle cut earlier gets its own)."""
        triggered = self.triggered if self.planned else 0
        self.piece = self.piece + 1 if (index, triggered) == self.last_index else 0
        self.last_index = (index, triggered)
        directory = dirpath / cycle_name(CYCLE_PREFIXES[self.name], index, self.piece, taken, triggered)
        directory.mkdir(parents=True, exist_ok=True)
        if not self.directories or self.directories[-1] != directory:
            self.directories.append(directory)
        return directory

    def action(self, schedule: Schedule, step: int) -> ProfilerAction:
        """What ``step`` is: the schedule's action, but for the steps the open cycle records in place of the
        recorded steps it dropped (``extend``)."""
        if self.extra and self.extra[0] - 1 <= step <= self.extra[-1]:
            return ProfilerAction.RECORD_AND_SAVE if step == self.extra[-1] else ProfilerAction.RECORD
        planned = self.planned.get(step)
        if planned is not None:
            return planned
        return ProfilerAction.NONE if self.skipped and schedule.cycle_of(step) in self.skipped else schedule.action(step)

    def plan(self, schedule: Schedule, trigger: Trigger, first: int) -> None:
        """A cycle out of the schedule from step ``first``: the schedule's warm-up (at least one step: a capture
        happens there) and ``trigger.active`` recorded steps (or the schedule's). Where the schedule traces one of
        those steps, its cycle answers the trigger instead."""
        warmup = max(schedule.warmup, 1)
        steps = list(range(first, first + warmup + (trigger.active or schedule.active)))
        if self.trigger is None:
            self.trigger = trigger
        if self.planned or self.extra or any(schedule.action(s) is not ProfilerAction.NONE for s in steps):
            return
        self.planned = {s: ProfilerAction.WARMUP if i < warmup else ProfilerAction.RECORD for i, s in enumerate(steps)}
        self.planned[steps[-1]] = ProfilerAction.RECORD_AND_SAVE
        self.triggered += 1

    def watched(self, schedule: Schedule, follow: Follow, step: int) -> bool:
        """The end of a training step for the follower (``Engine.end_step``): its idle steps are watched, and a
        trigger plans a cycle. Decided by the schedule and the plans alone, as every rank has them (a rank whose profiling failed too): the
        ranks' agreements in ``Follow.tick`` are collectives."""
        if self.action(schedule, step) is not ProfilerAction.NONE or self.planned or self.extra:
            follow.skip()
            return False
        trigger = follow.tick(step)
        if trigger is not None:
            self.plan(schedule, trigger, step + 1)
        return trigger is not None

    def index_at(self, schedule: Schedule, step: int) -> int:
        """The index of the cycle opening at ``step``: the schedule's; a planned cycle takes that of the scheduled
        cycle it comes before (``cycle_0003-t1`` runs before ``cycle_0003``'s traced steps)."""
        index = schedule.cycle_of(step)
        if index is None:  # before skip_first, or after the last of ``repeat`` cycles
            index = schedule.repeat if schedule.repeat and step >= schedule.skip_first else 0
        return index

    def traced(self, schedule: Schedule, index: int) -> dict[int, ProfilerAction]:
        """The open cycle's warm-up and recorded steps, with their actions."""
        if self.planned:
            return dict(self.planned)
        return {s: schedule.action(s) for s in schedule.traced_steps(index)}

    def recorded(self, schedule: Schedule, index: int) -> list[int]:
        return [s for s, action in self.traced(schedule, index).items() if action in RECORDING]

    def opened(self, follow: Follow | None, schedule: Schedule, index: int, directory: Path) -> None:
        """A cycle opens: the request it answers, if any, learns which (the ``trigger`` command waits for that); a
        training cycle's cost is measured from now."""
        if follow is not None and self.trigger is not None:
            follow.answered(self.trigger, directory.name, self.recorded(schedule, index))
        if follow is not None and self.name == "train":
            follow.open(self.step)

    def within(self, follow: Follow | None, schedule: Schedule, step: int) -> bool:
        """At the first step of a scheduled training cycle (every rank): whether the budget lets it run; if not, its
        steps are idle, and those of the later cycles that begin before the budget would let one run (the wait
        stretched by as many cycles: one stretch of idle steps, ``idle``)."""
        if (self.name != "train" or follow is None or follow.budget is None or self.planned
                or step != schedule.first_traced_step(schedule.cycle_of(step))):
            return True
        if self.trigger is not None and self.trigger.kind == "request":
            return True  # (a request always runs)
        held = follow.held()
        if not held:
            return True
        index, left = schedule.cycle_of(step), []
        while index is not None and schedule.first_traced_step(index) < step + held:
            self.skipped.add(index)
            left.append(index)
            index = index + 1 if not schedule.repeat or index + 1 < schedule.repeat else None
        follow.absent(left, f"left out to keep profiling within overhead_budget={follow.budget:g} (it had cost "
                            f"{100 * follow.share():.2f}% of the run's wall time)")
        if self.trigger is not None and self.trigger.kind == "anomaly":  # answered by no later cycle
            self.trigger = None
        return False

    def next_traced(self, schedule: Schedule) -> int | None:
        """The first step from the next one that is traced (planned or scheduled)."""
        scheduled = schedule.next_traced_step(self.step)
        while scheduled is not None and schedule.cycle_of(scheduled) in self.skipped:  # (left out by the budget)
            scheduled = schedule.next_traced_step(schedule.first_traced_step(schedule.cycle_of(scheduled) + 1))
        planned = min((s for s in self.planned if s >= self.step), default=None)
        return min((s for s in (scheduled, planned) if s is not None), default=None)

    def idle_steps_ahead(self, schedule: Schedule) -> int:
        """``Engine.idle_steps_ahead``: 0 while a cycle is open or a step is in progress."""
        if self.open is not None or self.in_step or self.extra:  # (extra: also where profiling failed)
            return 0
        # By the schedule alone, also when profiling failed: a cycle's last step still takes part in the gather.
        traced = self.next_traced(schedule)
        return IDLE_FOREVER if traced is None else traced - self.step

    def step_ended(self, schedule: Schedule, step: int, action: ProfilerAction) -> None:
        """After the open cycle's ``end_step``: at its last recorded step, ``extend`` it; then end the step in its trace."""
        if action is ProfilerAction.RECORD_AND_SAVE:
            self.extend(schedule, step)
        if self.open is not None:
            self.open.step_trace()

    def extend(self, schedule: Schedule, step: int) -> None:
        """At the open cycle's last recorded step (``step``): record more steps in place of those it dropped
        (``Cycle.steps_wanted``), as long as the schedule leaves them idle; as many as the rank that dropped the most
        asks for, so that every rank records the same steps."""
        wanted = max(all_gather(self.open.steps_wanted(schedule.active) if self.open is not None else 0))
        more = []
        for later in range(step + 1, step + 1 + max(wanted, 0)):
            if schedule.action(later) is not ProfilerAction.NONE:
                break
            more.append(later)
        if more:
            self.extra = [*self.extra, *more]
            if self.open is not None and self.open.trace is not None:
                self.open.trace.extend(more)

    def drop(self, cycle: Cycle) -> None:
        """A cycle cut during warm-up: nothing to report (a trace holds no recorded step); the rest of the cycle,
        if it comes, opens a new piece."""
        for path in cycle.trace.paths if cycle.trace is not None else []:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            cycle.directory.rmdir()
        if self.directories and self.directories[-1] == cycle.directory:
            self.directories.pop()

    def forget_old_cycles(self, keep: int | None, rank: int) -> None:
        """Keep the newest ``keep`` cycles' reports and directories (None: all)."""
        if keep is None:
            return
        del self.cycles[:-keep]
        while len(self.directories) > keep:
            old = self.directories.pop(0)
            for path in old.glob(f"rank{rank}.*"):  # this rank's traces (its node's disk)
                path.unlink(missing_ok=True)
            if rank == 0:
                shutil.rmtree(old, ignore_errors=True)



def cycle_name(prefix: str, index: int, piece: int, taken: set[str], triggered: int = 0) -> str:
    """``cycle_0003`` (``-p1`` for the second piece of a cut cycle), with ``-r1``, ``-r2``... only when an
    earlier run in the same directory took that name.

    Example:
        >>> cycle_name("cycle_", 3, 0, {"cycle_0003"}), cycle_name("cycle_", 4, 0, {"cycle_0003"})
        ('cycle_0003-r1', 'cycle_0004')
    """
    name = f"{prefix}{index:04d}" + (f"-t{triggered}" if triggered else "") + (f"-p{piece}" if piece else "")
    run = 0
    while (f"{name}-r{run}" if run else name) in taken:
        run += 1
    return f"{name}-r{run}" if run else name
