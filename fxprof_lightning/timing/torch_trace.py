"""One torch.profiler session per cycle, written where the TensorBoard plugin and Perfetto read it.

A fresh ``torch.profiler.profile`` is created for each cycle and lives only over that
cycle's warm-up and recorded steps, so nothing of the profiler runs between cycles. Its
schedule numbers steps like the training run, so the trace's ``ProfilerStep#N`` ranges
carry the same step numbers as the logged scalars. The trace file appears under its final
name in one ``os.replace``: the plugin never sees a partial file. kineto's routine log lines
about starting and stopping the session are kept off the console (``quiet.quiet_kineto``).
"""

from __future__ import annotations

import bisect
import gzip
import inspect
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction

from fxprof_lightning.timing.gpu_trace import DEVICE_CATEGORIES, Attribution, attribute
from fxprof_lightning.timing.node_timing import ANCHOR, backward_durations
from fxprof_lightning.timing.quiet import quiet_kineto

__all__ = ["CycleTrace", "add_node_ranges", "check_profiler_kwargs"]

OWNED_KWARGS = ("schedule", "on_trace_ready")
# torch.profiler's step transitions that start and stop nothing (its ``action_map``): no kineto log to keep off stderr.
_SILENT_STEPS = frozenset({(ProfilerAction.WARMUP, ProfilerAction.WARMUP), (ProfilerAction.RECORD, ProfilerAction.RECORD),
                           (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)})
# Ranges that torch's FSDP2 opens around its work, named after the module: "FSDP::all_gather (blocks.0)".
RANGE_PREFIXES = ("FSDP::",)


def check_profiler_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``kwargs`` for ``torch.profiler.profile``, or ``ValueError`` naming what is wrong."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"profiler_kwargs must be a dict of torch.profiler.profile arguments, got {type(kwargs).__name__}")
    owned = sorted(set(kwargs) & set(OWNED_KWARGS))
    if owned:
        raise ValueError(
            f"profiler_kwargs may not set {', '.join(owned)}: FXProfilerCallback owns the schedule and writes "
            "the traces; use its skip_first/wait/warmup/active/repeat and dirpath arguments instead"
        )
    accepted = set(inspect.signature(torch.profiler.profile).parameters) - {"self", *OWNED_KWARGS}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"profiler_kwargs has unknown torch.profiler.profile arguments {unknown}; accepted: {sorted(accepted)}"
        )
    return dict(kwargs)


