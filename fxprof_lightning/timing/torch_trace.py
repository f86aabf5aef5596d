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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction

from fxprof_lightning.timing.backward_events import backward_durations
from fxprof_lightning.timing.gpu_trace import DEVICE_CATEGORIES, Attribution, attribute
from fxprof_lightning.timing.node_timing import ANCHOR
from fxprof_lightning.timing.quiet import quiet_kineto

__all__ = ["CycleTrace", "ModuleCalls", "add_node_ranges", "check_profiler_kwargs"]

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
        # Set by the engine: what add_node_ranges writes into the trace (NodeTimer.anchors, .range_spans, .backward_calls,
        # and the module calls around the nodes: ``Cycle.node_ranges``).
        self.node_ranges: Callable[[], tuple[list[Any], list[Any], list[Any], ModuleCalls | None] | None] | None = None
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


@dataclass(frozen=True)
class ModuleCalls:
    """The modules around the nodes, for ``add_node_ranges`` to write a range per module call.

    ``call_starts``: the ``perf_counter_ns`` start of each forward call of the profiled module (``NodeTimer.call_starts``),
    which tells the calls of the profiled module apart; ``stacks``: each node's ``NodeInfo.module_stack``; ``types``: the
    type name of each module path (``""``: the profiled module).
    """

    call_starts: list[int]
    stacks: dict[str, tuple[str, ...]]
    types: dict[str, str]


