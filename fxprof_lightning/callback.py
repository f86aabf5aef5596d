"""``FXProfilerCallback``: wires the schedule, node timing and torch.profiler to Trainer hooks.

Data flows one way: Trainer hook -> schedule decision -> trace / node-timing collection ->
per-cycle ``CycleReport`` -> sinks (loggers, CSV, console). The work itself lives in plain
modules that know nothing of Lightning: ``schedule``, ``node_timing``, ``torch_trace``, ``report``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from fxprof_lightning.capture import Capture, capture
from fxprof_lightning.flops import NodeCosts, count_costs, input_signature
from fxprof_lightning.module_hooks import ModuleHookTimer
from fxprof_lightning.node_timing import BackwardEvents, NodeTimer
from fxprof_lightning.observed import Example, GuardedNodeTimer, observe_first_call
from fxprof_lightning.report import CycleReport, NodeStats, merge_ranks, summarize_modules, summarize_nodes
from fxprof_lightning.schedule import ProfilerAction, Schedule
from fxprof_lightning.torch_trace import CycleTrace, check_profiler_kwargs

__all__ = ["FXProfilerCallback"]

RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


@dataclass
class _OpenCycle:
    """The cycle in progress: where it writes and what collects its data."""

    index: int
    directory: Path
    trace: CycleTrace | None
    timer: NodeTimer | ModuleHookTimer | None
    capture: Capture | None
    training: bool
    recorded: list[int] = field(default_factory=list)
    backward_wall_ns: list[int] = field(default_factory=list)
    backward_events: BackwardEvents | None = None  # autograd node times, when no trace records them


@dataclass
class _Stage:
    """Schedule position and cycles of one loop: training batches or validation batches."""

    name: str  # "train" or "val"
    dir_prefix: str  # "cycle_" or "val_cycle_"
    tag_prefix: str  # "fxprof" or "fxprof/val"
    step: int = 0
    open: _OpenCycle | None = None
    cycles: list[CycleReport] = field(default_factory=list)
    directories: list[Path] = field(default_factory=list)  # written in this fit, oldest first
    last_index: int | None = None  # the cycle opened last, to name the pieces of a cut cycle
    piece: int = 0


class FXProfilerCallback(Callback):
    """Profile scheduled training steps with torch.profiler and per-node ``torch.fx`` timing.

    A step is one training batch (one ``training_step`` call), counted from 0 over the whole
    ``fit``. The schedule has the semantics of ``torch.profiler.schedule``: ``skip_first``
    idle steps, then cycles of ``wait`` idle, ``warmup`` traced-and-discarded and ``active``
    recorded steps, ``repeat`` cycles (0: as long as training runs). At the last recorded step
    of each cycle its per-node table is logged and written to ``<dirpath>/cycle_NNNN``.

    Args:
        skip_first: steps to skip before the first cycle.
        wait: idle steps at the start of each cycle.
        warmup: traced steps whose results are thrown away.
        active: recorded steps per cycle (at least 1).
        repeat: number of cycles, 0 for no limit.
        module: dotted path, inside the LightningModule, of the ``nn.Module`` to time node by
            node (None: the LightningModule itself).
        torch_profiler: trace the cycle's steps with ``torch.profiler``.
        fx_timing: time every FX node of ``module``'s forward.
        profiler_kwargs: more ``torch.profiler.profile`` arguments (activities, record_shapes,
            profile_memory, with_stack, ...); ``schedule`` and ``on_trace_ready`` are the callback's.
        dirpath: output directory (None: ``<trainer.log_dir>/fxprof``).
        top_k: how many of the slowest nodes get scalars and table rows.
        use_gzip: write traces as ``.pt.trace.json.gz`` (else plain ``.pt.trace.json``).
        keep_cycles: keep only the newest N cycle directories (and reports in ``cycles``); None keeps all.
        profile_validation: also profile validation batches, with their own schedule position,
            ``val_cycle_NNNN`` directories, ``fxprof/val/...`` tags and ``val_cycles`` reports.
        module_depth: deepest level of the module tree in the ``fxprof/modules`` text (root = 0).
        backward_timing: time each node's backward too (profiler events on CPU, hooks on CUDA); False makes
            recorded steps cheaper (see the benchmarks in the README).
        node_ranges: with ``torch_profiler``, a ``record_function`` range named after each node (or
            module) in the trace, so the trace view shows which node ran which ops; False saves their
            cost (about 10 us per node and call under the profiler, see the benchmarks in the README).

    Example:
        >>> profiler = FXProfilerCallback(wait=5, warmup=1, active=3, module="model")
        >>> trainer = Trainer(callbacks=[profiler], max_steps=100)
        >>> trainer.fit(lit_module)
        >>> print(profiler.cycles[-1].to_markdown())
    """

    def __init__(
        self,
        *,
        skip_first: int = 10,
        wait: int = 100,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 0,
        module: str | None = None,
        torch_profiler: bool = True,
        fx_timing: bool = True,
        profiler_kwargs: dict[str, Any] | None = None,
        dirpath: str | os.PathLike | None = None,
        top_k: int = 20,
        use_gzip: bool = True,
        keep_cycles: int | None = None,
        profile_validation: bool = False,
        module_depth: int = 3,
        backward_timing: bool = True,
        node_ranges: bool = True,
    ) -> None:
        self.schedule = Schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
        if not torch_profiler and not fx_timing:
            raise ValueError("torch_profiler and fx_timing are both False: turn at least one on")
        if module is not None and (not isinstance(module, str) or not module):
            raise ValueError(f"module must be a dotted attribute path such as 'model.backbone' or None, got {module!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if keep_cycles is not None and (not isinstance(keep_cycles, int) or isinstance(keep_cycles, bool) or keep_cycles < 1):
            raise ValueError(f"keep_cycles must be an int >= 1 or None (keep all), got {keep_cycles!r}")
        self.module_path = module
        self.torch_profiler = torch_profiler
        self.fx_timing = fx_timing
        self.profiler_kwargs = check_profiler_kwargs(profiler_kwargs)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.top_k = top_k
        self.use_gzip = use_gzip
        self.keep_cycles = keep_cycles
        if not isinstance(module_depth, int) or isinstance(module_depth, bool) or module_depth < 0:
            raise ValueError(f"module_depth must be an int >= 0, got {module_depth!r}")
        self.module_depth = module_depth
        self.backward_timing = backward_timing
        self.node_ranges = node_ranges
        self.profile_validation = profile_validation

        self._train = _Stage("train", "cycle_", "fxprof")
        self._val = _Stage("val", "val_cycle_", "fxprof/val")
        self._enabled = True  # False after a failure inside the profiler
        self._fx_on = fx_timing  # False when the target cannot be traced
        self._target: nn.Module | None = None
        self._timers: dict[bool, tuple[NodeTimer | ModuleHookTimer, Capture]] = {}  # one per training mode
        self._examples: dict[bool, Example] = {}  # a recorded call per mode, until a capture uses it
        self._observers: dict[bool, RemovableHandle] = {}  # recording the first call of a mode
        self._costs: dict[tuple, NodeCosts | None] = {}  # FLOPs per input signature
        self._backward_start: int | None = None
        self._out_dir: Path | None = None
        self._run_suffix = ""  # "-rN" when dirpath already holds cycles of an earlier run

    @property
    def cycles(self) -> list[CycleReport]:
        """One report per completed (or cut-short) training cycle of the current or last ``fit``."""
        return self._train.cycles

    @property
    def val_cycles(self) -> list[CycleReport]:
        """Like ``cycles``, for validation batches (``profile_validation=True``)."""
        return self._val.cycles

    # ----------------------------------------------------------------- set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):
            return
        self._target = None  # resolved when the loop starts: LightningModule.setup/configure_model may build it
        self._enabled, self._fx_on, self._timers, self._costs = True, self.fx_timing, {}, {}
        self._stop_observing()
        self._examples = {}
        if stage == "fit":  # a new fit counts from 0 unless a checkpoint says otherwise
            self._train = _Stage("train", "cycle_", "fxprof")
        self._val = _Stage("val", "val_cycle_", "fxprof/val")
        self._out_dir = self.dirpath if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir) / "fxprof"
        self._run_suffix = trainer.strategy.broadcast(_new_run_suffix(self._out_dir) if trainer.is_global_zero else "")
        if not trainer.loggers:
            rank_zero_warn("FXProfilerCallback: the Trainer has no logger, so no scalars or text are logged; "
                           f"the per-cycle CSV and traces are still written under {self._out_dir}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve_target(pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._target is None and self.profile_validation:  # trainer.validate
            self._resolve_target(pl_module)
        if self.profile_validation and self._fx_on and self._enabled:  # eval mode: its own capture
            self._safely(trainer, "capturing the module", self._timer_for, self._target)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fx_on and self._enabled:  # capture (or start recording a call to trace on) before the first timed step
            self._safely(trainer, "capturing the module", self._timer_for, self._target)

    def _resolve_target(self, pl_module: pl.LightningModule) -> None:
        """Find ``module=`` in the built model (raises ValueError naming the children that exist)."""
        self._target = _resolve_module(pl_module, self.module_path)
        if self._fx_on and hasattr(self._target, "_orig_mod"):
            rank_zero_warn(
                f"FXProfilerCallback: {self.module_path or 'the LightningModule'} is torch.compile'd, which torch.fx cannot "
                "time node by node; node timing is off, torch.profiler traces go on. Point module= at the module "
                "before compiling it to get node timing."
            )
            self._fx_on = False

    # ------------------------------------------------------------ step hooks

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._begin_step(trainer, self._train)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._end_step(trainer, self._train)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.profile_validation and not trainer.sanity_checking:
            self._begin_step(trainer, self._val)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.profile_validation and not trainer.sanity_checking:
            self._end_step(trainer, self._val)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation cycle never stays open over training steps: the rest of it becomes a new piece.
        if self.profile_validation and not trainer.sanity_checking:
            self._cut_cycle(trainer, self._val)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cut_cycle(trainer, self._train)  # training stopped inside a cycle (max_steps, early stopping)
        if self._train.open is not None:  # a step that opened a cycle and never ended (on_train_batch_start gave -1)
            self._safely(trainer, "writing a cycle left open", self._close_cycle, trainer, self._train, gather=False)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_observing()  # Lightning calls no teardown after an exception
        for stage in (self._train, self._val):
            if stage.open is not None:
                # Other ranks may not get here: no collective, this rank's data only.
                self._safely(trainer, "writing the cycle cut short by an exception", self._close_cycle, trainer, stage, gather=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_observing()  # a mode whose first call never came

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.cycles:
            print(self._summary(trainer))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"step": self._train.step, "val_step": self._val.step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train.step = int(state_dict.get("step", 0))
        self._val.step = int(state_dict.get("val_step", 0))

    # ------------------------------------------------------------ the work

    def _begin_step(self, trainer: pl.Trainer, stage: _Stage) -> None:
        action = self.schedule.action(stage.step)
        if action is ProfilerAction.NONE or not self._enabled:
            return
        self._safely(trainer, "starting a profiled step", self._start_collecting, trainer, stage, action)

    def _end_step(self, trainer: pl.Trainer, stage: _Stage) -> None:
        step, stage.step = stage.step, stage.step + 1
        action = self.schedule.action(step)
        if stage.open is not None:
            self._safely(trainer, "ending a profiled step", self._stop_collecting, stage, step, action)
        if action is ProfilerAction.RECORD_AND_SAVE:
            # Decided by the schedule alone, so every rank takes part in the gather, even one whose profiling failed.
            self._safely(trainer, "writing a cycle", self._close_cycle, trainer, stage, gather=True)

    def _cut_cycle(self, trainer: pl.Trainer, stage: _Stage) -> None:
        """Close a cycle that its loop left before its last recorded step."""
        last = stage.step - 1
        if last >= 0 and self.schedule.action(last) in (ProfilerAction.WARMUP, ProfilerAction.RECORD):
            self._safely(trainer, "writing a partial cycle", self._close_cycle, trainer, stage, gather=True)

    def _start_collecting(self, trainer: pl.Trainer, stage: _Stage, action: ProfilerAction) -> None:
        if stage.open is None:
            stage.open = self._open_cycle(trainer, stage)
        if _stopped_fitting(stage.open.timer) and not stage.open.recorded:  # nothing recorded is lost: switch
            stage.open.timer, stage.open.capture = self._timer_for(self._target)
        timer = stage.open.timer
        if timer is not None:
            if action in RECORDING and not stage.open.recorded:
                timer.reset()  # drop what the warm-up steps measured
            hooks = False
            if stage is self._train and action in RECORDING and stage.open.trace is None and timer.uses_backward_events:
                hooks = not self._record_backward(stage.open, timer)
            timer.install(self._target, backward_hooks=hooks)

    def _record_backward(self, cycle: _OpenCycle, timer: NodeTimer | ModuleHookTimer) -> bool:
        """Time the autograd nodes of the cycle's recorded steps (a trace, when there is one, does it).

        False when profiler events cannot be had (another profiler is running): then hooks time them.
        """
        if cycle.backward_events is None:
            cycle.backward_events = BackwardEvents()
            if not cycle.backward_events.start():
                rank_zero_warn("FXProfilerCallback: another profiler is running, so this cycle's backward times "
                               + ("come from hooks on the autograd nodes (slower)" if isinstance(timer, NodeTimer)
                                  else "are missing (module hooks take them from profiler events)"))
        return cycle.backward_events.running

    def _stop_collecting(self, stage: _Stage, step: int, action: ProfilerAction) -> None:
        cycle = stage.open
        if cycle.timer is not None:
            cycle.timer.uninstall(self._target)
        if action in RECORDING:
            cycle.recorded.append(step)
        if cycle.trace is not None:
            cycle.trace.step()

    def _open_cycle(self, trainer: pl.Trainer, stage: _Stage) -> _OpenCycle:
        index = self.schedule.cycle_of(stage.step)
        stage.piece = stage.piece + 1 if index == stage.last_index else 0
        stage.last_index = index
        piece = f"-p{stage.piece}" if stage.piece else ""
        directory = self._out_dir / f"{stage.dir_prefix}{index:04d}{self._run_suffix}{piece}"
        directory.mkdir(parents=True, exist_ok=True)
        if not stage.directories or stage.directories[-1] != directory:
            stage.directories.append(directory)
        # Capture first: tracing on a recorded call runs the module, which no trace should record.
        timer, how = self._timer_for(self._target) if self._fx_on else (None, None)
        trace = None
        other = self._val if stage is self._train else self._train
        if not self.torch_profiler:
            pass
        elif other.open is not None and (other.open.trace is not None or other.open.backward_events is not None):
            rank_zero_warn(f"FXProfilerCallback: a {other.name} cycle's profiler is still running, so "
                           f"{stage.name} steps {stage.step}+ get node timing only (one profiler runs at a time)")
        elif torch._C._autograd._profiler_enabled():
            rank_zero_warn("FXProfilerCallback: another profiler is running, so this cycle writes no trace (starting "
                           "one would cancel it); node timing goes on")
        else:
            # The cycle opens at whichever of its traced steps comes first (normally its first).
            steps = [s for s in self.schedule.traced_steps(index) if s >= stage.step]
            actions = {s: self.schedule.action(s) for s in steps}
            trace = CycleTrace(actions, directory, f"rank{trainer.global_rank}", self.use_gzip, self.profiler_kwargs,
                               backward_events=self._fx_on)
        if self._fx_on and self._target.training in self._observers:  # the mode's first call is still to come
            rank_zero_warn(f"FXProfilerCallback: torch.fx could not trace {type(self._target).__name__} whole, so it is "
                           f"timed by {how.describe()} in this cycle, which starts at its first call; later cycles "
                           "are traced on that call")
        return _OpenCycle(index, directory, trace, timer, how, self._target.training)

    def _close_cycle(self, trainer: pl.Trainer, stage: _Stage, gather: bool) -> None:
        cycle, stage.open = stage.open, None
        nodes = None
        if cycle is not None:
            if cycle.trace is not None:
                cycle.trace.stop()  # first: its events hold the backward times
                for error in cycle.trace.errors:
                    rank_zero_warn(f"FXProfilerCallback: {error}")
            if cycle.timer is not None:
                nodes = self._measure_nodes(cycle)
        ranks = 1
        if gather and trainer.world_size > 1 and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, nodes)
            ranks = sum(1 for table in gathered if table)
            nodes = merge_ranks(gathered)
        if cycle is None:
            return
        if not cycle.recorded:
            # Cut during warm-up: nothing to report (a trace holds no recorded step); the rest of the
            # cycle, if it comes, opens a new piece.
            for path in cycle.trace.paths if cycle.trace is not None else []:
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                cycle.directory.rmdir()
            if stage.directories and stage.directories[-1] == cycle.directory:
                stage.directories.pop()
            return
        partial = cycle.recorded != self.schedule.recorded_steps(cycle.index)
        report = CycleReport(index=cycle.index, steps=cycle.recorded, directory=cycle.directory, partial=partial,
                             ranks=max(ranks, 1), stage=stage.name, nodes=nodes or [], capture=cycle.capture,
                             trace_paths=list(cycle.trace.paths) if cycle.trace is not None else [])
        if cycle.backward_wall_ns:
            report.backward_wall_ms = sum(cycle.backward_wall_ns) / len(cycle.backward_wall_ns) / 1e6
        if report.nodes and cycle.timer is not None:
            report.modules = summarize_modules(cycle.timer.nodes, report.nodes, len(cycle.recorded), self._type_name)
        if self._fx_on and cycle.recorded and not report.nodes and not _stopped_fitting(cycle.timer):
            rank_zero_warn(
                f"FXProfilerCallback: {type(self._target).__name__}.forward did not run in the recorded steps "
                f"{cycle.recorded}, so no node was timed. If training_step calls a submodule instead, "
                "name it with module='...'."
            )
        if report.nodes and trainer.is_global_zero:
            _write_atomically(cycle.directory / "fx_nodes.csv", report.to_csv())
            if report.modules:
                _write_atomically(cycle.directory / "fx_modules.csv", report.modules_to_csv())
            self._log(trainer, stage, report)
        stage.cycles.append(report)
        self._forget_old_cycles(trainer, stage)

    def _forget_old_cycles(self, trainer: pl.Trainer, stage: _Stage) -> None:
        if self.keep_cycles is None:
            return
        del stage.cycles[: -self.keep_cycles]
        while len(stage.directories) > self.keep_cycles:
            old = stage.directories.pop(0)
            for path in old.glob(f"rank{trainer.global_rank}.*"):  # this rank's traces (its node's disk)
                path.unlink(missing_ok=True)
            if trainer.is_global_zero:
                shutil.rmtree(old, ignore_errors=True)

    def _log(self, trainer: pl.Trainer, stage: _Stage, report: CycleReport) -> None:
        step, prefix, top = report.steps[-1], stage.tag_prefix, report.nodes[: self.top_k]
        metrics = {f"{prefix}/fwd_ms/{n.name}": n.mean_ms for n in top}
        metrics[f"{prefix}/fwd_ms/total"] = report.forward_ms_per_step
        if report.backward_ms_per_step:
            metrics.update({f"{prefix}/bwd_ms/{n.name}": n.bwd_mean_ms for n in top if n.bwd_calls})
            metrics[f"{prefix}/bwd_ms/total"] = report.backward_ms_per_step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(f"{prefix}/nodes", report.to_markdown(self.top_k), global_step=step)
                if report.modules:
                    logger.experiment.add_text(f"{prefix}/modules", report.modules_to_text(self.module_depth), global_step=step)
            logger.save()

    def _measure_nodes(self, cycle: _OpenCycle) -> list[NodeStats] | None:
        """This rank's node statistics for the cycle; the timer is emptied for the next one."""
        timer = cycle.timer
        timer.uninstall(self._target)
        events = cycle.backward_events.stop() if cycle.backward_events is not None else None
        if cycle.backward_events is not None and cycle.backward_events.lost:
            rank_zero_warn("FXProfilerCallback: another profiler started while this cycle recorded and took over "
                           "the profiler session, so the cycle's nodes get no backward times")
        if not cycle.recorded or _stopped_fitting(timer):  # a graph that stopped fitting kept nothing
            return None
        timer.add_backward(events if events is not None else cycle.trace.backward_events if cycle.trace else [])
        timer.resolve()
        costs = self._costs_for(cycle)
        backward = [timer.bwd_ns(i) for i in range(len(timer.nodes))]
        nodes = summarize_nodes(timer.nodes, timer.fwd, backward, costs, timer.mem_delta, timer.mem_peak)
        timer.reset()
        return nodes

    def _costs_for(self, cycle: _OpenCycle) -> NodeCosts | None:
        """FLOPs and output sizes, counted once per input signature in an untimed meta-device pass."""
        inputs = cycle.timer.forward_inputs
        if cycle.capture is None or cycle.capture.graph_module is None or inputs is None:
            return None
        key = input_signature(inputs, cycle.training)
        if key not in self._costs:
            try:
                self._costs[key] = count_costs(cycle.capture.graph_module, inputs, cycle.training)
            except Exception as error:  # an op without a meta kernel: no FLOPs, timing goes on
                rank_zero_warn(f"FXProfilerCallback: FLOPs not counted ({type(error).__name__}: {error})")
                self._costs[key] = None
        return self._costs[key]

    def _type_name(self, path: str) -> str:
        try:
            return type(self._target.get_submodule(path)).__name__
        except AttributeError:
            return ""

    def _timer_for(self, module: nn.Module) -> tuple[NodeTimer | ModuleHookTimer, Capture]:
        """The timer for the module's current mode, captured on first use (see ``capture``).

        A module whose own forward torch.fx cannot trace is traced on a recorded call of it: the
        first call in each mode is recorded (``observe_first_call``) and the next capture of that
        mode uses it; until then (a cycle that opens at the mode's very first call) module hooks
        time it. A graph that stops fitting the calls is replaced by module hooks.
        """
        training = module.training
        entry = self._timers.get(training)
        if entry is None:
            entry = self._timers[training] = self._capture(module)
        elif _stopped_fitting(entry[0]):
            graph_capture = entry[1]
            how = Capture("module_hooks", None, {}, f"{graph_capture.error}; the graph traced on a recorded call "
                                                    f"stopped fitting the calls: {entry[0].mismatch}")
            entry = self._timers[training] = (self._hook_timer(module), how)
        return entry

    def _capture(self, module: nn.Module) -> tuple[NodeTimer | ModuleHookTimer, Capture]:
        training = module.training
        example = self._examples.pop(training, None)
        how = capture(module, example)
        if how.graph_module is None and example is None:  # no warning yet: the recorded call may do better
            if training not in self._observers:
                self._observers[training] = observe_first_call(module, training, functools.partial(self._observed, training))
            return self._hook_timer(module), how
        device = next(module.parameters(), torch.empty(0)).device.type
        if how.on_example:
            timer = GuardedNodeTimer(how.graph_module, annotate=self._ranges, backward=self.backward_timing,
                                     device=device, on_mismatch=functools.partial(self._warn_mismatch, module, training))
        elif how.graph_module is not None:
            timer = NodeTimer(how.graph_module, annotate=self._ranges, backward=self.backward_timing, device=device)
        else:
            timer = self._hook_timer(module)
        if how.method != "symbolic_trace":
            rank_zero_warn(f"FXProfilerCallback: torch.fx could not trace {type(module).__name__} whole, "
                           f"so it is timed by {how.describe()}")
        return timer, how

    @property
    def _ranges(self) -> bool:
        """Whether timers open a ``record_function`` range per node (for the trace)."""
        return self.torch_profiler and self.node_ranges

    def _hook_timer(self, module: nn.Module) -> ModuleHookTimer:
        return ModuleHookTimer(module, annotate=self._ranges)

    def _observed(self, training: bool, example: Example) -> None:
        """Runs inside the module's call: keep the example; the mode's next cycle captures again with it."""
        self._examples[training] = example
        self._observers.pop(training, None)
        self._timers.pop(training, None)

    def _stop_observing(self) -> None:
        for handle in self._observers.values():
            handle.remove()
        self._observers = {}

    def _warn_mismatch(self, module: nn.Module, training: bool, reason: str) -> None:
        mode = "training" if training else "evaluation"
        rank_zero_warn(
            f"FXProfilerCallback: a call of {type(module).__name__} does not fit the graph traced on its first {mode} "
            f"call ({reason}). That call ran the module's own forward, so training is unchanged; {mode} steps are "
            "timed by module hooks from now on (a cycle that had already recorded steps with the graph reports no "
            "node times)."
        )

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        cycle = self._train.open
        if cycle is not None and self.schedule.action(self._train.step) in RECORDING:
            self._backward_start = time.perf_counter_ns()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start, self._backward_start = self._backward_start, None
        if start is not None and self._train.open is not None:
            self._train.open.backward_wall_ns.append(time.perf_counter_ns() - start)

    def _safely(self, trainer: pl.Trainer, what: str, work: Any, *args: Any, **kwargs: Any) -> None:
        """Run profiler work; on failure warn, clean up and stop profiling, never break training."""
        try:
            work(*args, **kwargs)
        except Exception as error:
            message = (f"FXProfilerCallback failed while {what}: {type(error).__name__}: {error}. "
                       "Profiling is off for the rest of this run; training goes on.")
            # Every rank says so: a failure on one rank only must not pass unnoticed.
            warnings.warn(rank_prefixed_message(message, trainer.global_rank) if trainer.world_size > 1 else message,
                          stacklevel=2)
            self._disable()

    def _disable(self) -> None:
        self._enabled = False
        self._stop_observing()
        for stage in (self._train, self._val):
            cycle, stage.open = stage.open, None
            if cycle is None:
                continue
            if cycle.timer is not None:
                cycle.timer.uninstall(self._target)
            if cycle.backward_events is not None:
                cycle.backward_events.stop()
            if cycle.trace is not None:
                with contextlib.suppress(Exception):  # already failing; the warning has been given
                    cycle.trace.stop()

    def _summary(self, trainer: pl.Trainer) -> str:
        last = self.cycles[-1]
        lines = [f"FXProfilerCallback: {len(self.cycles)} cycle(s) recorded; output in {self._out_dir}"]
        if last.nodes:
            partial = ", partial" if last.partial else ""
            lines.append(
                f"Slowest nodes of cycle {last.index} (steps {last.steps[0]}-{last.steps[-1]}{partial}), "
                "mean ms per call (share of all nodes):"
            )
            for n in last.nodes[:5]:
                lines.append(f"  {n.name:<28} {n.op:<14} forward {n.mean_ms:9.3f} ({n.pct:4.1f} %)  "
                             f"backward {n.bwd_mean_ms:9.3f} ({n.bwd_pct:4.1f} %)")
        if any(c.trace_paths for c in self.cycles):
            root = next((lg.root_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), self._out_dir)
            lines.append(f"Traces: {last.directory}. View them with: tensorboard --logdir {root}")
        return "\n".join(lines)


