"""The profiling schedule: which training steps are idle, warm-up or recorded.

A pure function of the step number with exactly the semantics of
``torch.profiler.schedule``, plus the cycle arithmetic the callback needs
(which cycle a step belongs to, which steps a cycle traces and records).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.profiler import ProfilerAction

__all__ = ["ProfilerAction", "Schedule"]


@dataclass(frozen=True)
class Schedule:
    """``skip_first`` idle steps, then cycles of ``wait`` idle, ``warmup`` traced-and-discarded
    and ``active`` recorded steps, ``repeat`` times (0: for ever).

    Example:
        >>> s = Schedule(skip_first=2, wait=1, warmup=1, active=2, repeat=1)
        >>> [s.action(i).name for i in range(7)]
        ['NONE', 'NONE', 'NONE', 'WARMUP', 'RECORD', 'RECORD_AND_SAVE', 'NONE']
        >>> s.recorded_steps(0)
        [4, 5]
    """

    # As ``torch.profiler.schedule``: ``wait``, ``warmup`` and ``active`` have no defaults (the profiler's own options
    # do: ``Settings``, the one place they are declared).
    wait: int
    warmup: int
    active: int
    repeat: int = 0
    skip_first: int = 0

    def __post_init__(self) -> None:
        for name in ("skip_first", "wait", "warmup", "active", "repeat"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.active < 1:
            raise ValueError(f"active must be >= 1 (at least one recorded step per cycle), got {self.active}")

    @property
    def cycle_length(self) -> int:
        return self.wait + self.warmup + self.active

    def cycle_of(self, step: int) -> int | None:
        """The 0-based cycle a step falls in, or None before the first cycle or after the last."""
        if step < self.skip_first:
            return None
        cycle = (step - self.skip_first) // self.cycle_length
        if self.repeat and cycle >= self.repeat:
            return None
        return cycle

    def action(self, step: int) -> ProfilerAction:
        """What to do at ``step``; equal to ``torch.profiler.schedule(...)(step)``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        cycle = self.cycle_of(step)
        if cycle is None:
            return ProfilerAction.NONE
        position = (step - self.skip_first) % self.cycle_length
        if position < self.wait:
            return ProfilerAction.NONE
        if position < self.wait + self.warmup:
            return ProfilerAction.WARMUP
        if position < self.cycle_length - 1:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE

    def first_traced_step(self, cycle: int) -> int:
        """The first warm-up (or, with ``warmup=0``, recorded) step of ``cycle``."""
        return self.skip_first + cycle * self.cycle_length + self.wait

    def next_traced_step(self, step: int) -> int | None:
        """The first step from ``step`` on whose action is not NONE (None: every later step is idle)."""
        cycle = max(step - self.skip_first, 0) // self.cycle_length
        if step >= self.first_traced_step(cycle) + self.warmup + self.active:  # past this cycle's traced steps
            cycle += 1
        if self.repeat and cycle >= self.repeat:
            return None
        return max(step, self.first_traced_step(cycle))

    def traced_steps(self, cycle: int) -> list[int]:
        """Warm-up and recorded steps of ``cycle``, in order."""
        first = self.first_traced_step(cycle)
        return list(range(first, first + self.warmup + self.active))

    def with_lead(self) -> Schedule:
        """The schedule the profiler follows: this one, but with ``warmup=0`` the last idle step before each cycle is a
        warm-up step of its own (the module is captured there, and torch.profiler starts there), so that the recorded
        steps are those ``torch.profiler.schedule`` names, none given up to a capture. Where no idle step comes before
        a cycle (``wait=0``), the capture falls in its first recorded step, which the cycle replaces and names.

        Example:
            >>> s = Schedule(skip_first=1, wait=2, warmup=0, active=3, repeat=1)
            >>> s.with_lead(), s.with_lead().recorded_steps(0) == s.recorded_steps(0) == [3, 4, 5]
            (Schedule(wait=1, warmup=1, active=3, repeat=1, skip_first=1), True)
        """
        if self.warmup or not self.wait:
            return self
        return replace(self, wait=self.wait - 1, warmup=1)

    def recorded_steps(self, cycle: int) -> list[int]:
        """The ``active`` steps of ``cycle``, in order."""
        first = self.first_traced_step(cycle) + self.warmup
        return list(range(first, first + self.active))
