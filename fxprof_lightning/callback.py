"""``FXProfilerCallback``: the Lightning shell over ``engine.Profiler``.

It maps Trainer hooks onto the engine (a step is one ``training_step`` call; validation batches are a stage of their
own) and hands it, at ``setup``, what it reads from the Trainer (``trainer_parts``: the module to time, the log
directory, the loggers as a sink, the phases of a step). The work itself, checkpoints' state included, is the engine's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from fxprof_lightning.engine.profiler import Profiler
from fxprof_lightning.engine.settings import OPTIONS, HoldsSettings, takes_settings
from fxprof_lightning.outputs.sinks import Sink, checked_sinks
from fxprof_lightning.report import CycleReport
from fxprof_lightning.schedule import Schedule
from fxprof_lightning.trainer_parts import batch_size, log_dir, module_to_time, phase_clock, trainer_sinks

__all__ = ["FXProfilerCallback"]

# Between cycles these hooks do nothing and ``on_train_batch_end`` only counts the step (``engine.idle``).
IDLE_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward")


class FXProfilerCallback(Callback, HoldsSettings):
    """Profile scheduled training steps with torch.profiler and per-node timing of Dynamo's graphs.

    A step is one training batch, counted from 0 over the whole ``fit``; the schedule is ``torch.profiler.schedule``'s.
    Each cycle's per-node table is logged and written to ``<dirpath>/cycle_NNNN`` (docs/usage.md).

    Args:
        module: dotted path, inside the LightningModule, of the ``nn.Module`` to time (None: the LightningModule's own
            forward, else the children ``training_step`` calls: ``trainer_parts.module_to_time``).
        sinks: more places each cycle's report goes, after the callback's own (CSV, pictures, loggers, console).
        **options: the settings, as for ``Profiler`` (docs/usage.md#options), read as ``callback.profiler.settings``;
            ``dirpath=None`` is ``<trainer.log_dir>/fxprof``; ``profile_validation=True`` also profiles validation.

    Example:
        >>> profiler = FXProfilerCallback(wait=5, warmup=1, active=3, module="model")
        >>> Trainer(callbacks=[profiler], max_steps=100).fit(lit_module)
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
        self.profiler = Profiler.for_driver(self, options, chosen=module is not None, idle_hooks=IDLE_HOOKS,
                                            step_end="on_train_batch_end")
        self.extra_sinks = checked_sinks(sinks or ())  # after the callback's own (CSV, pictures, loggers, console)

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
        if stage in ("fit", "validate"):  # (the module is resolved when the loop starts: configure_model may build it)
            out_dir = self.dirpath if self.dirpath is not None else log_dir(trainer)
            self.profiler.attach(functools.partial(module_to_time, pl_module, self.module_path), out_dir,
                                 [*trainer_sinks(trainer, out_dir), *self.extra_sinks],
                                 phase_clock(trainer, self.state_key), train=stage == "fit")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.begin_run()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.begin_validation()  # eval mode: its own capture

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
        self.profiler.end_train_step()

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
            self.profiler.end_validation()

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
        return self.profiler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.profiler.load_state_dict(state_dict)
