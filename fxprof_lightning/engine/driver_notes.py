"""``DriverNotes``: what the driver measures of the recorded steps beside the timer, for ``Engine``.

The whole training step's phases (``CycleReport.phases``) come from the driver's clock, made by ``make_clock`` (the
Lightning callback's ``step_phases.PhaseClock``, ``Profiler``'s ``loop_phases.LoopClock``) and running while training
steps are recorded; the backward's wall time (``CycleReport.backward_wall_ms``) from the Lightning callback's hooks
around it; the batch size (``CycleReport.batch_size``) from either driver. Each goes into the stage's open cycle while
the step in progress is a recorded step (``recording_cycle``: the engine's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fxprof_lightning.engine.cycle import Cycle

__all__ = ["DriverNotes"]


class DriverNotes:
    """The driver's clock of the whole step, the backward's start, and where what they measure goes."""

    def __init__(self, recording_cycle: Callable[[str], Cycle | None]) -> None:
        self.recording_cycle = recording_cycle  # a stage's open cycle while its step in progress is recorded, else None
        self.make_clock: Callable[[], Any] | None = None  # makes the driver's clock of the phases (``lap``, ``close``)
        self.clock: Any = None  # the clock, while training steps are recorded
        self.backward_start: int | None = None

    def time(self, recording: bool, ready: bool) -> None:
        """Run the clock while training steps are recorded (``recording``: the step in progress is one; ``ready``:
        the module is resolved), close it when one is not."""
        if recording and self.clock is None and ready and self.make_clock is not None:
            self.clock = self.make_clock()
        elif not recording:
            self.close_clock()

    def close_clock(self) -> None:
        if self.clock is not None:
            self.clock.close()
            self.clock = None

    def lap(self) -> bool:
        """The phases of the training step that ends, from the clock, to its cycle where it was recorded (before
        ``end_step``); whether the clock runs."""
        if self.clock is None:
            return False
        self.add_step_phases(self.clock.lap())
        return True

    def add_batch_size(self, samples: int | None, stage: str = "train") -> None:
        """The samples in the recorded step in progress (``CycleReport.batch_size``: their mean); before ``end_step``."""
        cycle = self.recording_cycle(stage)
        if samples is not None and cycle is not None:
            cycle.batch_sizes.append(int(samples))

    def add_step_phases(self, phases_ns: dict[str, int], stage: str = "train") -> None:
        """Where the recorded step in progress went, ns per phase (``step_phases.PhaseClock.lap``); before ``end_step``."""
        cycle = self.recording_cycle(stage)
        if cycle is not None:
            cycle.phases.append(phases_ns)

    def backward_started(self) -> None:
        """Mark the start of a recorded training step's backward (measures ``CycleReport.backward_wall_ms``)."""
        if self.recording_cycle("train") is not None:
            self.backward_start = time.perf_counter_ns()

    def backward_ended(self) -> None:
        start, self.backward_start = self.backward_start, None
        cycle = self.recording_cycle("train")
        if start is not None and cycle is not None:
            cycle.backward_wall_ns.append(time.perf_counter_ns() - start)
