"""``FXProfilerCallback``: the Lightning shell over ``engine.Profiler``.

It maps Trainer hooks onto the engine (a step is one ``training_step`` call; validation batches
are a stage of their own), turns the Trainer's loggers into a sink, puts the output under the
Trainer's log directory, and keeps the schedule position in checkpoints. The work itself is the
engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from fxprof_lightning.outputs.sinks import ConsoleSink, CsvSink, PictureSink, Sink, checked_sinks
from fxprof_lightning.outputs.trackers import LoggerSink
from fxprof_lightning.report import CycleReport
from fxprof_lightning.schedule import Schedule
from fxprof_lightning.trainer_parts import batch_size, module_to_time, printer

__all__ = ["FXProfilerCallback"]

# Between cycles (``engine.idle``) these hooks are ``pl.Callback``'s empty ones on the instance (Lightning looks them up
# there at every call), and ``on_train_batch_end`` only counts the step.
IDLE_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward")


class FXProfilerCallback(Callback, HoldsSettings):
    """Profile scheduled training steps with torch.profiler and per-node ``torch.fx`` timing.

    A step is one training batch (one ``training_step`` call), counted from 0 over the whole
    ``fit``. The schedule has the semantics of ``torch.profiler.schedule``: ``skip_first``
    idle steps, then cycles of ``wait`` idle, ``warmup`` traced-and-discarded and ``active``
    recorded steps, ``repeat`` cycles (0: as long as training runs). At the last recorded step
    of each cycle its per-node table is logged and written to ``<dirpath>/cycle_NNNN``.

    Args:
        module: dotted path, inside the LightningModule, of the ``nn.Module`` to time node by
            node (None: the LightningModule where it has a forward of its own, else its one child with parameters,
            else each child with parameters, captured on its own: ``trainer_parts.module_to_time``; a forward the
            warm-up step does not run gives way to its children: ``Timers.children_instead``).
        sinks: more places each cycle's report goes (``outputs.sinks.Sink``: ``write_cycle`` and ``close``), after
            the callback's own: the CSV and ``cycle.jsonl``, the pictures, the Trainer's loggers, the console. The
            same objects serve every ``fit`` and ``validate``: ``close`` ends each, and ``write_cycle`` may follow.
        **options: the settings, as for ``Profiler`` (``Settings``: ``wait=``, ``active=``, ``top_k=``...; the table
            of docs/usage.md#options), held by the engine: read them as ``callback.profiler.settings``. Here
            ``dirpath=None`` is ``<trainer.log_dir>/fxprof``, and ``profile_validation=True`` also profiles
            validation batches (with their own schedule position, into ``val_cycles``).

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
        self.profiler = Profiler(self._resolve_target, sinks=[], settings=settings)  # (a method: picklable)
        self.profiler.name = type(self).__name__
        self.profiler.timers.children_when_unused = module is None  # (its forward unused: the children it calls)
        self.extra_sinks = checked_sinks(sinks or ())  # after the callback's own (CSV, pictures, loggers, console)
        self._pl_module: pl.LightningModule | None = None
        self.profiler.idle.stand_ins(self, {name: getattr(Callback, name).__get__(self) for name in IDLE_HOOKS},
                                     end="on_train_batch_end")

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
        self._pl_module = pl_module  # (its module to time is resolved when the loop starts: configure_model may build it)
        self.profiler.reset(train=stage == "fit")  # a new fit counts from 0 unless a checkpoint says otherwise
        out_dir = self.dirpath if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_DIRPATH
        self.profiler.dirpath = out_dir
        logdir = next((lg.root_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), out_dir)
        self.profiler.sinks = [CsvSink(), PictureSink(), LoggerSink(trainer.loggers), ConsoleSink(logdir=logdir, write=printer(trainer)),
                               *self.extra_sinks]
        own = f"[Callback]{self.state_key}"  # (the phases of recorded steps, from what Lightning tells its profiler)
        self.profiler.notes.make_clock = lambda: PhaseClock(trainer.profiler, own, inside=f"{own}.on_train_batch_end")
        if not trainer.loggers:
            rank_zero_warn("FXProfilerCallback: the Trainer has no logger, so no scalars or text are logged; "
                           f"the per-cycle CSV and traces are still written under {out_dir}", category=FxprofWarning)

    def _resolve_target(self) -> nn.Module:
        return module_to_time(self._pl_module, self.module_path)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.begin_run()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.begin_stage("val")  # eval mode: its own capture (trainer.validate: the run begins too)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.begin_stage("train")  # choose the timer before the first timed step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.profiler.begin_step("train")
        if self.profiler.recording("train"):
            self.profiler.notes.add_batch_size(batch_size(batch))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.profiler.end_train_step()  # (between cycles: ``IDLE_HOOKS`` empty, this hook counts the step)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.profiler.notes.backward_started()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.notes.backward_ended()

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:  # (without profile_validation the engine does nothing)
            self.profiler.begin_step("val")

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self.profiler.end_step("val")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:  # a validation cycle never stays open over training steps: a new piece
            self.profiler.end_stage("val")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.end_stage("train")  # training stopped inside a cycle (max_steps, early stopping)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.end_run()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.profiler.abort()  # Lightning calls no teardown after an exception

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.profiler.release()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.profiler.state_dict()  # (the step count of now, also between cycles)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.profiler.load_state_dict(state_dict)