def add_node_ranges(path: Path, anchors: list[tuple[int, int, int]], spans: list[tuple[str, int, int]],
                    backward_calls: list[tuple[str, int, int]] = (), modules: ModuleCalls | None = None,
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

    With ``modules``, also a range per module call around its nodes, which the TensorBoard plugin reads as the
    modules' Python calls (``_module_ranges``): its Module view then shows the model's modules, as it does for a
    ``with_stack`` trace of an eager model (Dynamo inlines the submodules: the Python tracer sees none of their calls).
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
    added, placed = [], []
    for name, start, duration in spans:
        anchor = matched[max(bisect.bisect_right(befores, start) - 1, 0)][2]
        where = anchor["pid"], anchor["tid"]
        if where not in threads:
            threads[where] = _Thread([e for e in kept if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) == where])
        begin, end = threads[where].nest(start + offset, start + offset + duration, slack=max(high - low, 0) + NEST_SLACK_NS)
        added.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": anchor["pid"], "tid": anchor["tid"],
                      "ts": round(begin / 1e3, 3), "dur": round((end - begin) / 1e3, 3)})
        placed.append((name, start, added[-1]["ts"], added[-1]["ts"] + added[-1]["dur"], where))
    added += _backward_ranges(kept, backward_calls)
    # First in the list: a module range with the same edges as an op or a node range is read as the outer one.
    around = _module_ranges(kept, placed, modules) if modules is not None and modules.call_starts else []
    document["traceEvents"] = around + kept + added
    if on_events is not None:
        on_events(document["traceEvents"], added)
    temporary = path.with_name(path.name + ".ranges")
    data = json.dumps(document).encode()  # dumps, not dump: json.dump to a file encodes in Python, 10x slower
    try:
        temporary.write_bytes(gzip.compress(data, compresslevel=6) if zipped else data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return len(added) + len(around)


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


MODULE_PREFIX = "nn.Module: "  # how torch's Python tracer names a module call: "nn.Module: Conv2d_0"


@dataclass(eq=False)
class _ModuleCall:
    """One call of a module around node ranges (``_module_ranges``)."""

    path: str  # the module's path ("" the profiled module)
    parent: _ModuleCall | None
    begin: float  # trace microseconds
    end: float
    where: tuple[Any, Any]  # pid, tid
    depth: int
    real: dict[str, Any] | None = None  # the trace's own event of this call (a ``with_stack`` trace)
    python_id: int | None = None  # its event's, once written (or the real one's)


def _module_ranges(events: list[dict[str, Any]], placed: list[tuple[str, int, float, float, tuple[Any, Any]]],
                   modules: ModuleCalls) -> list[dict[str, Any]]:
    """A ``python_function`` range per module call around node ranges, outermost first: the events torch's Python
    tracer writes for module calls (``with_stack``), from which the TensorBoard plugin builds its Module view (``Python
    id``, ``Python parent id``, ``Python module id``; named ``nn.Module: <type>_<n>``, ``n`` numbering the modules of a
    type as torch does), with the module's path in ``Module path``.

    ``placed``: each node range as written (node name, start ``perf_counter_ns``, begin and end in the trace's
    microseconds, thread). A range goes from its first node range's begin to its last one's end, widened to hold the
    events that would cross its edges (the call is around them: Dynamo's ``Torch-Compiled Region`` of a frame that
    began in the module before its first node, a module event of the trace). A call that the trace already holds as
    a module event (``_match_real``: a ``with_stack`` trace) is not written again: the ranges inside it name that
    event their parent, and one of the trace's module events inside a range written names that range its parent
    (its ``Python parent id`` is changed: under torch.fx the graph calls the submodules, whose calls the Python tracer
    sees, while the modules around them are inlined). A range that would cut through another is left out.
    """
    ordered = _module_calls(placed, modules)
    real = [e for e in events if _is_module_event(e)]
    _match_real(ordered, real, modules.types)
    threads: dict[tuple[Any, Any], _Spans] = {}
    for call in reversed(ordered):  # innermost first: a call holds its children
        if call.real is not None:
            call.begin, call.end = _span(call.real)
        else:
            if call.where not in threads:
                threads[call.where] = _Spans([_span(e) for e in events if e.get("ph") == "X" and "dur" in e
                                              and (e.get("pid"), e.get("tid")) == call.where
                                              and (e.get("cat") != "python_function" or _is_module_event(e))])
            call.begin, call.end = threads[call.where].cover(call.begin, call.end)
        if call.parent is not None and call.parent.real is None:
            call.parent.begin, call.parent.end = min(call.parent.begin, call.begin), max(call.parent.end, call.end)
    kept = _nested([call for call in ordered if call.real is None])
    numbers: dict[str, int] = {}  # type name -> the next free number (after the trace's own events of that type)
    for event in real:
        type_name, _, number = event["name"].removeprefix(MODULE_PREFIX).rpartition("_")
        if number.isdigit():
            numbers[type_name] = max(numbers.get(type_name, 0), int(number) + 1)
    instances: dict[str, tuple[str, int]] = {}  # module path -> type name, number (in the order of first calls, as torch)
    for call in sorted(kept, key=lambda call: (call.begin, call.depth)):
        if call.path not in instances:
            type_name = _type_name(modules.types, call.path)
            instances[call.path] = type_name, numbers.get(type_name, 0)
            numbers[type_name] = instances[call.path][1] + 1
    python_ids = [e["args"]["Python id"] for e in events if isinstance((e.get("args") or {}).get("Python id"), int)]
    next_id = max(python_ids, default=0) + 1
    written = []
    for call in ordered:  # outermost first: a parent has its id before its children
        parent = call.parent
        while parent is not None and parent.python_id is None:  # (one left out)
            parent = parent.parent
        if call.real is not None:
            call.python_id = call.real["args"].get("Python id")
            if parent is not None and parent.real is None:
                call.real["args"]["Python parent id"] = parent.python_id
            continue
        if call not in kept:
            continue
        type_name, number = instances[call.path]
        call.python_id, next_id = next_id, next_id + 1
        args = {"Python id": call.python_id, "Python module id": number, "Module path": call.path}
        if parent is not None:
            args["Python parent id"] = parent.python_id
        written.append({"ph": "X", "cat": "python_function", "name": f"{MODULE_PREFIX}{type_name}_{number}",
                        "pid": call.where[0], "tid": call.where[1], "ts": call.begin,
                        "dur": _exact_duration(call.begin, call.end), "args": args})
    return written


def _module_calls(placed: list[tuple[str, int, float, float, tuple[Any, Any]]], modules: ModuleCalls) -> list[_ModuleCall]:
    """The module calls around the node ranges, outermost first (at each depth in the order of the calls), each from its
    first node range's begin to its last one's end.

    A node range belongs to the call of the profiled module that started last before it (``modules.call_starts``) and,
    in it, to a call of each module of its ``module_stack``: the call of the node range before it where that one is in
    the module too (and in the same calls of the modules around it), else a new one. (A module's call runs its nodes
    one after the other; a shared module called again later in the forward, whose nodes have the same stack in
    another graph of Dynamo's, gets another call.)"""
    calls: list[_ModuleCall] = []
    chain: list[tuple[Any, _ModuleCall]] = []  # the calls the last node range was in: (stack entry, call), outermost first
    for name, start, begin, end, where in sorted(placed, key=lambda node: node[1]):
        keys = [max(bisect.bisect_right(modules.call_starts, start) - 1, 0), *modules.stacks.get(name, ())]
        same = 0
        while same < min(len(chain), len(keys)) and chain[same][0] == keys[same] and chain[same][1].where == where:
            same += 1
        del chain[same:]
        for key in keys[same:]:
            path = key.split("@")[0] if isinstance(key, str) else ""
            calls.append(_ModuleCall(path, chain[-1][1] if chain else None, begin, end, where, len(chain)))
            chain.append((key, calls[-1]))
        for _, call in chain:
            call.begin, call.end = min(call.begin, begin), max(call.end, end)
    return sorted(calls, key=lambda call: call.depth)


class _Spans:
    """A thread's events as ``(begin, end)`` in the trace's microseconds, to widen a module range over them."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        self.by_begin = sorted(spans)
        self.begins = [a for a, _ in self.by_begin]
        self.by_end = sorted(spans, key=lambda span: span[1])
        self.ends = [b for _, b in self.by_end]

    def cover(self, begin: float, end: float) -> tuple[float, float]:
        """``begin, end`` widened until no event crosses an edge (one that begins inside and ends after, or the other
        way round)."""
        for _ in range(16):
            inside_begins = self.by_begin[bisect.bisect_right(self.begins, begin):bisect.bisect_left(self.begins, end)]
            inside_ends = self.by_end[bisect.bisect_right(self.ends, begin):bisect.bisect_left(self.ends, end)]
            wider = (min([begin, *(a for a, _ in inside_ends)]), max([end, *(b for _, b in inside_begins)]))
            if wider == (begin, end):
                break
            begin, end = wider
        return begin, end


def _is_module_event(event: dict[str, Any]) -> bool:
    """Whether an event is a module call seen by torch's Python tracer (``with_stack``)."""
    return event.get("cat") == "python_function" and "Python module id" in (event.get("args") or {})


def _type_name(types: dict[str, str], path: str) -> str:
    return types.get(path) or path.rsplit(".", 1)[-1] or "Module"


def _match_real(ordered: list[_ModuleCall], real: list[dict[str, Any]], types: dict[str, str]) -> None:
    """Set ``call.real`` of each call (outermost first) that the trace holds as a module event (``with_stack``: the
    profiled module's own call, a submodule that ran eagerly, every leaf module's call under torch.fx): the outermost
    event of the call's module type on its thread around the call's range or inside it (torch.fx times a submodule's
    call whole: its node range holds the call), that no other call took, inside the event of the call's nearest
    ancestor that has one."""
    by_type: dict[tuple[Any, Any, str], list[dict[str, Any]]] = {}
    for event in sorted(real, key=lambda e: (e["ts"], -e["dur"])):  # outermost first
        type_name = event["name"].removeprefix(MODULE_PREFIX).rpartition("_")[0]
        by_type.setdefault((event["pid"], event["tid"], type_name), []).append(event)
    taken: set[int] = set()
    for call in ordered:
        ancestor = call.parent
        while ancestor is not None and ancestor.real is None:
            ancestor = ancestor.parent
        outer = _span(ancestor.real) if ancestor is not None else None
        span = (call.begin, call.end)
        for event in by_type.get((*call.where, _type_name(types, call.path)), ()):
            if (id(event) not in taken and (_within(span, _span(event)) or _within(_span(event), span))
                    and (outer is None or _within(_span(event), outer))):
                call.real = event
                taken.add(id(event))
                break


def _span(event: dict[str, Any]) -> tuple[float, float]:
    return event["ts"], event["ts"] + event["dur"]


def _within(inner: tuple[float, float], outer: tuple[float, float]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def _nested(calls: list[_ModuleCall]) -> set[_ModuleCall]:
    """The calls whose ranges cross none of the others' (of two that cross, the one that begins first is kept)."""
    around: dict[tuple[Any, Any], list[_ModuleCall]] = {}  # per thread, the kept ranges around the one looked at
    kept = set()
    for call in sorted(calls, key=lambda call: (call.begin, -call.end, call.depth)):
        stack = around.setdefault(call.where, [])
        while stack and stack[-1].end <= call.begin:
            stack.pop()
        if stack and call.end > stack[-1].end:
            continue
        stack.append(call)
        kept.add(call)
    return kept


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
