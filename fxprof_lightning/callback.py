"""``FXProfilerCallback``: the Lightning shell over ``engine.Profiler``.

It maps Trainer hooks onto the engine (a step is one ``training_step`` call; validation batches
are a stage of their own), turns the Trainer's loggers into a sink, puts the output under the
Trainer's log directory, and keeps the schedule position in checkpoints. The work itself is the
engine's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from fxprof_lightning import FxprofWarning
from fxprof_lightning.engine.profiler import Profiler
from fxprof_lightning.engine.settings import OPTIONS, HoldsSettings, Settings, takes_settings
from fxprof_lightning.engine.step_phases import PhaseClock
from fxprof_lightning.layout import DEFAULT_DIRPATH
from fxprof_lightning.outputs.sinks import (
    ConsoleSink,
    CsvSink,
    PictureSink,
    Sink,
    checked_sinks,
)
from fxprof_lightning.outputs.trackers import LoggerSink
from fxprof_lightning.report import CycleReport
from fxprof_lightning.schedule import Schedule

__all__ = ["FXProfilerCallback"]

IDLE_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward")  # empty in idle steps


class FXProfilerCallback(Callback, HoldsSettings):
    """Profile scheduled training steps with torch.profiler and per-node ``torch.fx`` timing.

    A step is one training batch (one ``training_step`` call), counted from 0 over the whole
    ``fit``. The schedule has the semantics of ``torch.profiler.schedule``: ``skip_first``
    idle steps, then cycles of ``wait`` idle, ``warmup`` traced-and-discarded and ``active``
    recorded steps, ``repeat`` cycles (0: as long as training runs). At the last recorded step
    of each cycle its per-node table is logged and written to ``<dirpath>/cycle_NNNN``.

    Args:
        module: dotted path, inside the LightningModule, of the ``nn.Module`` to time node by
            node (None: the LightningModule itself).
        dirpath: output directory (None: ``<trainer.log_dir>/fxprof``).
        profile_validation: also profile validation batches, with their own schedule position,
            ``val_cycle_NNNN`` directories, ``fxprof_val/...`` tags and ``val_cycles`` reports.
        sinks: more places each cycle's report goes (``outputs.sinks.Sink``: ``write_cycle`` and ``close``), after
            the callback's own: the CSV and ``cycle.jsonl``, the pictures, the Trainer's loggers, the console. The
            same objects serve every ``fit`` and ``validate``: ``close`` ends each, and ``write_cycle`` may follow.
        **options: the settings, as for ``Profiler`` (``Settings``: ``wait=``, ``active=``, ``top_k=``...; the table
            of docs/usage.md#options), held by the engine: read them as ``callback.profiler.settings``.

    Example:
        >>> profiler = FXProfilerCallback(wait=5, warmup=1, active=3, module="model")
        >>> trainer = Trainer(callbacks=[profiler], max_steps=100)
        >>> trainer.fit(lit_module)
        >>> print(profiler.cycles[-1].to_markdown())
    """

    # The engine's settings, checked when the callback is made: read them on ``callback.profiler``, never set afterwards.
    fixed = OPTIONS - {"dirpath"} | {"schedule", "sinks", "settings"}
    read_as = "callback.profiler.settings"
    hints: ClassVar[dict[str, str]] = {
        "schedule": "pass skip_first=, wait=, warmup=, active=, repeat= to {owner}(...) (read it as callback.schedule)",
        "sinks": "pass sinks=[...] to {owner}(...) (read them as callback.extra_sinks)",
        "settings": "pass each option to {owner}(...) (read them as callback.profiler.settings)",
        "peaks": "pass peaks=... to {owner}(...) (read the given ones as callback.profiler.settings.peaks, the ones "
                 "in use as callback.profiler.peaks)"}
    made = "profiler"  # guarded once the engine exists (a subclass may set its own attributes before)

    @takes_settings
    def __init__(self, *, module: str | None = None, sinks: Sequence[Sink] | None = None, **options: Any) -> None:
        if module is not None and (not isinstance(module, str) or not module):
            raise ValueError(f"module must be a dotted attribute path such as 'model.backbone' or None, got {module!r}")
        self.module_path = module
        self.dirpath = Path(options["dirpath"]) if options.get("dirpath") is not None else None
        settings = Settings.of(type(self).__name__, options)  # declared, defaulted and checked once, named as ours
        self.profiler = Profiler(self._resolve_target, sinks=[], settings=settings)
        self.profiler.name = type(self).__name__
        self.extra_sinks = checked_sinks(sinks or ())  # after the callback's own (CSV, pictures, loggers, console)
        self._pl_module: pl.LightningModule | None = None
        self._clock: PhaseClock | None = None  # times the phases of the whole step while a cycle records
        self._idle = _Idle()  # the idle steps ahead whose hooks are skipped (``_go_idle``)

    @property
    def schedule(self) -> Schedule:
        """Which steps are idle, warm-up or recorded: the schedule as given (``torch.profiler.schedule``'s)."""
        return self.profiler.settings.schedule

    @property
    def cycles(self) -> list[CycleReport]:
        """One report per completed (or cut-short) training cycle of the current or last ``fit``."""
        return self.profiler.cycles

    @property
    def val_cycles(self) -> list[CycleReport]:
        """Like ``cycles``, for validation batches (``profile_validation=True``)."""
        return self.profiler.val_cycles

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):
            return
        self._pl_module = pl_module
        self._wake()
        self.profiler.target = None  # resolved when the loop starts: setup/configure_model may build it
        self.profiler.reset(train=stage == "fit")  # a new fit counts from 0 unless a checkpoint says otherwise
        out_dir = self.dirpath if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_DIRPATH
        self.profiler.dirpath = out_dir
        logdir = next((lg.root_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), out_dir)
        self.profiler.sinks = [CsvSink(), PictureSink(), LoggerSink(trainer.loggers), ConsoleSink(logdir=logdir, write=_printer(trainer)),
                               *self.extra_sinks]
        if not trainer.loggers:
            rank_zero_warn("FXProfilerCallback: the Trainer has no logger, so no scalars or text are logged; "
                           f"the per-cycle CSV and traces are still written under {out_dir}", category=FxprofWarning)

    def _resolve_target(self) -> nn.Module:
        """The submodule at ``module=``, or a ValueError listing the children that do exist. Without ``module=``: the
        LightningModule where it has a ``forward`` of its own, else its one child with parameters (the model its
        ``training_step`` calls); with several such children, the user is asked to choose."""
        module: nn.Module = self._pl_module
        path = self.module_path
        if path is None and type(module).forward is pl.LightningModule.forward:
            children = [name for name, child in module.named_children() if next(child.parameters(), None) is not None]
            if len(children) == 1:
                return module.get_submodule(children[0])
            if children:
                rank_zero_warn(f"FXProfilerCallback: {type(module).__name__} has no forward of its own and several child "
                               f"modules ({', '.join(children)}), so no layer is timed: pass module='{children[0]}' (or "
                               "another) to time the one to look at", category=FxprofWarning)
        for depth, part in enumerate(path.split(".") if path else []):
            child = getattr(module, part, None)
            if not isinstance(child, nn.Module):
                where = ".".join(path.split(".")[:depth]) or type(self._pl_module).__name__
                children = [name for name, _ in module.named_children()] or ["(none)"]
                raise ValueError(f"FXProfilerCallback(module={path!r}): {where} has no submodule {part!r}. "
                                 f"Its child modules are: {', '.join(children)}")
            module = child
        return module

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.begin_run()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.profiler.settings.profile_validation:
            if self.profiler.target is None:  # trainer.validate
                self.profiler.begin_run()
            self.profiler.prepare("val")  # eval mode: its own capture

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.prepare("train")  # choose the timer before the first timed step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.profiler.begin_step("train")
        if self.profiler.recording("train"):
            self.profiler.add_batch_size(_batch_size(batch))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._clock is not None:
            self.profiler.add_step_phases(self._clock.lap())
        self.profiler.end_step("train")
        # Time the whole of each recorded step, from the end of the step before (so its wait for data is in it).
        recording = self.profiler.recording("train")
        if recording and self._clock is None:
            self._clock = PhaseClock(trainer.profiler, f"[Callback]{self.state_key}",
                                     inside=f"[Callback]{self.state_key}.on_train_batch_end")
        elif not recording:
            self._close_clock()
            self._go_idle()

    # Idle steps: between cycles the schedule needs nothing but the count of steps. Lightning calls a callback's hooks
    # through the instance, so for those steps the per-step hooks are replaced on the instance by ``pl.Callback``'s
    # empty ones and ``on_train_batch_end`` only counts and gives the step's end to the engine's watch (``follow``);
    # the first traced step gets the class's hooks back.

    def _go_idle(self) -> None:
        # The last idle step runs the class's hooks: its on_train_batch_end starts the clock of the recorded step.
        ahead = self.profiler.idle_steps_ahead("train") - 1
        if ahead < 1:
            return
        self._idle.left, self._idle.done = ahead, 0
        for name in IDLE_HOOKS:
            super().__setattr__(name, getattr(pl.Callback, name).__get__(self))
        super().__setattr__("on_train_batch_end", self._count_idle_step)

    def _count_idle_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        idle = self._idle  # (a plain object: setting its counter skips the callback's own __setattr__)
        idle.done += 1
        follow = self.profiler.follow  # (the step time and requests: at every idle step, so called directly)
        step = self.profiler.step_num + idle.done - 1  # (the engine is given the idle steps' count later)
        trigger = follow.tick(step) if follow is not None else None
        if trigger is not None:  # the cycle it plans begins with the next step
            self.profiler.plan(trigger, step)
        if trigger is not None or idle.done >= idle.left:  # the next step runs the class's hooks (the one after it
            self._wake()  # is traced)

    def _catch_up(self) -> None:
        """Give the engine the idle steps that ended so far (it counts them as if their hooks had run)."""
        idle = self._idle
        if idle.done:
            self.profiler.skip_idle_steps(idle.done, "train")
            idle.left, idle.done = idle.left - idle.done, 0

    def _wake(self) -> None:
        """The class's hooks again, with the engine's step count up to date."""
        self._catch_up()
        self._idle.left = 0
        for name in (*IDLE_HOOKS, "on_train_batch_end"):
            self.__dict__.pop(name, None)

    def _close_clock(self) -> None:
        if self._clock is not None:
            self._clock.close()
            self._clock = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.profiler.backward_started()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.backward_ended()

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.profiler.settings.profile_validation and not trainer.sanity_checking:
            self.profiler.begin_step("val")

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.profiler.settings.profile_validation and not trainer.sanity_checking:
            self.profiler.end_step("val")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation cycle never stays open over training steps: the rest of it becomes a new piece.
        if self.profiler.settings.profile_validation and not trainer.sanity_checking:
            self.profiler.end_stage("val")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wake()
        self._close_clock()
        self.profiler.end_stage("train")  # training stopped inside a cycle (max_steps, early stopping)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.end_run()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._wake()
        self._close_clock()
        self.profiler.abort()  # Lightning calls no teardown after an exception

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._wake()
        self._close_clock()
        self.profiler.timers.stop()  # the hooks waiting for a mode's first call that never came

    @override
    def state_dict(self) -> dict[str, Any]:
        self._catch_up()  # a checkpoint saved between cycles holds the step count of now
        return self.profiler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wake()
        self.profiler.load_state_dict(state_dict)


def _printer(trainer: pl.Trainer) -> Callable[[str], None]:
    """Prints through the Trainer's progress bar (its ``print`` writes above a running bar), else ``print``."""
    bar = trainer.progress_bar_callback
    return bar.print if bar is not None else print


@dataclass
class _Idle:
    left: int = 0  # idle steps ahead when the hooks were skipped
    done: int = 0  # of those, the steps that ended, not yet counted by the engine


def _batch_size(batch: Any) -> int | None:
    """Samples in a batch, as Lightning counts them for its logs (None when it cannot tell)."""
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    if isinstance(first, torch.Tensor):  # what extract_batch_size finds first, without its walk (~30 us in a step)
        return 1 if first.ndim == 0 else first.size(0)
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return extract_batch_size(batch)
    except Exception:
        return None
