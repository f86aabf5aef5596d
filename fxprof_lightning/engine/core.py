"""``Engine``: the profiling engine under ``Profiler`` (``profiler.py``) and the Lightning callback.

Data flows one way: step -> schedule -> cycle -> statistics -> gather -> report -> sinks.

* ``begin_step``/``end_step`` end a step and begin the next, as ``torch.profiler.profile.step`` does; the schedule
  (``schedule.Schedule``) and the stage (``stage.Stage``) say what each step is;
* a cycle (``cycle.Cycle``) opens at its first traced step (``open_cycle``), in a directory of its own, with a
  ``torch.profiler`` session (``torch_trace.CycleTrace``) and a node timer (``timers``);
* at its last recorded step the timer's samples become per-node statistics (``statistics``), the
  ranks' tables are gathered and merged, and rank 0 hands the ``CycleReport`` to the sinks (``close_cycle``).

Decided in one place each: which timer times the module (``timers.Timers``), where backward times
come from (``cycle.BackwardSource``), what the analysis remembers (``history.StageHistory``), the name of a
cycle's directory (``stage.cycle_name``). Nothing here knows Lightning: ``callback.FXProfilerCallback`` maps
Trainer hooks onto ``begin_run``/``begin_stage``/``begin_step``/``end_step``/``end_stage``/``abort``/``release``.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxprof_lightning import FxprofWarning, torch_api
from fxprof_lightning.analysis.history import Analysis
from fxprof_lightning.analysis.roofline import Peaks, device_peaks
from fxprof_lightning.capture.compiled import is_compiled, missing_for_kernels
from fxprof_lightning.capture.timers import Timers
from fxprof_lightning.engine.cycle import Cycle
from fxprof_lightning.engine.driver_notes import DriverNotes
from fxprof_lightning.engine.follow import Follow, Trigger
from fxprof_lightning.engine.idle import IdleSteps
from fxprof_lightning.engine.ranks import all_gather, broadcast, global_rank, world_size
from fxprof_lightning.engine.settings import OPTIONS, HoldsSettings, Settings, takes_settings
from fxprof_lightning.engine.stage import RECORDING, Stage
from fxprof_lightning.engine.statistics import merge_ranks
from fxprof_lightning.layout import CYCLE_PREFIXES, DEFAULT_DIRPATH
from fxprof_lightning.nodes import NodeInfo
from fxprof_lightning.outputs.sinks import ConsoleSink, CsvSink, Display, PictureSink, RunSummary, Sink, checked_sinks
from fxprof_lightning.report import CycleReport, NodeStats
from fxprof_lightning.schedule import ProfilerAction, Schedule
from fxprof_lightning.timing.state_memory import OptimizerWatch, with_state_bytes
from fxprof_lightning.timing.torch_trace import CycleTrace

__all__ = ["LIFECYCLE", "Engine"]

# The lifecycle in one table, as torch.profiler keeps its own (``profile.action_map``): what a stage does at an edge
# of a step ("begin", "end"; "stage end": its loop stopped after the step), by the schedule's action for that step.
#   collect: open the stage's cycle if none is open, install the timer and start the step (while profiling is on);
#   stop: end the open cycle's step (when one is open);
#   close: gather the ranks' tables and write the cycle. Decided by the schedule alone, so that every rank takes
#     part in the gather, even one whose profiling failed; at "stage end", with what the cut-short cycle recorded.
LIFECYCLE: dict[tuple[str, ProfilerAction], tuple[str, ...]] = {
    ("begin", ProfilerAction.WARMUP): ("collect",),
    ("begin", ProfilerAction.RECORD): ("collect",),
    ("begin", ProfilerAction.RECORD_AND_SAVE): ("collect",),
    ("end", ProfilerAction.NONE): ("stop",),
    ("end", ProfilerAction.WARMUP): ("stop",),
    ("end", ProfilerAction.RECORD): ("stop",),
    ("end", ProfilerAction.RECORD_AND_SAVE): ("stop", "close"),
    ("stage end", ProfilerAction.WARMUP): ("close",),
    ("stage end", ProfilerAction.RECORD): ("close",),
}


class Engine(HoldsSettings):
    """The profiling engine under ``Profiler`` and the Lightning callback: the schedule, the two stages (training
    and validation steps), their cycles, the cross-rank gather and the failure policy, driven by
    ``begin_run``/``begin_stage``/``begin_step``/``end_step``/``end_stage``/``abort``/``end_run``. See ``Profiler`` for the
    settings.
    """

    name = "Profiler"  # starts every warning (the Lightning callback sets its own)
    fixed = OPTIONS - {"dirpath", "peaks"}  # (also the engine's state: the callback sets the directory at setup,
    # measured peaks replace None)

    @takes_settings
    def __init__(self, module: nn.Module | Callable[[], nn.Module] | None, *, sinks: Sequence[Sink] | None = None,
                 settings: Settings | None = None, **options: Any) -> None:
        if settings is not None and (options or not isinstance(settings, Settings)):
            raise TypeError(f"{type(self).__name__}() takes settings= (a Settings) or the options themselves, not both")
        self.settings = settings if settings is not None else Settings.of(type(self).__name__, options)
        if module is None or not (isinstance(module, nn.Module) or callable(module)):
            raise ValueError(f"module must be the nn.Module to profile (or a function returning it), got {module!r}")
        self.module = module
        # The steps followed: the user's schedule (``settings.schedule``, exactly torch.profiler's), with a warm-up step
        # of our own before each cycle where it has none (``Schedule.with_lead``): the same recorded steps.
        self.schedule = self.settings.schedule.with_lead()
        self.dirpath = Path(self.settings.dirpath if self.settings.dirpath is not None else DEFAULT_DIRPATH)
        self.peaks: Peaks | bool | None = self.settings.peaks  # measured at the first report (False: could not be)
        self.sinks: list[Sink] = checked_sinks(sinks) if sinks is not None else [CsvSink(), PictureSink(), ConsoleSink()]

        self.target: nn.Module | None = None  # the module, once resolved (begin_run)
        self._train, self._val = Stage("train"), Stage("val")
        self._current = self._train  # the stage step() advances
        self._enabled = True  # False after a failure inside the profiler
        self._fx_on = self.settings.fx_timing  # False when the target cannot be traced
        self.timers = Timers(self.warn)  # which timer times the module (set up at each begin_run)
        self.notes = DriverNotes(self._recording_cycle)  # the driver's clock of the phases, backward's wall, batch size
        self._taken: set[str] = set()  # directory names in dirpath from earlier runs
        self.follow: Follow | None = None  # cycles out of the schedule: on request, on a jump of the step time
        self.idle = IdleSteps()  # the idle steps ahead, skipped by the driver (``go_idle``)

    @property
    def cycles(self) -> list[CycleReport]:
        """One report per completed (or cut-short) training cycle."""
        return self._train.cycles

    @property
    def val_cycles(self) -> list[CycleReport]:
        """Like ``cycles``, for validation steps (``profile_validation=True``)."""
        return self._val.cycles

    @property
    def step_num(self) -> int:
        """The number of the training step in progress (or the next one), counted from 0."""
        idle = self.idle
        return idle.first + idle.ended() if idle.active else self._train.step

    # ------------------------------------------------------------ the driver API (the Lightning callback)

    def reset(self, train: bool = True) -> None:
        """Forget the module resolved, the cycles and schedule position of validation (and of training, with
        ``train``)."""
        self.idle.wake()
        self.target = None  # resolved at ``begin_run``: the driver may build it before
        if train:
            self._train = Stage("train")
        self._val = Stage("val")
        self._current = self._train

    def begin_run(self) -> None:
        """Resolve the module, forget captures, and list the names in ``dirpath`` that earlier runs took (``open_run``)."""
        open_run(self)

    def begin_stage(self, stage: str = "train") -> None:
        """A loop of ``stage`` starts: ``prepare``, after ``begin_run`` where no run began (validation alone:
        ``trainer.validate``)."""
        if stage == "train" or self.settings.profile_validation:
            if self.target is None:
                self.begin_run()
            self.prepare(stage)

    def prepare(self, stage: str = "train") -> None:
        """Capture the module in its current mode before the stage's first timed step (or start recording a call)."""
        if self._fx_on and self._enabled and (stage == "train" or self.settings.profile_validation):
            started = time.perf_counter()
            self._safely("capturing the module", self.timers.for_module, self.target)
            if self.follow is not None and self.follow.opened is None:  # (outside a training cycle, whose cost has it)
                self.follow.setup_s += time.perf_counter() - started

    def begin_step(self, stage: str = "train") -> None:
        """A step of ``stage`` begins: open its cycle if the schedule says so, and install the timer."""
        state = self._stage(stage)
        if state is None:
            return
        state.in_step = True
        self._edge(state, "begin", state.step)

    def recording(self, stage: str = "train") -> bool:
        """Whether the step in progress of ``stage`` (between ``end_step`` calls: the next one) is a recorded step."""
        state = self._stage(stage)
        return state is not None and self._enabled and state.action(self.schedule, state.step) in RECORDING

    def idle_steps_ahead(self, stage: str = "train") -> int:
        """Steps from the next one that need nothing of the profiler; 0 while a cycle is open or a step is in progress."""
        state = self._stage(stage)
        return state.idle_steps_ahead(self.schedule) if state is not None else 0

    def go_idle(self) -> None:
        """After a training step's end, ``idle`` counts the idle steps ahead but the last (``idle.IdleSteps``)."""
        if self.follow is not None:
            self.idle.begin(self.idle_steps_ahead("train") - 1, self._train, self.follow, self.plan)

    def end_train_step(self) -> None:
        """``end_step`` with the phases of the step; then a clock for the recorded step ahead, or ``go_idle``."""
        self.notes.lap()
        self.end_step("train")
        if not self.time_phases():
            self.go_idle()

    def time_phases(self) -> bool:
        """The driver's clock (``notes``) runs while training steps are recorded (``CycleReport.phases``); whether the
        step in progress is one."""
        recording = self.recording("train")
        self.notes.time(recording, self.target is not None)
        return recording

    def _recording_cycle(self, stage: str) -> Cycle | None:
        """The stage's open cycle while its step in progress is a recorded step, else None."""
        state = self._stage(stage)
        return state.open if state is not None and state.open is not None and self.recording(stage) else None

    def end_step(self, stage: str = "train") -> None:
        """A step of ``stage`` ends: count it, and write the cycle at its last recorded step."""
        state = self._stage(stage)
        if state is None:
            return
        state.in_step = False
        step, state.step = state.step, state.step + 1
        self._edge(state, "end", step)

    def plan(self, trigger: Trigger, step: int) -> None:
        """A cycle out of the schedule from the step after ``step`` (``follow.Follow.tick``'s trigger, or
        ``IdleSteps``')."""
        self._train.plan(self.schedule, trigger, step + 1)

    def end_stage(self, stage: str = "train") -> None:
        """The loop of ``stage`` stopped (or paused): write a cycle it left before its last recorded step."""
        if stage == "train":
            self.idle.wake()
            self.notes.close_clock()
        state = self._stage(stage)
        if state is None:
            return
        if state.step > 0:
            self._lifecycle(state, "stage end", state.step - 1)
        if state.open is not None:  # a step that opened a cycle and never ended
            self._safely("writing a cycle left open", self._close_cycle, state, gather=False)

    def abort(self) -> None:
        """Training stopped with an exception: write this rank's open cycles (no collective) and remove every hook
        (``abort_run``)."""
        abort_run(self)

    def release(self) -> None:
        """The driver lets go of the module: the idle steps' stand-ins and the clock gone, every hook removed."""
        self.idle.wake()
        self.notes.close_clock()
        self.timers.stop()  # (also the hooks waiting for a mode's first call that never came)

    def end_run(self) -> None:
        """Profiling ends: remove the first-call recorders, put Inductor's settings back and let the sinks finish (rank 0)
        (``close_run``)."""
        close_run(self)

    @property
    def rank(self) -> int:
        """Global rank from ``torch.distributed`` (0 when it is not initialised)."""
        return global_rank()

    @property
    def world_size(self) -> int:
        return world_size()

    def warn(self, message: str) -> None:
        """A warning on rank 0, naming the profiler."""
        if self.rank == 0:
            warnings.warn(f"{self.name}: {message}", FxprofWarning, stacklevel=3)

    # ------------------------------------------------------------ steps and cycles

    def _stage(self, name: str) -> Stage | None:
        """The stage's state, or None for validation without ``profile_validation`` (nothing to do)."""
        if name not in CYCLE_PREFIXES:
            raise ValueError(f"stage must be 'train' or 'val', got {name!r}")
        if name == "val" and not self.settings.profile_validation:
            return None
        return self._train if name == "train" else self._val

    def _edge(self, stage: Stage, edge: str, step: int) -> None:
        """``_lifecycle``, then the follower's note of a training step's end; the time of one outside cycles: idle_ns."""
        follow = self.follow if stage is self._train else None
        started, idle = time.perf_counter_ns(), follow is not None and follow.opened is None
        self._lifecycle(stage, edge, step)
        if follow is not None and edge == "end":
            stage.watched(self.schedule, follow, step)
        if idle:
            follow.idle_time(started)

    def _lifecycle(self, stage: Stage, edge: str, step: int) -> None:
        """Do what ``LIFECYCLE`` says for this edge of ``step``, each part under the failure policy."""
        action = stage.action(self.schedule, step)
        if edge == "begin" and action is not ProfilerAction.NONE and not stage.within(self.follow, self.schedule, step):
            action = ProfilerAction.NONE
        for work in LIFECYCLE.get((edge, action), ()):
            if work == "collect" and self._enabled:
                self._safely("starting a profiled step", start_collecting, self, stage, action)
            elif work == "stop":  # (every rank: a cycle's last step may extend it, as every rank must agree)
                if stage.open is not None:
                    self._safely("ending a profiled step", stage.open.end_step, self.target, step, action in RECORDING)
                self._safely("ending a profiled step", stage.step_ended, self.schedule, step, action)
            elif work == "close" and edge == "end" and stage.extra and step < stage.extra[-1]:
                continue  # the cycle goes on with the steps it records in place of dropped ones
            elif work == "close":
                what = "writing a cycle" if edge == "end" else "writing a partial cycle"
                self._safely(what, self._close_cycle, stage, gather=True)

    def _close_cycle(self, stage: Stage, gather: bool) -> None:
        close_cycle(self, stage, gather, self._train.history.tracked if stage is self._val else None)

    # ------------------------------------------------------------ failures

    def _safely(self, what: str, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run profiler work and give its result; on failure warn, stop profiling (None), never break training."""
        try:
            return work(*args, **kwargs)
        except Exception as error:
            message = (f"{self.name} failed while {what}: {type(error).__name__}: {error}. "
                       "Profiling is off for the rest of this run; training goes on.")
            # Every rank says so: a failure on one rank only must not pass unnoticed.
            self._disable()  # first: a warning filtered into an error must not leave profiling half on
            warnings.warn(f"[rank: {self.rank}] {message}" if self.world_size > 1 else message, FxprofWarning,
                          stacklevel=3)

    def _disable(self) -> None:
        self._enabled = False
        self.timers.stop()
        for stage in (self._train, self._val):
            cycle, stage.open = stage.open, None
            if cycle is not None:
                cycle.abandon(self.target)


def display(engine: Engine) -> Display:
    """What the sinks show, from the engine's settings now (``sinks.Display``)."""
    settings = engine.settings
    return Display(engine.name, settings.top_k, settings.module_depth, settings.pictures, settings.verbose,
                   settings.profile_validation, engine.warn)


# ------------------------------------------------------------ a run's ends
# Opening a run (the module resolved and checked, the timers started, the names earlier runs took, the follower) and
# closing it (the nothing-recorded warning, the follower's end, the sinks closed on rank 0), or cutting it short at an
# exception. The driver says when (``begin_run``, ``end_run``, ``abort``).

def open_run(engine: Engine) -> None:
    """Resolve the module, forget captures, and list the names in ``dirpath`` that earlier runs took."""
    engine.target = engine.module if isinstance(engine.module, nn.Module) else engine.module()
    engine._enabled, engine._fx_on = True, engine.settings.fx_timing
    compiled = engine._fx_on and is_compiled(engine.target)
    if compiled and (why_not := _kernels_unreadable(engine.target, engine.settings.torch_profiler)):
        engine.warn(why_not)
        engine._fx_on = compiled = False
    # A compiled module's kernels are followed from before its first call (per-layer times from the trace).
    settings = engine.settings
    engine.timers.start(settings.capture, settings.backward_timing, settings.torch_profiler and settings.node_ranges,
                        compiled, settings.memory)
    taken = sorted(p.name for p in engine.dirpath.glob("*cycle_*")) if engine.rank == 0 and engine.dirpath.is_dir() else []
    engine._taken = set(broadcast(taken))
    engine.follow = Follow(settings.watch_step_time, engine.rank, engine.world_size, settings.overhead_budget, engine.warn)
    engine.follow.start(engine.dirpath)


def close_run(engine: Engine) -> None:
    """Remove the first-call recorders, put Inductor's settings back and let the sinks finish (rank 0)."""
    engine.timers.stop()
    train = engine._train
    if engine.rank == 0 and not train.cycles and (why := _nothing_recorded(engine.settings.schedule, train.step)):
        engine.warn(why)
    if engine.follow is not None:
        engine.follow.end(engine.dirpath)
    if engine.rank == 0:
        cost = (engine.follow.spent_s(), engine.follow.share()) if engine.follow is not None else None
        run = RunSummary(train.cycles, engine.dirpath, display(engine), cost)
        for sink in engine.sinks:
            engine._safely("closing a sink", sink.close, run)


def abort_run(engine: Engine) -> None:
    """Write this rank's open cycles (no collective) and remove every hook. The step the exception stopped counts as
    recorded if the module ran in it (its samples are in the timer)."""
    engine.release()
    if engine.follow is not None:
        engine.follow.stop()
    for state in (engine._train, engine._val):
        cycle = state.open
        if state.in_step and cycle is not None and cycle.ran_in_step and state.action(engine.schedule, state.step) in RECORDING:
            cycle.count_step(state.step)  # its samples are in: the step the exception stopped counts (unless dropped)
        state.in_step = False
        if state.open is not None:
            # Other ranks may not get here: no collective, this rank's data only.
            engine._safely("writing the cycle cut short by an exception", engine._close_cycle, state, gather=False)


def _nothing_recorded(schedule: Schedule, steps: int) -> str | None:
    """Why a run of ``steps`` training steps has no cycle, when it stopped before the first recorded step (a cycle
    that counted no step says so itself)."""
    first = schedule.recorded_steps(0)
    if first and steps > first[0]:
        return None
    return (f"stopped after {steps} step(s), before any recorded step (the first is step {first[0] if first else '?'}: "
            f"skip_first={schedule.skip_first}, wait={schedule.wait}, warmup={schedule.warmup}), so .cycles is empty; "
            "run more steps or lower wait/skip_first")


# torch's own backends that compile no Inductor kernels: a module compiled by one has no kernels to time.
NOT_INDUCTOR = ("eager", "aot_eager", "aot_eager_decomp_partition", "cudagraphs")


def _kernels_unreadable(target: nn.Module, torch_profiler: bool) -> str | None:
    """Why a torch.compile'd module's per-layer times cannot come from its kernels in this run, or None."""
    if not torch_profiler:
        return (f"{type(target).__name__} is torch.compile'd: its per-layer times come from its kernels in the "
                "torch.profiler trace, and torch_profiler=False turns that off, so node timing is off too")
    if (backend := torch_api.compile_backend(target)) in NOT_INDUCTOR:  # (else known after the cycle: ``collect``)
        return (f"{type(target).__name__} is torch.compile'd, but no Inductor-compiled graph ran: its backend is "
                f"{backend!r}, not Inductor, so its layers have no times; the torch.profiler trace is written")
    if missing := missing_for_kernels():
        return (f"{type(target).__name__} is torch.compile'd: its per-layer times come from its kernels, traced back "
                f"to its layers by Inductor's {missing}, which torch {torch.__version__} lacks (torch 2.11 and newer have it), so "
                "node timing is off; the torch.profiler trace is still recorded")
    return None


# ------------------------------------------------------------ a cycle's two ends
# Opening a cycle (its capture, its torch.profiler session, its directory) and closing it (the timer's samples measured,
# the ranks' tables gathered, the report, its analysis and the sinks, on rank 0). ``LIFECYCLE`` says when.

def start_collecting(engine: Engine, stage: Stage, action: ProfilerAction) -> None:
    """A traced step begins: open the stage's cycle if none is open, switch a timer that stopped fitting (when nothing
    was recorded yet) and start the step."""
    if stage.open is None:
        stage.open = open_cycle(engine, stage, engine._val if stage is engine._train else engine._train)
    cycle = stage.open
    if cycle.timer is not None and not cycle.timer.progress.usable and not cycle.recorded:  # nothing recorded is lost: switch
        cycle.timer, cycle.capture = engine.timers.for_module(engine.target)
        cycle.captures_before = len(cycle.timer.progress.capture_s)
    if cycle.unused and not cycle.recorded and (children := engine.timers.children_instead(engine.target)) is not None:
        cycle.timer, cycle.capture = children  # (the LightningModule's forward sat the warm-up out: its children, then)
        cycle.captures_before, cycle.unused = len(cycle.timer.progress.capture_s), False
    recording = action in RECORDING
    cycle.begin_step(engine.target, recording, stage is engine._train and recording, engine.warn)


def open_cycle(engine: Engine, stage: Stage, other: Stage) -> Cycle:
    """The cycle ``stage`` opens at its step in progress (``other``: the other stage, whose cycle may be open)."""
    index = stage.index_at(engine.schedule, stage.step)
    directory = stage.directory_for(engine.dirpath, index, engine._taken)
    target = engine.target
    # The timer first: no trace should record what choosing it runs.
    timer, how = engine.timers.for_module(target) if engine._fx_on else (None, None)
    if timer is not None and other.open is not None and other.open.timer is timer:  # one timer, one cycle
        engine.warn(f"the {stage.name} cycle from step {stage.step} would share the open {other.name} cycle's timer "
                    f"(the module is in {'training' if target.training else 'eval'} mode for both): its nodes are "
                    "not timed. Switch the module to eval mode before entering validation().")
        timer, how = None, None
    trace = _trace_for(engine, stage, other, index, directory, timer)
    stage.opened(engine.follow, engine.schedule, index, directory)
    cycle = Cycle(index, directory, trace, timer, how, target.training)
    if engine.settings.memory and stage.name == "train":
        cycle.optimizers = OptimizerWatch()
    if trace is not None:
        trace.node_ranges = functools.partial(cycle.node_ranges, functools.partial(_type_name, target))
    return cycle


def close_cycle(engine: Engine, stage: Stage, gather: bool, tracked: list[str] | None) -> None:
    """Close ``stage``'s open cycle: measure it, gather the ranks' tables (with ``gather``: every rank takes part, also
    one with no cycle open), and on rank 0 analyse the report and hand it to the sinks. ``tracked``: the nodes whose
    trend the analysis follows (validation's: training's), None for its own."""
    cycle, stage.open = stage.open, None
    extra, stage.extra = stage.extra, []
    recorded = len(stage.recorded(engine.schedule, cycle.index)) if cycle is not None else 0
    trigger, stage.trigger, stage.planned = stage.trigger, None, {}
    target = engine.target
    nodes = None
    if cycle is not None:
        cycle.stop_trace(engine.warn)
        if cycle.timer is not None:
            nodes = cycle.measure(target, engine.warn)
    ranges = [cycle.trace.ranges] if cycle is not None and cycle.trace is not None else []
    ranks = 1
    if gather and engine.world_size > 1:
        nodes, ranges, ranks, rows = _gathered(nodes, ranges, cycle.nodes if cycle is not None else [])
        if cycle is not None and not cycle.nodes:  # (this rank timed nothing: the module tree from another's rows)
            cycle.nodes = rows
    if cycle is None:
        return
    nothing = cycle.nothing_timed(stage.name, type(target).__name__, nodes,
                                 [name for name, _ in target.named_children()] if target is not None else [])
    if nothing is not None and cycle.recorded and not nodes and engine.timers.children_instead(target) is not None:
        nothing += " From the next cycle on, the children it calls are timed instead."  # (no warm-up step to see it)
    if nothing is not None:
        engine.warn(nothing)
        why = cycle.no_step()
        if why is not None and engine.follow is not None and stage.name == "train":
            engine.follow.absent([cycle.index], why, warned=True)
    if not cycle.recorded:
        cycle.stepped_optimizers()
        stage.drop(cycle)
        return
    report = cycle.report(stage.name, nodes or [], ranges, max(ranks, 1), partial=cycle.cut_short(recorded + len(extra)),
                          type_name=functools.partial(_type_name, target))
    report.trigger = trigger.text() if trigger is not None else "schedule"
    report.untimed = nothing if not report.nodes else None
    optimizers = cycle.stepped_optimizers()
    if engine.settings.memory and report.modules and target is not None:
        report.modules = with_state_bytes(report.modules, target, optimizers if stage.name == "train" else None)
    if report.nodes and engine.rank == 0:
        analysis = engine._safely("analysing a cycle", _analyse, engine, stage, report, tracked)
        if analysis is not None:  # (the report's fields of the same names)
            report = replace(report, **vars(analysis))
        shown = display(engine)
        for sink in engine.sinks:
            sink.write_cycle(report, shown)
        report.pictures.clear()  # written: a long run keeps no image bytes
    if engine.follow is not None and stage.name == "train":
        engine.follow.closed(stage.step - 1, report)
    stage.cycles.append(report)
    stage.forget_old_cycles(engine.settings.keep_cycles, engine.rank)


def _analyse(engine: Engine, stage: Stage, report: CycleReport, tracked: list[str] | None) -> Analysis:
    """What the report says beyond its tables: roofline, trust, regressions, advice (rank 0). A raised peak: a
    measured one a node beat was too low."""
    engine.peaks = _device_peaks(engine.target, engine.peaks, engine.warn)
    analysis, peaks = stage.history.analyse(report, engine.peaks or None, engine.settings.top_k, tracked)
    engine.peaks = peaks or engine.peaks
    return analysis


def _gathered(nodes: list[NodeStats] | None, ranges: list[Any],
              rows: list[NodeInfo]) -> tuple[list[NodeStats], list[Any], int, list[NodeInfo]]:
    """Every rank's node table merged, every rank's ranges, how many ranks timed nodes, and the rows (``NodeInfo``)
    of a rank that timed them (a collective)."""
    gathered = all_gather((nodes, ranges, rows))
    merged = merge_ranks([table for table, _, _ in gathered])
    return (merged, [r for _, rank_ranges, _ in gathered for r in rank_ranges], sum(1 for table, _, _ in gathered if table),
            next((infos for _, _, infos in gathered if infos), []))


def _trace_for(engine: Engine, stage: Stage, other: Stage, index: int, directory: Path, timer: Any) -> CycleTrace | None:
    """The cycle's torch.profiler session, when this rank traces and no other profiler runs (``open_cycle``)."""
    settings = engine.settings
    if not settings.torch_profiler or (settings.tracing_ranks is not None and engine.rank not in settings.tracing_ranks):
        return None
    if other.open is not None and (other.open.trace is not None or other.open.backward.events is not None):
        engine.warn(f"a {other.name} cycle's profiler is still running, so {stage.name} steps {stage.step}+ get "
                    "node timing only (one profiler runs at a time)")
        return None
    if torch_api.profiler_enabled():
        engine.warn("another profiler is running, so this cycle writes no trace (starting one would cancel it); "
                    "node timing goes on")
        return None
    # The cycle opens at whichever of its traced steps comes first (normally its first).
    actions = {s: action for s, action in stage.traced(engine.schedule, index).items() if s >= stage.step}
    from_trace = timer is not None and timer.traits.reads_trace_events  # rows from all the events, not autograd nodes
    return CycleTrace(actions, directory, f"rank{engine.rank}", settings.use_gzip, settings.profiler_kwargs,
                      backward_events=engine._fx_on and not from_trace, keep_events=from_trace)


def _device_peaks(target: nn.Module | None, peaks: Peaks | bool | None, warn: Callable[[str], None]) -> Peaks | bool | None:
    """The given peaks, or the target's device's, measured once (and cached across runs; False: could not be). A
    known GPU starts from its spec sheet's peaks (no micro-benchmark before the first cycle's report); the next
    cycle measures them."""
    spec_sheet = peaks is not None and peaks is not False and peaks.source == "spec sheet"
    if peaks is None or spec_sheet:
        parameter = next(target.parameters(), None) if target is not None else None
        device = parameter.device if parameter is not None and parameter.device.type != "meta" else torch.device("cpu")
        try:
            return device_peaks(device, calibrate=spec_sheet)
        except Exception as error:  # no roofline, the rest goes on
            warn(f"could not measure the device's peaks for the roofline ({type(error).__name__}: {error}); "
                 "give them as peaks=Peaks(gflops_per_s=..., gbytes_per_s=...)")
            return False
    return peaks


def _type_name(module: nn.Module, path: str) -> str:
    try:
        return type(module.get_submodule(path)).__name__
    except AttributeError:
        return ""