class CycleTrace:
    """torch.profiler over the traced steps of one cycle.

    Create it at the start of the cycle's first traced step, call ``step()`` at the end of
    every traced step and ``stop()`` after the last one (or to cut the cycle short: what was
    recorded so far is written then).

    Args:
        actions: the cycle's steps and what the schedule does at each (WARMUP, RECORD, RECORD_AND_SAVE).
        directory: where the trace file goes (it must exist).
        worker: worker name, the part of the file name before the time stamp (``rank0``).
        use_gzip: write ``.pt.trace.json.gz`` instead of ``.pt.trace.json``.
        profiler_kwargs: further ``torch.profiler.profile`` arguments (checked by ``check_profiler_kwargs``).
        backward_events: keep the autograd node times of the trace in ``backward_events`` (for node timing).
        keep_events: keep every event as ``(name, start ns, duration ns, thread, sequence number)`` in ``events`` (for the
            kernels of a compiled module, ``compiled.KernelTimer.read``).

    When the node ranges are written and the trace holds GPU events, ``device`` says where each went
    (``gpu_trace.attribute`` over the node ranges): the device time of every node call, forward and backward.
    """

    def __init__(
        self,
        actions: dict[int, ProfilerAction],
        directory: Path,
        worker: str,
        use_gzip: bool = True,
        profiler_kwargs: dict[str, Any] | None = None,
        backward_events: bool = False,
        keep_events: bool = False,
    ) -> None:
        self.paths: list[Path] = []
        self.errors: list[str] = []
        self.backward_events: list[tuple[int, int]] = []  # (sequence number, ns) per autograd node run (NodeTimer.add_backward)
        self.ranges: dict[str, list[int]] = {}  # ns of each run of a communication range (FSDP::all_gather (blocks.0), ...)
        # Set by the engine: what add_node_ranges writes into the trace (NodeTimer.anchors, .range_spans, .backward_calls).
        self.node_ranges: Callable[[], tuple[list[Any], list[Any], list[Any]] | None] | None = None
        self.events: list[tuple[str, int, int, int, int]] = []
        self.device: Attribution | None = None  # GPU events tied to the node ranges (a trace with GPU events)
        self._collect_backward = backward_events
        self._keep_events = keep_events
        self._directory = directory
        self._worker = worker
        self._suffix = ".pt.trace.json.gz" if use_gzip else ".pt.trace.json"
        self._actions = dict(actions)
        self._schedule = lambda step: self._actions.get(step, ProfilerAction.NONE)
        self._profiler = torch.profiler.profile(
            schedule=self._schedule,
            on_trace_ready=self._write,
            **(profiler_kwargs or {}),
        )
        first = min(self._actions)
        with quiet_kineto():
            if first > 0:
                # Enter the cycle through step() so the profiler's step number is the training step.
                self._profiler.step_num = first - 1
                self._profiler.start()
                self._profiler.step()
            else:
                self._profiler.start()

    def extend(self, steps: list[int]) -> None:
        """Record ``steps`` too (after the cycle's last step, before its ``step()``): the trace is written after them."""
        last = max(self._actions)
        self._actions.update(dict.fromkeys([last, *steps], ProfilerAction.RECORD))
        self._actions[steps[-1]] = ProfilerAction.RECORD_AND_SAVE
        if self._profiler.step_num == last:  # in that step: the profiler took its action when it began
            self._profiler.current_action = ProfilerAction.RECORD

    def step(self) -> None:
        """End the current step (after the cycle's last step this writes the trace)."""
        profiler = self._profiler
        if not profiler.use_device and (profiler.current_action, self._schedule(profiler.step_num + 1)) in _SILENT_STEPS:
            profiler.step()  # a CPU session going on as it is: kineto starts or stops nothing, so it logs nothing
            return
        with quiet_kineto():
            profiler.step()

    def stop(self) -> None:
        """Stop profiling; a cycle cut short is written with what it recorded."""
        with quiet_kineto():
            self._profiler.stop()

    def _write(self, profiler: torch.profiler.profile) -> None:
        events = profiler.profiler.kineto_results.events()
        if self._collect_backward:
            self.backward_events += backward_durations(events)
        if self._keep_events:
            self.events += [(e.name(), e.start_ns(), e.duration_ns(), e.start_thread_id(), e.sequence_nr()) for e in events]
        for event in events:
            if event.name().startswith(RANGE_PREFIXES):
                self.ranges.setdefault(event.name(), []).append(event.duration_ns())
        stamp = time.time_ns()
        final = self._directory / f"{self._worker}.{stamp}{self._suffix}"
        # A name the plugin's pattern (...pt.trace.json[.gz]) does not match, same extension for gzip.
        partial = self._directory / f".{self._worker}.{stamp}.partial{'.json.gz' if self._suffix.endswith('.gz') else '.json'}"
        try:
            profiler.export_chrome_trace(str(partial))
            self._add_node_ranges(partial)
            os.replace(partial, final)
        except Exception as error:  # a trace that cannot be written must not stop training
            for leftover in self._directory.glob(f"{partial.name}*"):  # the exporter may add its own .tmp
                leftover.unlink(missing_ok=True)
            self.errors.append(f"could not write the trace {final}: {type(error).__name__}: {error}")
            return
        self.paths.append(final)

    def _attribute_device_time(self, events: list[dict[str, Any]], added: list[dict[str, Any]]) -> None:
        if not any(event.get("cat") in DEVICE_CATEGORIES for event in events):
            return
        ours = {id(event) for event in added}
        self.device = attribute(events, lambda event: id(event) in ours)

    def _add_node_ranges(self, path: Path) -> None:
        recorded = self.node_ranges() if self.node_ranges is not None else None
        if not recorded or not recorded[1] or not recorded[0]:
            return  # no node call, or none while a profiler ran (no anchor): none of them is in this trace
        try:
            add_node_ranges(path, *recorded, on_events=self._attribute_device_time)
        except Exception as error:  # the trace stays as exported, without node ranges
            self.errors.append(f"could not write the node ranges into the trace {path.name}: {type(error).__name__}: {error}")


