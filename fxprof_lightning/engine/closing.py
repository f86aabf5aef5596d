"""A cycle's two ends, for the engine (``core.Engine``): opening it (its capture, its torch.profiler session, its
directory) and closing it (the timer's samples measured, the ranks' tables gathered, the report, its analysis and the
sinks, on rank 0). The engine decides when, by its ``LIFECYCLE`` table; these say how. They are the engine's own
methods, written as functions of it: they read its private state (``_taken``, ``_fx_on``) and its failure policy
(``_safely``), which its public faces (``Profiler``, the callback) do not show."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.analysis.roofline import Peaks, device_peaks
from fxprof_lightning.engine.cycle import Cycle
from fxprof_lightning.engine.ranks import all_gather
from fxprof_lightning.engine.stage import RECORDING, Stage
from fxprof_lightning.engine.statistics import merge_ranks
from fxprof_lightning.nodes import NodeInfo
from fxprof_lightning.report import CycleReport, NodeStats
from fxprof_lightning.timing.state_memory import OptimizerWatch, with_state_bytes
from fxprof_lightning.timing.torch_trace import CycleTrace

if TYPE_CHECKING:
    from fxprof_lightning.engine.core import Engine
    from fxprof_lightning.schedule import ProfilerAction

__all__ = ["close_cycle", "open_cycle", "start_collecting"]


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
        engine._safely("analysing a cycle", _analyse, engine, stage, report, tracked)
        display = engine.display()
        for sink in engine.sinks:
            sink.write_cycle(report, display)
        report.pictures.clear()  # written: a long run keeps no image bytes
    if engine.follow is not None and stage.name == "train":
        engine.follow.closed(stage.step - 1, report)
    stage.cycles.append(report)
    stage.forget_old_cycles(engine.settings.keep_cycles, engine.rank)


def _analyse(engine: Engine, stage: Stage, report: CycleReport, tracked: list[str] | None) -> None:
    """What the report says beyond its tables: roofline, trust, regressions, advice (rank 0). A raised peak: a
    measured one a node beat was too low."""
    engine.peaks = _device_peaks(engine.target, engine.peaks, engine.warn)
    analysis, peaks = stage.history.analyse(report, engine.peaks or None, engine.settings.top_k, tracked)
    engine.peaks = peaks or engine.peaks
    for name, value in vars(analysis).items():  # (the report's fields of the same names)
        setattr(report, name, value)


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
    if other.open is not None and (other.open.trace is not None or other.open.backward_events is not None):
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
