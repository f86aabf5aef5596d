"""Where the whole training step goes: waiting for data, training_step, zero_grad, backward, optimizer, callbacks.

With Lightning (``PhaseClock``):

Lightning announces each part of a step to its profiler (``trainer.profiler.start(action)`` / ``stop(action)``,
the action names ``SimpleProfiler`` prints: ``[_TrainingEpochLoop].train_dataloader_next``,
``[Strategy]SingleDeviceStrategy.training_step``, ``[Strategy]...backward``, ``[LightningModule]...optimizer_step``,
``[Callback]...on_train_batch_end``...). ``PhaseClock`` listens to those calls on the trainer's profiler (the
user's, which gets every call as before) while a cycle records, and gives each nanosecond of the step to the
innermost action open at the time (exclusive time): the optimizer step's own time excludes the closure's
training_step and backward that run inside it. Time inside no action is ``other``. The phases of a step
therefore add up to its wall time, from the end of the step before it to its own end (so the loader's wait for
this step's batch is in it).

In a plain loop (``loop_phases.LoopClock``, for ``Profiler``) only the module's calls tell anything: ``forward`` is the time
inside the module's calls, ``backward`` runs from the first gradient reaching the module's output to the end of
that backward pass, ``fxprof`` is the profiler's own ``step()`` (ending one step and beginning the next: its
bookkeeping, the timer's install), and ``other`` is the rest of the step (loading data, the loss, the optimizer: a
plain loop does not tell them apart). They add up to the step's wall time from one ``step()`` to the next.
"""

from __future__ import annotations

import time
from typing import Any

from fxprof_lightning.layout import LOOP_PHASES, PHASES

__all__ = ["LOOP_PHASES", "PHASES", "PhaseClock", "phase_of"]

_BY_SUFFIX = (("_dataloader_next", "data"), (".training_step", "training_step"), (".optimizer_zero_grad", "zero_grad"),
              (".backward", "backward"), (".optimizer_step", "optimizer"))


def phase_of(action: str, own: str = "[Callback]FXProfilerCallback") -> str:
    """The phase a Lightning profiler action belongs to.

    >>> phase_of("[_TrainingEpochLoop].train_dataloader_next"), phase_of("[Strategy]DDPStrategy.backward")
    ('data', 'backward')
    >>> phase_of("[Callback]ModelCheckpoint{...}.on_train_batch_end"), phase_of("run_training_batch")
    ('callbacks', 'other')
    """
    for suffix, phase in _BY_SUFFIX:
        if action.endswith(suffix):
            return phase
    if action.startswith(own):
        return "fxprof"
    return "callbacks" if action.startswith("[Callback]") else "other"


class PhaseClock:
    """Exclusive time per phase of the actions a Lightning profiler is told of, from ``PhaseClock(...)`` on.

    It replaces the profiler's ``start`` and ``stop`` by instance attributes that time the call and pass it
    on; ``close()`` removes them. ``lap()`` returns the nanoseconds per phase since the last lap (or since
    it was created) and starts the next lap.
    """

    def __init__(self, profiler: Any, own: str = "[Callback]FXProfilerCallback", inside: str | None = None) -> None:
        self._profiler, self._own = profiler, own
        self._start_call, self._stop_call = profiler.start, profiler.stop
        self._saved = {name: profiler.__dict__[name] for name in ("start", "stop") if name in profiler.__dict__}
        # (action, phase), innermost last; ``inside``: the action open now (the hook that creates the clock)
        self._phases: dict[str, str] = {}  # action -> its phase (``phase_of``; Lightning names ~30 actions a step)
        self._open: list[tuple[str, str]] = [(inside, phase_of(inside, own))] if inside else []
        self._totals = dict.fromkeys(PHASES, 0)
        self._last = time.perf_counter_ns()
        profiler.start, profiler.stop = self._start, self._stop

    def _tick(self) -> None:
        now = time.perf_counter_ns()
        self._totals[self._open[-1][1] if self._open else "other"] += now - self._last
        self._last = now

    def _start(self, action: str) -> None:
        self._tick()
        phase = self._phases.get(action)
        if phase is None:
            phase = self._phases[action] = phase_of(action, self._own)
        self._open.append((action, phase))
        self._start_call(action)

    def _stop(self, action: str) -> None:
        self._stop_call(action)
        self._tick()
        for i in range(len(self._open) - 1, -1, -1):  # Lightning stops the innermost first; be lenient
            if self._open[i][0] == action:
                del self._open[i]
                break

    def lap(self) -> dict[str, int]:
        self._tick()
        lap, self._totals = self._totals, dict.fromkeys(PHASES, 0)
        return lap

    def close(self) -> None:
        for name in ("start", "stop"):
            self._profiler.__dict__.pop(name, None)
        self._profiler.__dict__.update(self._saved)

