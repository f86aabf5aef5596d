"""``IdleSteps``: the training steps between cycles, counted for the price of a clock read and a list append.

Between cycles the schedule needs nothing but the count of steps, and the long-job follower (``follow``) the time of
each. After a training step's end, ``begin`` starts a stretch over the idle steps ahead but the last (that one runs
in full: the traced step after it begins as any other): for each, the driver calls ``step_ended`` instead of its
per-step work, and may put stand-ins for its per-step methods on itself for the stretch (``begin``'s ``stand_ins``:
the Lightning callback empties its hooks, Lightning looks them up on the instance at every call). ``step_ended``
appends the step's end to ``Follow.ends`` and, every ``BATCH`` steps (``follow.BATCH`` until the watch knows the
step time's level), or at once when the step was slower than the watch's limit or when the request thread raised its
flag, hands the steps to the follower (``_batch``). The stretch ends at its last step, at a trigger (a cycle planned out of the schedule) or when
the driver calls ``wake`` (a checkpoint only needs ``catch_up``: the step count of now). What ``step_ended`` takes,
batches included, is added up (``spent_ns``) and handed to ``Follow.idle_ns``: the idle steps' share of what profiling
cost (a second clock read a step, ~0.05 us).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from fxprof_lightning.engine.follow import BATCH as LEARNING
from fxprof_lightning.engine.follow import NEVER, Follow, Trigger

if TYPE_CHECKING:
    from fxprof_lightning.engine.stage import Stage

__all__ = ["BATCH", "IdleSteps"]

# Idle steps of a stretch noted before they go to the follower: a batch costs 30-70 us with caches cold, and nothing
# waits for it (a slow step, and a request flagged by the thread, are batched at once; the watch refreshes its level
# every ``follow.REFRESH`` steps within a batch).
BATCH = 256


class IdleSteps:
    """A stretch of idle training steps in progress (``active``), for ``Engine``; see the module."""

    def __init__(self) -> None:
        self.active = False
        self.stage: Stage | None = None  # the training stage, whose step count the stretch keeps (``catch_up``)
        self.follow: Follow | None = None
        self.plan: Callable[[Trigger, int], None] | None = None  # ``Engine.plan``
        self.first = 0  # the stage's step count when the stretch began
        self.left = 0  # the steps the stretch skips
        self.given = 0  # of those, the steps ended and handed to the follower
        self.ends: list[int] = []  # the follower's ``ends`` (the same list)
        self.base = 0  # ``len(ends)`` after the last batch
        self.due = 0  # ``len(ends)`` at which ``_batch`` runs next (0: at the next step)
        self.size = BATCH  # the steps' times ``ends`` holds before they go to the follower (after the end before them)
        self.limit = NEVER  # ns: a step slower than this is batched at once (the follower's watch counts it)
        self.driver: Any = None
        self.swapped: dict[str, Any] = {}  # what a stretch puts on the driver (``stand_ins``)
        self.then: Callable[[], None] | None = None  # what the driver does when the stretch ends at a step's end
        self.spent_ns = 0  # the time inside ``step_ended`` since it was last handed to the follower

    def stand_ins(self, driver: Any, end: str, empty: tuple[str, ...] = (), then: Callable[[], None] | None = None) -> None:
        """For each stretch, put ``step_ended`` on ``driver`` as its method ``end``, and a method that does nothing as
        each of ``empty`` (the Lightning callback: its per-step hooks, looked up on the instance at every call;
        ``Profiler``: its ``step``). ``then``: called when the stretch ends at the end of a step (``Profiler`` begins
        the next step)."""
        self.driver, self.then = driver, then
        self.swapped = {**dict.fromkeys(empty, _nothing), end: self.step_ended}

    def begin(self, left: int, stage: Stage, follow: Follow, plan: Callable[[Trigger, int], None]) -> None:
        """Skip the next ``left`` steps of ``stage`` (``plan``: where a trigger of ``follow`` goes)."""
        if left < 1:
            return
        self.active, self.stage, self.follow, self.plan = True, stage, follow, plan
        self.first, self.left, self.given = stage.step, left, 0
        self.ends = follow.ends
        self.base = len(self.ends)
        if self.driver is not None:
            vars(self.driver).update(self.swapped)
        if follow.box is not None:
            follow.box.poke = self._now
        self._plan()

    def step_ended(self, *_: Any, **__: Any) -> None:
        """An idle step ended (the arguments, a Lightning hook's or ``Profiler.step``'s, are not read)."""
        now = perf_counter_ns()
        ends = self.ends
        ends.append(now)
        ended = (len(ends) >= self.due or now - ends[-2] > self.limit) and self._batch()
        self.spent_ns += perf_counter_ns() - now
        if ended:  # (the stretch's time handed over before the next step's own, which is not the idle steps')
            self._hand_over()
            if self.then is not None:
                self.then()

    def ended(self) -> int:
        """The steps of the stretch that ended so far."""
        return self.given + len(self.ends) - self.base if self.active else 0

    def catch_up(self) -> None:
        """Give the stage the count of the idle steps that ended so far (the stretch goes on)."""
        if self.active:
            self.stage.step = self.first + self.ended()

    def wake(self) -> None:
        """End the stretch: the stage's step count up to date, the driver's own methods back."""
        if not self.active:
            return
        self.catch_up()
        self._hand_over()
        self.active = False
        if self.driver is not None:
            for name in self.swapped:
                vars(self.driver).pop(name, None)

    def _hand_over(self) -> None:
        """The idle steps' time so far to the follower (``Follow.idle_ns``)."""
        if self.follow is not None:
            self.follow.idle_ns += self.spent_ns
        self.spent_ns = 0

    def _batch(self) -> bool:
        """The steps noted so far to the follower; whether that ended the stretch."""
        ends, follow = self.ends, self.follow
        count = len(ends) - self.base
        self.given += count
        step = self.first + self.given - 1  # the last step that ended
        # (at the stretch's end or the ranks' agreement, the steps' times wait for the next batch: a short stretch
        # between the budget's skipped cycles costs no batch)
        full = len(ends) > self.size or (len(ends) > 1 and ends[-1] - ends[-2] > self.limit) or follow.asked()
        trigger = follow.noted(step, count, batch=full)
        self.base = len(self.ends)  # (the follower kept the last end only)
        if trigger is not None:
            self.plan(trigger, step)  # the cycle it plans begins with the next step
        if trigger is not None or self.given >= self.left:
            self.wake()  # the next step runs the driver's own methods
            return True
        self._plan()
        return False

    def _plan(self) -> None:
        """When the next batch runs: the follower's next agreement of ranks, the stretch's end, ``BATCH`` steps."""
        follow = self.follow
        watch = follow.watch if follow.rank == 0 else None
        self.limit = watch.limit_ns() if watch is not None else NEVER
        # (until the watch knows the step time's level, which a slow step is compared with: the tick's batches)
        self.size = LEARNING if watch is not None and watch.fires and watch.level is None else BATCH
        self.due = min(self.size + 1, self.base + min(self.left - self.given, follow.room())) if self.ends else 0
        if follow.asked():
            self.due = 0

    def _now(self) -> None:
        """(The request thread.) Batch at the next step."""
        self.due = 0


def _nothing(*_: Any, **__: Any) -> None:
    """An idle step's stand-in for a per-step method of the driver (a Lightning hook)."""