def _stopped_fitting(timer: Any) -> bool:
    """Whether a timer's graph, traced on a recorded call, stopped fitting the calls (and times nothing)."""
    return isinstance(timer, GuardedNodeTimer) and timer.mismatch is not None


def _new_run_suffix(out_dir: Path) -> str:
    """'' for a fresh output directory, else '-r1', '-r2', ...: new directories never reuse old names."""
    if not out_dir.is_dir() or not any(out_dir.glob("*cycle_*")):
        return ""
    run = 1
    while any(out_dir.glob(f"*cycle_*-r{run}*")):
        run += 1
    return f"-r{run}"


def _resolve_module(pl_module: pl.LightningModule, path: str | None) -> nn.Module:
    """The submodule at a dotted path, or a ValueError listing the children that do exist."""
    module: nn.Module = pl_module
    for depth, part in enumerate(path.split(".") if path else []):
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            where = ".".join(path.split(".")[:depth]) or type(pl_module).__name__
            children = [name for name, _ in module.named_children()] or ["(none)"]
            raise ValueError(
                f"FXProfilerCallback(module={path!r}): {where} has no submodule {part!r}. "
                f"Its child modules are: {', '.join(children)}"
            )
        module = child
    return module


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        rank_zero_warn(f"FXProfilerCallback: could not write {path}: {error}")
