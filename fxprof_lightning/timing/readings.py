"""What a timer tells the engine (``capture.timers.Timer``), as values: what kind of timer it is (``Traits``), how far
it got (``Progress``) and a cycle's samples made readable (``Collected``, made by ``collected_of``). ``NodeTimer`` makes
them from its parts, ``Uninterrupted`` from the members of the timers that capture nothing; the engine reads them
and writes into no timer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fxprof_lightning.nodes import NodeInfo
from fxprof_lightning.timing.flops import NodeCosts

__all__ = ["Collected", "Progress", "Traits", "Uninterrupted", "collected_of", "cycle_collected"]


@dataclass(frozen=True)
class Traits:
    """What kind of timer it is, for the engine's choices."""

    uses_backward_events: bool  # backward times come from profiler events given to ``collected``
    reads_trace_events: bool  # its rows come from the trace's own events (the trace must keep them)
    device_times_from_trace: bool  # on CUDA, node calls take their kernels' device time from the trace
    without_events: str  # what backward times become when no profiler events can come (for the warning)


@dataclass(frozen=True)
class Progress:
    """How far the timer got: what a cycle asks at each step's edges."""

    calls: int  # a count that grows when the module runs (timed forward calls since ``reset``)
    usable: bool  # the timer still times the calls
    untimed: str | None  # why calls since ``reset`` ran untimed though the timer fits them, or None
    interruptions: int  # grows at each capture and each call that ran untimed (a recorded step in which it grew is dropped)
    interrupted_by: str  # what the last interruption was
    capture_s: tuple[float, ...]  # seconds of each capture the timer made (Dynamo's: capture, check, call)


@dataclass(frozen=True)
class Collected:
    """A cycle's samples, readable: per node (``nodes[i]``) one duration in ns per call, forward and backward, the
    CUDA allocator's bytes (or nothing), FLOPs and bytes; and what no node owns."""

    nodes: list[NodeInfo]
    forward: list[list[Any]]
    backward: list[list[int]]
    mem_delta: list[list[int]]
    mem_peak: list[list[int]]
    costs: NodeCosts | None
    costs_error: str | None  # why FLOPs could not be counted, said once (per graph, per input signature)
    backward_outside_ns: int  # backward events given to ``collected`` that no node call accounts for
    forward_walls_ns: list[int]  # the host wall time of each timed call whole (empty: not measured)
    saved: list[float | None] | None = None  # per node, bytes kept for backward per call (None: unknown; ``memory``)
    saved_unknown: str | None = None  # why some nodes' saved bytes are unknown
    held: list[float | None] | None = None  # per node, the bytes held for backward once it has run (``SavedBytes.held``)


def collected_of(samples: Any, costs: NodeCosts | None, costs_error: str | None,
                 saved: tuple[Any, Any, Any] = (None, None, None)) -> Collected:
    """A ``Collected`` of the samples a timer keeps (its ``NodeSamples``, or the timer itself: ``nodes``, ``fwd``,
    ``bwd_ns``...), copied (``reset`` empties them); ``saved``: the saved bytes, why some are unknown and the bytes
    held (``SavedReader.take``)."""
    return Collected(list(samples.nodes), _copies(samples.fwd), [samples.bwd_ns(i) for i in range(len(samples.nodes))],
                     _copies(samples.mem_delta), _copies(samples.mem_peak), costs, costs_error,
                     samples.backward_outside_ns, list(samples.forward_walls_ns), *saved)


def cycle_collected(timer: Any, backward: list[tuple[int, int]], trace_events: list[Any], training: bool, samples: Any,
                    saved: Callable[[], tuple[Any, Any, Any]] = lambda: (None, None, None)) -> Collected | str:
    """A timer's ``collected``: the cycle's samples from its backward (and trace) events, or why nothing was timed;
    ``samples`` as ``collected_of`` reads them, ``saved`` taken once something was timed (``SavedReader.take``)."""
    nothing = timer.collect(backward, trace_events)
    if nothing is not None:
        return nothing
    costs = timer.costs(training)
    costs_error, timer.costs_error = timer.costs_error, None  # handed over once
    return collected_of(samples, costs, costs_error, saved())


def _copies(lists: list[list[Any]]) -> list[list[Any]]:
    """Copies of a timer's per-node lists (``reset`` empties the timer's own)."""
    return [list(samples) for samples in lists]


class Uninterrupted:
    """``traits``, ``progress``, ``save_point`` and ``collected`` (``timers.Timer``) from the members of a timer that
    captures nothing while it times (module hooks, a compiled module's kernels): never interrupted, so a cycle never
    drops a step for it and there is nothing to forget."""

    interruptions = 0  # nothing is captured while it times
    interrupted_by = ""
    capture_s: tuple[float, ...] = ()

    @property
    def traits(self) -> Traits:
        return Traits(self.uses_backward_events, self.reads_trace_events, self.device_times_from_trace,
                      self.without_events)

    @property
    def progress(self) -> Progress:
        return Progress(self.calls, self.usable, self.untimed, self.interruptions, self.interrupted_by,
                        tuple(self.capture_s))

    def save_point(self) -> Callable[[], None]:
        """A function that forgets the samples logged after this call (the class's ``mark`` and ``drop_since``)."""
        return functools.partial(self.drop_since, self.mark())

    def collected(self, backward: list[tuple[int, int]], trace_events: list[Any], training: bool) -> Collected | str:
        """The cycle's samples from its backward events (and trace events), or why nothing was timed."""
        return cycle_collected(self, backward, trace_events, training, self)

    def mark(self) -> None:
        """(Never interrupted: nothing to drop.)"""

    def drop_since(self, mark: None) -> None:
        pass