def add_node_ranges(path: Path, anchors: list[tuple[int, int, int]], spans: list[tuple[str, int, int]],
                    backward_calls: list[tuple[str, int, int]] = (),
                    on_events: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None) -> int:
    """Write a ``user_annotation`` range per node call into an exported Chrome trace; the number written.

    With ``backward_calls`` (``NodeTimer.backward_calls``: node name and the autograd sequence numbers
    ``[first, end)`` of each call), also a range ``"<node> backward"`` per call whose autograd nodes ran, from
    the first to the last of the trace's ``autograd::engine::evaluate_function`` events with those sequence
    numbers (the profiler's own clock: no alignment needed). One that would overlap another such range
    (a graph run backward twice, ``retain_graph``) or cut through an event is left out.

    ``spans`` are ``(name, start, duration)`` in ``time.perf_counter_ns`` nanoseconds (``NodeTimer.range_spans``).
    The trace's clock is another one (kineto's, in microseconds from ``baseTimeNanoseconds``), so the two are
    tied by the anchor ranges (``NodeTimer.anchors``: ``(number, ns before, ns after)`` around an empty range
    ``fxprof_anchor#number``): the anchor's start and end in the trace both lie between the two clock reads,
    which bounds the offset between the clocks; the bounds of all anchors are intersected (the median of
    their midpoints is taken when a clock step makes them disjoint). Each range goes on the thread (``pid``,
    ``tid`` as the trace names them) of the last anchor before it. The anchors themselves are removed. The
    file is rewritten through a temporary file and ``os.replace``. ``on_events`` is given the trace's events
    and the ranges added, before the file is written.

    The offset is known to about a microsecond, and the first op of a node can start less than that after
    the node's clock read: a range edge that would cut through one of the thread's events is moved to that
    event's edge (``_Thread.nest``), so that ranges nest as the trace format requires.
    """
    zipped = path.name.endswith(".gz")
    data = path.read_bytes()
    document = json.loads(gzip.decompress(data) if zipped else data)
    events = document["traceEvents"]
    found: dict[int, dict[str, Any]] = {}
    kept = []
    for event in events:
        name = event.get("name")
        if isinstance(name, str) and name.startswith(ANCHOR) and event.get("ph") == "X":
            found[int(name[len(ANCHOR):])] = event
        else:
            kept.append(event)
    matched = sorted((before, after, found[number]) for number, before, after in anchors if number in found)
    if not matched:
        raise ValueError("none of the anchor ranges is in the trace")
    low = max(round((e["ts"] + e["dur"]) * 1e3) - after for before, after, e in matched)
    high = min(round(e["ts"] * 1e3) - before for before, after, e in matched)
    if low <= high:
        offset = (low + high) // 2
    else:
        offset = round(statistics.median(round((e["ts"] + e["dur"] / 2) * 1e3) - (before + after) / 2 for before, after, e in matched))
    befores = [before for before, _, _ in matched]
    threads: dict[tuple[Any, Any], _Thread] = {}
    added = []
    for name, start, duration in spans:
        anchor = matched[max(bisect.bisect_right(befores, start) - 1, 0)][2]
        where = anchor["pid"], anchor["tid"]
        if where not in threads:
            threads[where] = _Thread([e for e in kept if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) == where])
        begin, end = threads[where].nest(start + offset, start + offset + duration, slack=max(high - low, 0) + NEST_SLACK_NS)
        added.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": anchor["pid"], "tid": anchor["tid"],
                      "ts": round(begin / 1e3, 3), "dur": round((end - begin) / 1e3, 3)})
    added += _backward_ranges(kept, backward_calls)
    document["traceEvents"] = kept + added
    if on_events is not None:
        on_events(document["traceEvents"], added)
    temporary = path.with_name(path.name + ".ranges")
    data = json.dumps(document).encode()  # dumps, not dump: json.dump to a file encodes in Python, 10x slower
    try:
        temporary.write_bytes(gzip.compress(data, compresslevel=6) if zipped else data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return len(added)


# How far from a range's edge (beyond the uncertainty of the clock offset) an event's edge may be moved across.
NEST_SLACK_NS = 2_000


class _Thread:
    """A thread's complete events in the trace, to fit node ranges between them (integer ns)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        spans = sorted((round(e["ts"] * 1e3), round((e["ts"] + e.get("dur", 0)) * 1e3)) for e in events)
        self.starts = [a for a, _ in spans]
        self.by_start = spans
        self.by_end = sorted(spans, key=lambda span: span[1])
        self.ends = [b for _, b in self.by_end]

    def _near(self, at: int, slack: int) -> list[tuple[int, int]]:
        """Events with an edge within ``slack`` of ``at``."""
        low, high = at - slack, at + slack
        near = self.by_start[bisect.bisect_left(self.starts, low):bisect.bisect_right(self.starts, high)]
        return near + self.by_end[bisect.bisect_left(self.ends, low):bisect.bisect_right(self.ends, high)]

    def cuts(self, begin: int, end: int) -> bool:
        """Whether the range would overlap one of the events partly."""
        inside = self.by_start[bisect.bisect_left(self.starts, begin):bisect.bisect_right(self.starts, end)]
        if any(begin < a < end < b for a, b in inside):
            return True
        ending = self.by_end[bisect.bisect_left(self.ends, begin):bisect.bisect_right(self.ends, end)]
        return any(a < begin < b < end for a, b in ending)

    def nest(self, begin: int, end: int, slack: int) -> tuple[int, int]:
        """``begin, end`` moved so that no event near an edge overlaps the range partly: an event mostly inside
        the range is taken in, one mostly outside is left out."""
        for _ in range(8):
            moved = False
            for a, b in self._near(begin, slack) + self._near(end, slack):
                if not (a < begin < b < end or begin < a < end < b):
                    continue  # inside, outside or around the range
                inside = min(b, end) - max(a, begin)
                if 2 * inside >= b - a:
                    begin, end = min(begin, a), max(end, b)
                elif a < begin:
                    begin = b
                else:
                    end = a
                moved = True
            if not moved or begin >= end:
                break
        return begin, max(begin, end)


EVALUATE = "autograd::engine::evaluate_function: "


def _backward_ranges(events: list[dict[str, Any]], calls: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """A ``"<node> backward"`` range per node call, around the autograd node events it created (see ``add_node_ranges``)."""
    if not calls:
        return []
    firsts = [first for _, first, _ in calls]
    spans: dict[int, list[Any]] = {}  # call -> [begin ns, end ns, pid, tid]
    for event in events:
        name = event.get("name")
        if event.get("ph") != "X" or not isinstance(name, str) or not name.startswith(EVALUATE):
            continue
        sequence_nr = (event.get("args") or {}).get("Sequence number")
        if not isinstance(sequence_nr, int) or sequence_nr < 0:
            continue
        i = bisect.bisect_right(firsts, sequence_nr) - 1
        if i < 0 or sequence_nr >= calls[i][2]:
            continue
        begin, end = event["ts"], event["ts"] + event["dur"]  # the trace's own numbers: edges equal to its events'
        span = spans.get(i)
        if span is None:
            spans[i] = [begin, end, event["pid"], event["tid"]]
        elif (span[2], span[3]) == (event["pid"], event["tid"]):
            span[0], span[1] = min(span[0], begin), max(span[1], end)
    threads: dict[tuple[Any, Any], _Thread] = {}
    placed: list[tuple[float, float, int]] = sorted((begin, end, i) for i, (begin, end, _, _) in spans.items())
    added, last_end = [], None
    for begin, end, i in placed:
        if last_end is not None and begin < last_end:
            continue  # overlaps the previous one (a graph run backward twice)
        pid, tid = spans[i][2], spans[i][3]
        if (pid, tid) not in threads:
            threads[pid, tid] = _Thread([e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) == (pid, tid)])
        if threads[pid, tid].cuts(round(begin * 1e3), round(end * 1e3)):
            continue
        last_end = end
        added.append({"ph": "X", "cat": "user_annotation", "name": f"{calls[i][0]} backward", "pid": pid, "tid": tid,
                      "ts": begin, "dur": _exact_duration(begin, end)})
    return added


def _exact_duration(begin: float, end: float) -> float:
    """A duration with ``begin + duration == end`` in floating point, so the range ends exactly where its last event
    does (a duration rounded to 3 decimals, or off by one ulp, made it cut through that event or the next one)."""
    duration = end - begin
    for _ in range(4):
        reached = begin + duration
        if reached == end:
            break
        duration = math.nextafter(duration, math.inf if reached < end else -math.inf)
    return duration
