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

In a plain loop (``LoopClock``, for ``Profiler``) only the module's calls tell anything: ``forward`` is the time
inside the module's calls, ``backward`` runs from the first gradient reaching the module's output to the end of
that backward pass, and ``other`` is the rest of the step (loading data, the loss, the optimizer: a plain loop
does not tell them apart). They add up to the step's wall time from one ``step()`` to the next.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fxprof_lightning.autograd_walk import tensors_in

__all__ = ["LOOP_PHASES", "PHASES", "LoopClock", "PhaseClock", "phase_of"]

PHASES = ("data", "training_step", "zero_grad", "backward", "optimizer", "callbacks", "fxprof", "other")
LOOP_PHASES = ("forward", "backward", "other")  # a plain loop's (``LoopClock``)
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
        self._open.append((action, phase_of(action, self._own)))
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


class LoopClock:
    """The phases of a plain loop's steps from the module's calls (see the module docstring), from ``LoopClock(...)``
    on: a forward pre-hook and hook on the module, and a hook on each call's first output that needs a gradient
    (it returns None: the gradient is untouched). ``lap()`` returns ns per phase since the last lap; ``close()``
    removes the module's hooks."""

    def __init__(self, module: nn.Module) -> None:
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]
        self._forward = self._backward = 0
        self._started: int | None = None  # the module call in progress
        self._backward_from: int | None = None  # the backward pass in progress
        self._last = time.perf_counter_ns()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() == -1:  # (not a recomputation inside backward)
            self._started = time.perf_counter_ns()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._started is None:
            return
        self._forward += time.perf_counter_ns() - self._started
        self._started = None
        if torch.is_grad_enabled():
            needs_grad = next((t for t in tensors_in(output) if t.requires_grad), None)
            if needs_grad is not None:
                needs_grad.register_hook(self._gradient_arrives)

    def _gradient_arrives(self, grad: torch.Tensor) -> None:
        if self._backward_from is None:
            self._backward_from = time.perf_counter_ns()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._backward += time.perf_counter_ns() - self._backward_from
        self._backward_from = None

    def lap(self) -> dict[str, int]:
        now = time.perf_counter_ns()
        phases = {"forward": self._forward, "backward": self._backward}
        phases["other"] = max(now - self._last - self._forward - self._backward, 0)
        self._forward = self._backward = 0
        self._last = now
        return phases

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
