"""``FXProfilerCallback``: wires the schedule, node timing and torch.profiler to Trainer hooks.

Data flows one way: Trainer hook -> schedule decision -> trace / node-timing collection ->
per-cycle ``CycleReport`` -> sinks (loggers, CSV, console). The work itself lives in plain
modules that know nothing of Lightning: ``schedule``, ``node_timing``, ``torch_trace``, ``report``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from fxprof_lightning.node_timing import NodeTimer, TraceError, trace_module
from fxprof_lightning.report import CycleReport, summarize_nodes
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
    timer: NodeTimer | None
    recorded: list[int] = field(default_factory=list)


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
    ) -> None:
        self.schedule = Schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
        if not torch_profiler and not fx_timing:
            raise ValueError("torch_profiler and fx_timing are both False: turn at least one on")
        if module is not None and (not isinstance(module, str) or not module):
            raise ValueError(f"module must be a dotted attribute path such as 'model.backbone' or None, got {module!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        self.module_path = module
        self.torch_profiler = torch_profiler
        self.fx_timing = fx_timing
        self.profiler_kwargs = check_profiler_kwargs(profiler_kwargs)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.top_k = top_k
        self.use_gzip = use_gzip

        self.cycles: list[CycleReport] = []
        self._step = 0
        self._enabled = True  # False after a failure inside the profiler
        self._fx_on = fx_timing  # False when the target cannot be traced
        self._target: nn.Module | None = None
        self._timers: dict[bool, NodeTimer] = {}  # one instrumented graph per training mode
        self._cycle: _OpenCycle | None = None
        self._out_dir: Path | None = None

    # ----------------------------------------------------------------- set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._target = _resolve_module(pl_module, self.module_path)
        self._enabled, self._fx_on = True, self.fx_timing
        if self._fx_on and hasattr(self._target, "_orig_mod"):
            rank_zero_warn(
                f"FXProfilerCallback: {self.module_path or 'the LightningModule'} is torch.compile'd, which torch.fx cannot "
                "time node by node; node timing is off, torch.profiler traces go on. Point module= at the module "
                "before compiling it to get node timing."
            )
            self._fx_on = False
        self._out_dir = self.dirpath if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir) / "fxprof"
        if not trainer.loggers:
            rank_zero_warn("FXProfilerCallback: the Trainer has no logger, so no scalars or text are logged; "
                           f"the per-cycle CSV and traces are still written under {self._out_dir}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fx_on:
            self._timer_for(self._target)

    # ------------------------------------------------------------ step hooks

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        action = self.schedule.action(self._step)
        if action is ProfilerAction.NONE or not self._enabled:
            return
        self._safely(trainer, "starting a profiled step", self._begin_step, trainer, action)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, self._step = self._step, self._step + 1
        if self._cycle is None:
            return
        self._safely(trainer, "ending a profiled step", self._end_step, trainer, step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cycle is not None:  # training stopped inside a cycle (max_steps, early stopping)
            self._safely(trainer, "writing the last, partial cycle", self._finish_cycle, trainer, partial=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._cycle is not None:
            self._safely(trainer, "writing the cycle cut short by an exception", self._finish_cycle, trainer, partial=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.cycles:
            print(self._summary(trainer))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._step = int(state_dict.get("step", 0))

    # ------------------------------------------------------------ the work

    def _begin_step(self, trainer: pl.Trainer, action: ProfilerAction) -> None:
        if self._cycle is None:
            self._cycle = self._open_cycle(trainer)
        timer = self._cycle.timer
        if timer is not None:
            if action in RECORDING and not self._cycle.recorded:
                timer.reset()  # drop what the warm-up steps measured
            timer.install(self._target)

    def _end_step(self, trainer: pl.Trainer, step: int) -> None:
        cycle = self._cycle
        action = self.schedule.action(step)
        if cycle.timer is not None:
            cycle.timer.uninstall(self._target)
        if action in RECORDING:
            cycle.recorded.append(step)
        if cycle.trace is not None:
            cycle.trace.step()
        if action is ProfilerAction.RECORD_AND_SAVE:
            self._finish_cycle(trainer, partial=False)

    def _open_cycle(self, trainer: pl.Trainer) -> _OpenCycle:
        index = self.schedule.cycle_of(self._step)
        directory = self._out_dir / f"cycle_{index:04d}"
        directory.mkdir(parents=True, exist_ok=True)
        # The cycle opens at whichever of its traced steps comes first (normally its first).
        steps = [s for s in self.schedule.traced_steps(index) if s >= self._step]
        trace = None
        if self.torch_profiler:
            actions = {s: self.schedule.action(s) for s in steps}
            trace = CycleTrace(actions, directory, f"rank{trainer.global_rank}", self.use_gzip, self.profiler_kwargs)
        timer = self._timer_for(self._target) if self._fx_on else None
        return _OpenCycle(index=index, directory=directory, trace=trace, timer=timer)

    def _finish_cycle(self, trainer: pl.Trainer, partial: bool) -> None:
        cycle, self._cycle = self._cycle, None
        if cycle.timer is not None:
            cycle.timer.uninstall(self._target)
        report = CycleReport(index=cycle.index, steps=cycle.recorded, directory=cycle.directory, partial=partial)
        if cycle.trace is not None:
            cycle.trace.stop()
            report.trace_paths = list(cycle.trace.paths)
            for error in cycle.trace.errors:
                rank_zero_warn(f"FXProfilerCallback: {error}")
        if cycle.timer is not None and cycle.recorded:
            report.nodes = summarize_nodes(cycle.timer.nodes, cycle.timer.samples)
            cycle.timer.reset()
            if report.nodes:
                _write_atomically(cycle.directory / "fx_nodes.csv", report.to_csv())
            else:
                rank_zero_warn(
                    f"FXProfilerCallback: {type(self._target).__name__}.forward did not run in the recorded steps "
                    f"{cycle.recorded}, so no node was timed. If training_step calls a submodule instead, "
                    "name it with module='...'."
                )
        self.cycles.append(report)
        if report.nodes:
            self._log(trainer, report)

    def _log(self, trainer: pl.Trainer, report: CycleReport) -> None:
        step = report.steps[-1]
        metrics = {f"fxprof/fwd_ms/{n.name}": n.mean_ms for n in report.nodes[: self.top_k]}
        metrics["fxprof/fwd_ms/total"] = report.forward_ms_per_step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_text("fxprof/nodes", report.to_markdown(self.top_k), global_step=step)
        for logger in trainer.loggers:
            logger.save()

    def _timer_for(self, module: nn.Module) -> NodeTimer | None:
        """The instrumented graph for the module's current mode, traced on first use."""
        if module.training not in self._timers:
            try:
                traced = trace_module(module)
            except TraceError as error:
                rank_zero_warn(f"FXProfilerCallback: {error}. Node timing is off; torch.profiler traces go on.")
                self._fx_on = False
                return None
            self._timers[module.training] = NodeTimer(traced, annotate=self.torch_profiler)
        return self._timers[module.training]

    def _safely(self, trainer: pl.Trainer, what: str, work: Any, *args: Any, **kwargs: Any) -> None:
        """Run profiler work; on failure warn, clean up and stop profiling, never break training."""
        try:
            work(*args, **kwargs)
        except Exception as error:
            rank_zero_warn(f"FXProfilerCallback failed while {what}: {type(error).__name__}: {error}. "
                           "Profiling is off for the rest of this run; training goes on.")
            self._disable()

    def _disable(self) -> None:
        self._enabled = False
        cycle, self._cycle = self._cycle, None
        if cycle is not None:
            if cycle.timer is not None:
                cycle.timer.uninstall(self._target)
            if cycle.trace is not None:
                with contextlib.suppress(Exception):  # already failing; the warning has been given
                    cycle.trace.stop()

    def _summary(self, trainer: pl.Trainer) -> str:
        last = self.cycles[-1]
        lines = [f"FXProfilerCallback: {len(self.cycles)} cycle(s) recorded; output in {self._out_dir}"]
        if last.nodes:
            partial = ", partial" if last.partial else ""
            lines.append(
                f"Slowest nodes of cycle {last.index} (steps {last.steps[0]}-{last.steps[-1]}{partial}), mean forward ms per call:"
            )
            for n in last.nodes[:5]:
                lines.append(f"  {n.name:<28} {n.op:<14} {n.mean_ms:9.3f} ms  {n.pct:5.1f} %")
        if any(c.trace_paths for c in self.cycles):
            root = next((lg.root_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), self._out_dir)
            lines.append(f"Traces: {last.directory}. View them with: tensorboard --logdir {root}")
        return "\n".join(lines)


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
