"""Device time per range from a Kineto trace's GPU events: the one place that reads what ran on a GPU.

Every GPU kernel, memcpy and memset in a trace (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``) is
tied to the CPU-side call that launched it (``cudaLaunchKernel``, ``cudaLaunchKernelExC``, ``cuLaunchKernel``
for Triton, ``cudaMemcpyAsync``...: ``cat`` ``cuda_runtime`` or ``cuda_driver``) by the ``correlation`` id
both carry, or, for a GPU event without one, by its ``ac2g`` flow; and the launch to the innermost range
that contains it on the launching thread. Which ranges count is the caller's choice: the node ranges
fxprof writes into the trace (``"<node>"`` around a forward call, ``"<node> backward"`` around its autograd
nodes), or, on traces from elsewhere, their ``cpu_op`` / ``user_annotation`` ranges.

A range's device time is the sum of its GPU events' durations; its device span runs from the first of them
to start to the last to end, and its idle time is the part of the span no event of its own covers. Every GPU
event lands in exactly one place: one range, ``outside`` (its launch is in no range), or ``unlaunched`` (no
launch found, e.g. the profiler started after the launch). Flows whose id names no launch are counted.

Reading a trace adds nothing to the run: no CUDA event and no synchronisation, whatever the model.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEVICE_CATEGORIES", "LAUNCH_CATEGORIES", "Attribution", "RangeTime", "attribute", "device_times_by_name",
           "node_device_times", "summary"]

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
FLOW_CATEGORY = "ac2g"


def _ns(microseconds: float) -> int:
    return round(microseconds * 1000)


@dataclass
class RangeTime:
    """One range of the trace and the GPU events launched inside it (innermost), in ns."""

    name: str
    pid: Any
    tid: Any
    start: int
    end: int
    kernels: int = 0
    device_ns: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (start, end) of each GPU event

    @property
    def span_ns(self) -> int:
        """From the first of its GPU events to start to the last to end (0 with none)."""
        return max(end for _, end in self.spans) - min(start for start, _ in self.spans) if self.spans else 0

    @property
    def idle_ns(self) -> int:
        """The part of the span that none of its GPU events covers (gaps between its kernels)."""
        covered, reach = 0, None
        for start, end in sorted(self.spans):
            if reach is None or start > reach:
                covered += end - start
                reach = end
            elif end > reach:
                covered += end - reach
                reach = end
        return self.span_ns - covered


@dataclass
class Attribution:
    """Where every GPU event of a trace went (see the module docstring); times in ns."""

    ranges: list[RangeTime]
    kernels: int = 0
    device_ns: int = 0
    outside: int = 0  # GPU events whose launch is in no range
    outside_ns: int = 0
    unlaunched: int = 0  # GPU events with no launch in the trace
    unlaunched_ns: int = 0
    orphan_flows: int = 0  # ac2g flows whose id names no launch


def attribute(events: Iterable[dict[str, Any]], is_range: Callable[[dict[str, Any]], bool]) -> Attribution:
    """Tie each GPU event of a Chrome trace's ``traceEvents`` to the innermost range (``is_range``) around its launch."""
    ranges: list[RangeTime] = []
    launches: dict[int, tuple[Any, Any, int]] = {}  # correlation id -> (pid, tid, start ns) of the launch
    device: list[dict[str, Any]] = []
    flow_ids: dict[tuple[Any, Any, int], int] = {}  # (pid, tid, ts ns) of the GPU end of a flow -> its id
    flow_starts: set[int] = set()
    for event in events:
        phase, category = event.get("ph"), event.get("cat")
        if phase == "X":
            if category in DEVICE_CATEGORIES:
                device.append(event)
            elif category in LAUNCH_CATEGORIES:
                correlation = (event.get("args") or {}).get("correlation")
                if correlation is not None:
                    launches[correlation] = (event["pid"], event["tid"], _ns(event["ts"]))
            if is_range(event):
                start = _ns(event["ts"])
                ranges.append(RangeTime(event["name"], event["pid"], event["tid"], start, start + _ns(event.get("dur", 0))))
        elif category == FLOW_CATEGORY and phase in ("s", "f") and "id" in event:
            flow_starts.add(event["id"])
            flow_ids[event.get("pid"), event.get("tid"), _ns(event["ts"])] = event["id"]
    attribution = Attribution(ranges)
    attribution.orphan_flows = sum(1 for flow in flow_starts if flow not in launches)
    by_thread: dict[tuple[Any, Any], list[tuple[int, dict[str, Any]]]] = {}
    for event in device:
        duration = _ns(event.get("dur", 0))
        attribution.kernels += 1
        attribution.device_ns += duration
        correlation = (event.get("args") or {}).get("correlation")
        if correlation not in launches:
            correlation = flow_ids.get((event.get("pid"), event.get("tid"), _ns(event["ts"])))
        launch = launches.get(correlation)
        if launch is None:
            attribution.unlaunched += 1
            attribution.unlaunched_ns += duration
            continue
        pid, tid, at = launch
        by_thread.setdefault((pid, tid), []).append((at, event))
    for (pid, tid), launched in by_thread.items():
        own = sorted((r for r in ranges if (r.pid, r.tid) == (pid, tid)), key=lambda r: (r.start, -r.end))
        for (_, event), where in zip(sorted(launched, key=lambda item: item[0]), _innermost(own, sorted(a for a, _ in launched)),
                                      strict=True):
            start, duration = _ns(event["ts"]), _ns(event.get("dur", 0))
            if where is None:
                attribution.outside += 1
                attribution.outside_ns += duration
                continue
            where.kernels += 1
            where.device_ns += duration
            where.spans.append((start, start + duration))
    return attribution


