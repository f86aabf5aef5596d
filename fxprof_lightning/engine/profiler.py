"""``Profiler``: profiling for any training loop (plain PyTorch, Fabric, FSDP2), used like ``torch.profiler.profile``.

The engine underneath (``core.Engine``) does the work; this is its face for a loop that calls ``step()``: it starts
and stops the run, times the plain loop's phases (``loop_phases``) and keeps the schedule position for a resume. The
Lightning callback drives one too (``for_driver``, ``attach``), through the same validation loop's ends and state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from fxprof_lightning.engine.core import Engine
from fxprof_lightning.engine.follow import Trigger
from fxprof_lightning.engine.loop_phases import LoopClock
from fxprof_lightning.engine.settings import Settings
from fxprof_lightning.engine.stage import Stage
from fxprof_lightning.outputs.sinks import Sink
from fxprof_lightning.schedule import ProfilerAction

__all__ = ["Profiler"]


class Profiler(Engine):
    """Profile scheduled steps of any training loop with torch.profiler and per-node timing of Dynamo's graphs.

    Use it like ``torch.profiler.profile``: call ``step()`` once per training step. The schedule
    has the semantics of ``torch.profiler.schedule``: ``skip_first`` idle steps, then cycles of
    ``wait`` idle, ``warmup`` traced-and-discarded and ``active`` recorded steps, ``repeat``
    cycles (0: as long as training runs). At the last recorded step of each cycle its per-node
    table goes to the sinks and its files to ``<dirpath>/cycle_NNNN``.

    Args:
        module: the ``nn.Module`` to time node by node (or a function returning it, called at
            ``start()``). During traced steps only, its class is a same-named subclass whose forward runs the timed graph.
        sinks: where cycle reports go (default ``[CsvSink(), PictureSink(), ConsoleSink()]``); see ``sinks``.
        settings: a ``Settings`` made beforehand, in place of the options (the Lightning callback's, checked once
            under its own name).
        **options: the settings, as keywords (``Settings``: ``wait=``, ``active=``, ``top_k=``, ``capture=``...), each
            in the table of docs/usage.md#options. An unknown name raises ``TypeError``, a value that cannot work
            ``ValueError``; read them back as ``profiler.settings``.

    Example:
        >>> with Profiler(model, wait=5, warmup=1, active=3, repeat=2) as prof:
        ...     for x, y in loader:
        ...         loss_fn(model(x), y).backward()
        ...         opt.step(); opt.zero_grad()
        ...         prof.step()
        >>> print(prof.cycles[-1].to_markdown())
    """

    _running = False  # between start() and stop()

    @classmethod
    def for_driver(cls, driver: Any, options: dict[str, Any], *, chosen: bool, idle_hooks: tuple[str, ...],
                   step_end: str) -> Profiler:
        """The engine of another driver (the Lightning callback): its options checked, and its warnings named, under
        the driver's name; its module, directory and sinks come with ``attach``. Between cycles the driver's
        ``idle_hooks`` do nothing and its ``step_end`` counts the step (``idle.IdleSteps``). ``chosen``: the user named
        the module; else a module whose forward a warm-up step did not run gives way to the children it calls
        (``Timers.children_instead``)."""
        name = type(driver).__name__
        profiler = cls(_not_attached, sinks=[], settings=Settings.of(name, options))
        profiler.name = name
        profiler.timers.children_when_unused = not chosen
        profiler.idle.stand_ins(driver, step_end, empty=idle_hooks)
        return profiler

    def attach(self, module: Callable[[], nn.Module], dirpath: Path, sinks: list[Sink], clock: Callable[[], Any],
               train: bool = True) -> None:
        """A driver's loop is set up (the callback's ``setup``): ``reset`` (with ``train``, training counts from step 0
        again; a checkpoint loaded afterwards says otherwise), then the module to time (a function, called when the run
        begins), where the cycles go, their sinks, and the driver's clock of a recorded step's phases (``DriverNotes``)."""
        self.reset(train)
        self.module, self.dirpath, self.sinks = module, dirpath, sinks
        self.notes.make_clock = clock

    def start(self) -> None:
        """Begin profiling; the code until the next ``step()`` is training step ``step_num``."""
        if self._running:
            raise RuntimeError(f"{self.name}.start() was called twice without stop()")
        self.notes.make_clock = lambda: LoopClock(self.target)
        # Between cycles ``step`` is the idle steps' counter itself (one call a step); the step after them begins here.
        self.idle.stand_ins(self, "step", then=functools.partial(self.begin_step, "train"))
        self.begin_run()
        self.prepare()
        self._running = True
        self.begin_step("train")
        self.time_phases()

    def step(self, batch_size: int | None = None) -> None:
        """End the current step and begin the next (inside ``validation()``: a validation step).

        ``batch_size``: the samples in the step that ends, for per-sample totals (``CycleReport.batch_size``,
        ``fxprof compare``)."""
        idle = self.idle
        if idle.active:  # (a ``step`` bound before the stretch began: ``idle.step_ended`` stands in for it since, and
            idle.step_ended()  # begins the step after the stretch's last)
            return
        if not self._running:
            raise RuntimeError(f"{self.name}.step() was called before start(): use `with {self.name}(...) as prof:` "
                               "or call prof.start() first")
        stage = self._current.name
        notes = self.notes
        notes.add_batch_size(batch_size, stage)
        lapped = stage == "train" and notes.lap()
        self.end_step(stage)
        if stage == "train" and not self.recording("train"):
            self.go_idle()
        self.begin_step(stage)
        self.time_phases()
        if lapped and notes.clock is not None:  # (the rest of this call is the profiler's, not the loop's)
            notes.clock.ours()

    def stop(self) -> None:
        """End profiling: a step in progress that ran the module counts, a cycle in progress is written cut short."""
        if not self._running:
            return
        self._running = False
        self.idle.wake()
        if self._current is self._train and self._train.in_step:
            self.notes.lap()
        self.notes.close_clock()
        self._finish_step(self._current)
        self.end_stage("train")
        self.end_run()

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if error is None:
            self.stop()
        else:
            self._running = False
            self.abort()

    @contextlib.contextmanager
    def validation(self) -> Iterator[Profiler]:
        """Validation steps: inside, ``step()`` advances the validation schedule, and the training step in
        progress is paused (validation is not timed as training). Without ``profile_validation`` nothing
        inside is profiled.

        Example:
            >>> with prof.validation():
            ...     for x, y in val_loader:
            ...         model(x); prof.step()
        """
        if not self._running:
            raise RuntimeError(f"{self.name}.validation() needs a started profiler")
        self.idle.wake()  # (``step()`` inside is a validation step, not an idle training step's end)
        self.begin_validation()
        self.begin_step("val")
        try:
            yield self
        finally:
            self.end_validation()

    def begin_validation(self) -> None:
        """A validation loop starts (``validation()``; the callback's ``on_validation_start``): the training step in
        progress paused, and the module captured in eval mode (with ``profile_validation``; the run begins where none
        has: ``trainer.validate``)."""
        if self._train.open is not None:
            self._train.open.pause(self.target)
        self._current = self._val
        self.begin_stage("val")

    def end_validation(self) -> None:
        """The validation loop ended: its step in progress counted or dropped (``_finish_step``), a cycle it left
        written (a new piece next time), and the training step in progress resumed."""
        self._finish_step(self._val)
        self.end_stage("val")
        self._current = train = self._train
        if train.in_step and train.open is not None and self._enabled:
            train.open.resume(self.target)

    def _finish_step(self, stage: Stage) -> None:
        """The step in progress when a loop stops: counted if the module ran in it, else dropped."""
        if not stage.in_step:
            return
        if stage.open is not None and stage.open.ran_in_step:
            self.end_step(stage.name)
            return
        stage.in_step = False
        if stage.open is not None:
            stage.open.pause(self.target)

    def state_dict(self) -> dict[str, Any]:
        """The schedule position and a cycle planned out of the schedule (a request taken is neither lost nor
        doubled by a restart), to resume with ``load_state_dict``."""
        self.idle.catch_up()
        train = self._train
        trigger = vars(train.trigger) if train.trigger is not None else None
        return {"step": train.step, "val_step": self._val.step, "triggered": train.triggered, "trigger": trigger,
                "planned": {str(step): action.name for step, action in train.planned.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the schedule where ``state_dict`` left it (call before ``start()``)."""
        self.idle.wake()
        self._train.step = int(state_dict.get("step", 0))
        self._val.step = int(state_dict.get("val_step", 0))
        self._train.triggered = int(state_dict.get("triggered", 0))
        trigger = state_dict.get("trigger")
        self._train.trigger = Trigger(**trigger) if isinstance(trigger, dict) else None
        self._train.planned = {int(step): ProfilerAction[name] for step, name in state_dict.get("planned", {}).items()}


def _not_attached() -> nn.Module:
    """A driver's engine before ``attach``: no module to time yet."""
    raise RuntimeError("the profiler has no module to time yet: its driver attaches one (Profiler.attach) first")
