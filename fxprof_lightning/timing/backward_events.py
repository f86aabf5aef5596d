"""The backward pass timed in C++, autograd node by autograd node: torch's profiler callbacks for the backward scope
alone (``BackwardEvents``), and each autograd node's time from a profiler's events (``backward_durations``), given to
the rows that created the nodes by ``NodeTimer.add_backward``."""

from __future__ import annotations

from typing import Any

from fxprof_lightning import torch_api
from fxprof_lightning.timing.quiet import quiet_kineto

__all__ = ["BACKWARD_SCOPE", "BackwardEvents", "backward_durations"]

BACKWARD_SCOPE = int(torch_api.RecordScope.BACKWARD_FUNCTION) if torch_api.RecordScope is not None else -1


class BackwardEvents:
    """Times every autograd node that runs, in C++: the profiler's callbacks for the backward scope alone.

    ``start()`` enables the profiler (CPU activity, ``RecordScope.BACKWARD_FUNCTION`` only: forward
    ops pay nothing); ``stop()`` disables it and returns ``(sequence number, duration ns)`` per
    autograd node run, ready for ``NodeTimer.add_backward``. Keep it running over several steps
    rather than starting it per step: start and stop cost about 0.3 ms together.
    """

    def __init__(self) -> None:
        self.running = False
        self.lost = False  # another profiler took over while this one ran: it recorded nothing usable

    def start(self) -> bool:
        """Start recording; False (and nothing done) when another profiler is already running, or this torch lacks
        what it needs (``torch_api.missing_for_backward_events``: then a warning, once)."""
        missing = torch_api.missing_for_backward_events()
        if missing is not None:
            torch_api.degraded("time the backward from profiler events", f"it has no {missing.replace(':', '.')}; hooks time it")
        if self.running or missing is not None or torch_api.profiler_enabled():
            return False
        with quiet_kineto():
            torch_api.start_backward_events()
        self.running = True
        return True

    def stop(self) -> list[tuple[int, int]]:
        """Stop recording; what ran since ``start`` ([] and ``lost`` if another profiler took over)."""
        if not self.running:
            return []
        self.running = False
        if torch_api.torch_profiler_running() or not torch_api.profiler_enabled():
            self.lost = True  # a torch.profiler started meanwhile: the session is its own, not ours to stop
            return []
        with quiet_kineto():
            results = torch_api.stop_backward_events()
        return backward_durations(results.events())


def backward_durations(events: Any) -> list[tuple[int, int]]:
    """``(sequence number, duration ns)`` of each autograd node run among profiler (``_KinetoEvent``) events.

    Gradient accumulation into a parameter (``AccumulateGrad``, no sequence number) runs right after the
    node that produced the gradient (the engine runs it first, as soon as it is ready), so it gets that
    node's sequence number: a layer's backward time includes accumulating its parameters' gradients.
    """
    timed = sorted((e.start_ns(), e.sequence_nr(), e.duration_ns()) for e in events if e.scope() == BACKWARD_SCOPE)
    durations, last = [], -1
    for _start, sequence_nr, duration in timed:
        last = sequence_nr if sequence_nr >= 0 else last
        if last >= 0:
            durations.append((last, duration))
    return durations