def _innermost(ranges: list[RangeTime], times: list[int]) -> list[RangeTime | None]:
    """For each time (sorted), the innermost of ``ranges`` (sorted by start, longest first) that contains it."""
    found: list[RangeTime | None] = []
    stack: list[RangeTime] = []
    starts = [r.start for r in ranges]
    pushed = 0
    for at in times:
        for candidate in ranges[pushed:bisect.bisect_right(starts, at)]:
            while stack and stack[-1].end < candidate.start:
                stack.pop()
            stack.append(candidate)
        pushed = max(pushed, bisect.bisect_right(starts, at))
        while stack and stack[-1].end < at:
            stack.pop()
        found.append(stack[-1] if stack else None)
    return found


def device_times_by_name(attribution: Attribution) -> dict[str, list[RangeTime]]:
    """The attributed ranges of each name, in the order they started (one per call of a node range)."""
    named: dict[str, list[RangeTime]] = {}
    for timed in sorted(attribution.ranges, key=lambda r: r.start):
        named.setdefault(timed.name, []).append(timed)
    return named


def node_device_times(names: list[str], attribution: Attribution) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[list[int]]]:
    """Per node (by name, as ``NodeTimer.nodes``): the device ns of each forward call, of each call's
    backward (``"<name> backward"`` ranges), and each forward call's device span and idle ns."""
    named = device_times_by_name(attribution)
    forward = [named.get(name, []) for name in names]
    return ([[r.device_ns for r in calls] for calls in forward],
            [[r.device_ns for r in named.get(f"{name} backward", [])] for name in names],
            [[r.span_ns for r in calls] for calls in forward],
            [[r.idle_ns for r in calls] for calls in forward])


def summary(attribution: Attribution) -> dict[str, float]:
    """Where the trace's GPU time went, in ms (``CycleReport.device``)."""
    in_nodes = sum(r.device_ns for r in attribution.ranges)
    return {"kernels": attribution.kernels, "device_ms": attribution.device_ns / 1e6, "in_nodes_ms": in_nodes / 1e6,
            "outside_ms": attribution.outside_ns / 1e6, "unlaunched": attribution.unlaunched,
            "unlaunched_ms": attribution.unlaunched_ns / 1e6, "orphan_flows": attribution.orphan_flows}
