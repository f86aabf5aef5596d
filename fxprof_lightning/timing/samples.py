"""A node timer's samples: what its generated code logged, folded into per-row forward times; backward events and
marks made per-row backward times; the samples logged since a mark forgotten."""

from __future__ import annotations

import bisect
import collections
import itertools
import operator
from collections.abc import Iterator
from typing import Any

from torch import fx

from fxprof_lightning.nodes import ROW, NodeInfo, node_info
from fxprof_lightning.timing.clocks import CudaClock, HostClock, cuda_allocated

__all__ = ["NodeSamples"]


class NodeSamples:
    """The samples of a ``NodeTimer`` (held as its ``samples``), one row per name (``row_of``): read (``fwd``,
    ``bwd_ns``, ``range_spans``, ``backward_calls``), made of what was logged (``fold``, ``add_backward``,
    ``resolve``), and forgotten: all (``reset``) or those logged since a ``mark`` (a capture's checking calls, a
    recorded step that was interrupted).

    Args:
        cuda: forward samples are CUDA event pairs (``resolve`` reads them).
        clock: the clock of the backward marks (``resolve``).
    """

    def __init__(self, cuda: bool, clock: type[CudaClock] | type[HostClock]) -> None:
        self._cuda, self._clock = cuda, clock
        self.nodes: list[NodeInfo] = []
        self.rows_by_name: dict[str, int] = {}  # node name -> index in ``nodes`` (graphs added later share rows by name)
        self.durations: list[list[Any]] = []  # per node, one duration per call (read as ``fwd``, the log folded in)
        self.starts: list[list[int]] = []  # CPU: the perf_counter_ns start of each sample in durations
        # CPU: what the generated code logs, turned into samples by ``fold``: two clock reads per timed node,
        # the sequence number before the first timed node and after each, and where each call's entries begin.
        self.stamps: list[int] = []
        self.sequence_nrs: list[int] = []
        self.logged_calls: list[tuple[int, int, Any]] = []  # (stamp, sequence number, ``node_timing.GraphLog``)
        self._folded_calls = 0
        self.anchors: list[tuple[int, int, int]] = []  # with trace_ranges: (number, ns before, ns after) per anchor range
        self.call_starts: list[int] = []  # with trace_ranges: the perf_counter_ns start of each forward call (``node_ranges``)
        self.bwd: list[list[int]] = []  # per node: the backward ns of each call whose backward ran
        self.mem_delta: list[list[int]] = []
        self.mem_peak: list[list[int]] = []
        self.forward_inputs: tuple[Any, ...] | None = None  # the first call's inputs after reset (for FLOP counting)
        # CPU: one entry per node call that created autograd nodes, in the order they ran (so by sequence number).
        self.firsts: list[int] = []  # its first autograd sequence number,
        self.ends: list[int] = []  # the one after its last,
        self.owners: list[int] = []  # its node's index,
        self.totals: list[int] = []  # and the backward ns given by add_backward.
        # CUDA: per node and call, durations between backward marks, and the marks (durations to add to, event).
        self.spans: list[list[list[Any]]] = []
        self.marks: list[tuple[list[Any] | None, Any]] = []
        self.backward_outside_ns = 0  # backward events that no node call's autograd nodes account for
        self.forward_walls_ns: list[int] = []  # each timed call whole, on the host clock (not on CUDA)

    def reset(self) -> None:
        """Forget every sample recorded so far."""
        for samples in (*self.durations, *self.starts, *self.mem_delta, *self.mem_peak):
            samples.clear()
        for entries in (self.stamps, self.sequence_nrs, self.logged_calls, self.anchors, self.call_starts):
            entries.clear()
        self._folded_calls = 0
        for entries in (self.firsts, self.ends, self.owners, self.totals):
            entries.clear()
        self.bwd = [[] for _ in self.nodes]
        self.spans = [[] for _ in self.nodes]
        self.forward_inputs = None
        self.backward_outside_ns = 0
        self.forward_walls_ns = []
        self.marks = []

    @property
    def fwd(self) -> list[list[Any]]:
        """Per node, the forward duration of each call since ``reset`` (CUDA: event pairs until ``resolve``)."""
        self.fold()
        return self.durations

    def fold(self) -> None:
        """Turn what the generated code logged (``stamps``, ``sequence_nrs``) into per-node samples.

        A call cut short by an exception counts the nodes that finished."""
        if not self.logged_calls:
            return
        stamps, sequence_nrs = self.stamps, self.sequence_nrs
        bounds = [*self.logged_calls, (len(stamps), len(sequence_nrs), None)]
        for (stamp, sequence, log), (stamp_end, sequence_end, _) in itertools.pairwise(bounds):
            starts, ends = stamps[stamp:stamp_end:2], stamps[stamp + 1:stamp_end:2]  # node i: starts[i], ends[i]
            _append_each(log.fwd, map(operator.sub, ends, starts))  # zip-like: the nodes that finished
            _append_each(log.starts, starts[:len(ends)])
            created = [(index, first, end) for index, (first, end) in enumerate(itertools.pairwise(sequence_nrs[sequence:sequence_end]))
                       if first != end]  # the nodes that created autograd nodes
            for index, first, end in created:
                self.owners.append(log.rows[index])
                self.firsts.append(first)
                self.ends.append(end)
        self._folded_calls += len(self.logged_calls)
        for entries in (stamps, sequence_nrs, self.logged_calls):
            entries.clear()

    @property
    def calls(self) -> int:
        """Forward calls of the instrumented graph since ``reset`` (cheap: nothing is folded)."""
        return self._folded_calls + len(self.logged_calls)

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        """Add each ``(sequence number, duration ns)`` to the node call whose autograd node it timed.

        Durations add up over calls of ``add_backward``: give each event once. A forward call whose
        graph ran backward twice (``retain_graph``) gets one sample, the sum of both.
        """
        self.fold()
        firsts, ends, totals = self.firsts, self.ends, self.totals
        totals.extend([0] * (len(firsts) - len(totals)))
        for sequence_nr, duration in events:
            i = bisect.bisect_right(firsts, sequence_nr) - 1
            if i >= 0 and sequence_nr < ends[i]:
                totals[i] += duration
            else:
                self.backward_outside_ns += duration
        self.bwd = [[] for _ in self.nodes]
        for owner, total in zip(self.owners, totals, strict=True):
            if total:
                self.bwd[owner].append(total)

    def range_spans(self) -> list[tuple[str, int, int]]:
        """``(node name, start perf_counter_ns, duration ns)`` of every node call since ``reset`` (``trace_ranges``)."""
        self.fold()
        return [(info.name, start, duration) for info, starts, durations in zip(self.nodes, self.starts, self.durations, strict=True)
                for start, duration in zip(starts, durations, strict=False)]

    def backward_calls(self) -> list[tuple[str, int, int]]:
        """``(node name, first, end)``: the autograd sequence numbers ``[first, end)`` each node call created,
        in the order of the calls (CPU, since ``reset``)."""
        self.fold()
        return [(self.nodes[owner].name, first, end) for owner, first, end in zip(self.owners, self.firsts, self.ends, strict=True)]

    def resolve(self) -> None:
        """Turn backward marks into durations and, on CUDA, event pairs into nanoseconds."""
        self.fold()
        marks, self.marks = self.marks, []
        for (durations, start), (_, end) in itertools.pairwise(marks):
            if durations is not None:
                durations.append(self._clock.elapsed(start, end))
        if marks and marks[-1][0] is not None:  # a backward pass still running: keep its open mark
            self.marks = [marks[-1]]
        if self._cuda:
            for samples in self.durations:
                samples[:] = [CudaClock.resolve(s) for s in samples]

    def record_cuda_memory(self, index: int, allocated_before: int) -> None:
        """The allocator's bytes a node call added on CUDA (the generated code calls it, hooked, once per node)."""
        # The allocator's counter only: the peak statistics are the user's (DeviceStatsMonitor,
        # max_memory_allocated), never reset here, so no per-node peak (``mem_peak`` stays empty).
        self.mem_delta[index].append(cuda_allocated() - allocated_before)

    def bwd_ns(self, index: int) -> list[int]:
        """Backward duration of each forward call of node ``index`` whose backward ran."""
        return self.bwd[index] + [sum(durations) for durations in self.spans[index] if durations]

    def row(self, node: fx.Node) -> int:
        """The index in ``nodes`` of the row a node's times go to: an existing row of its name, or a new one."""
        return self.row_of(node.meta.get(ROW) or node_info(node))

    def row_of(self, info: NodeInfo) -> int:
        row = self.rows_by_name.get(info.name)
        if row is None:
            row = self.rows_by_name[info.name] = len(self.nodes)
            self.nodes.append(info)
            for samples in (self.durations, self.starts, self.mem_delta, self.mem_peak, self.bwd, self.spans):
                samples.append([])
        return row

    def mark(self) -> tuple[Any, ...]:
        """Where every log of samples ends now: ``drop_since`` forgets what came after."""
        self.fold()
        per_row = [(len(a), len(b), len(c), len(d), len(e)) for a, b, c, d, e in
                   zip(self.durations, self.starts, self.spans, self.mem_delta, self.mem_peak, strict=True)]
        return (per_row, len(self.firsts), len(self.anchors), len(self.marks), len(self.forward_walls_ns),
                len(self.call_starts), self.forward_inputs, self._folded_calls)

    def drop_since(self, mark: tuple[Any, ...]) -> None:
        """Forget the samples logged since ``mark`` (``mark``)."""
        self.fold()
        per_row, calls, anchors, marks, walls, call_starts, inputs, _ = mark
        for row, lists in enumerate(zip(self.durations, self.starts, self.spans, self.mem_delta, self.mem_peak, strict=True)):
            for values, length in zip(lists, per_row[row] if row < len(per_row) else (0,) * 5, strict=True):
                del values[length:]
        for entries in (self.firsts, self.ends, self.owners, self.totals):
            del entries[calls:]
        del self.anchors[anchors:], self.marks[marks:], self.forward_walls_ns[walls:], self.call_starts[call_starts:]
        self.forward_inputs = inputs

    def drop_forward_since(self, mark: tuple[Any, ...]) -> None:
        """Forget the forward samples logged since ``mark`` and the calls that logged them, but not which autograd
        nodes those calls created: their backward is still to be timed (a reentrant checkpointed region recomputed
        in backward, whose forward time is its ``_recompute`` row's)."""
        self.fold()
        per_row, calls = mark[0], mark[-1]
        for row, lists in enumerate(zip(self.durations, self.starts, self.mem_delta, self.mem_peak, strict=True)):
            lengths = per_row[row] if row < len(per_row) else (0,) * 5
            for values, length in zip(lists, (lengths[0], lengths[1], lengths[3], lengths[4]), strict=True):
                del values[length:]
        self._folded_calls = calls


def _append_each(lists: list[list[Any]], values: Iterator[Any]) -> None:
    """``lists[i].append(value i)`` for each value (no more than there are lists), looped in C."""
    collections.deque(map(list.append, lists, values), maxlen=0)
