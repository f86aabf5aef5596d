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
from fxprof_lightning.timing.clocks import CudaClock

__all__ = ["NodeSamples"]


class NodeSamples:
    """The samples of a ``NodeTimer`` (whose ``__init__`` makes the lists they live in): read (``fwd``, ``bwd_ns``,
    ``range_spans``, ``backward_calls``), made of what was logged (``_fold``, ``add_backward``, ``resolve``), one
    row per name (``_row_of``), and forgotten: all (``reset``) or those logged since a ``mark`` (a capture's
    checking calls, a recorded step that was interrupted).
    """

    def reset(self) -> None:
        """Forget every sample recorded so far."""
        for samples in (*self._fwd, *self._starts, *self.mem_delta, *self.mem_peak):
            samples.clear()
        for entries in (self._stamps, self._sequence_nrs, self._calls, self.anchors, self.call_starts):
            entries.clear()
        self._folded_calls = 0
        for entries in (self._firsts, self._ends, self._owners, self._totals):
            entries.clear()
        self.bwd = [[] for _ in self.nodes]
        self._spans = [[] for _ in self.nodes]
        self.forward_inputs = None
        self.backward_outside_ns = 0  # backward events that no node call's autograd nodes account for
        self.forward_walls_ns: list[int] = []  # each timed call whole, on the host clock (not on CUDA)
        self._marks = []
        self._in_pass = False

    @property
    def fwd(self) -> list[list[Any]]:
        """Per node, the forward duration of each call since ``reset`` (CUDA: event pairs until ``resolve``)."""
        self._fold()
        return self._fwd

    def _fold(self) -> None:
        """Turn what the generated code logged (``_stamps``, ``_sequence_nrs``) into per-node samples.

        A call cut short by an exception counts the nodes that finished."""
        if not self._calls:
            return
        stamps, sequence_nrs = self._stamps, self._sequence_nrs
        bounds = [*self._calls, (len(stamps), len(sequence_nrs), None)]
        for (stamp, sequence, log), (stamp_end, sequence_end, _) in itertools.pairwise(bounds):
            starts, ends = stamps[stamp:stamp_end:2], stamps[stamp + 1:stamp_end:2]  # node i: starts[i], ends[i]
            _append_each(log.fwd, map(operator.sub, ends, starts))  # zip-like: the nodes that finished
            _append_each(log.starts, starts[:len(ends)])
            created = [(index, first, end) for index, (first, end) in enumerate(itertools.pairwise(sequence_nrs[sequence:sequence_end]))
                       if first != end]  # the nodes that created autograd nodes
            for index, first, end in created:
                self._owners.append(log.rows[index])
                self._firsts.append(first)
                self._ends.append(end)
        self._folded_calls += len(self._calls)
        for entries in (stamps, sequence_nrs, self._calls):
            entries.clear()

    @property
    def calls(self) -> int:
        """Forward calls of the instrumented graph since ``reset`` (cheap: nothing is folded)."""
        return self._folded_calls + len(self._calls)

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        """Add each ``(sequence number, duration ns)`` to the node call whose autograd node it timed.

        Durations add up over calls of ``add_backward``: give each event once. A forward call whose
        graph ran backward twice (``retain_graph``) gets one sample, the sum of both.
        """
        self._fold()
        firsts, ends, totals = self._firsts, self._ends, self._totals
        totals.extend([0] * (len(firsts) - len(totals)))
        for sequence_nr, duration in events:
            i = bisect.bisect_right(firsts, sequence_nr) - 1
            if i >= 0 and sequence_nr < ends[i]:
                totals[i] += duration
            else:
                self.backward_outside_ns += duration
        self.bwd = [[] for _ in self.nodes]
        for owner, total in zip(self._owners, totals, strict=True):
            if total:
                self.bwd[owner].append(total)

    def range_spans(self) -> list[tuple[str, int, int]]:
        """``(node name, start perf_counter_ns, duration ns)`` of every node call since ``reset`` (``trace_ranges``)."""
        self._fold()
        return [(info.name, start, duration) for info, starts, durations in zip(self.nodes, self._starts, self._fwd, strict=True)
                for start, duration in zip(starts, durations, strict=False)]

    def backward_calls(self) -> list[tuple[str, int, int]]:
        """``(node name, first, end)``: the autograd sequence numbers ``[first, end)`` each node call created,
        in the order of the calls (CPU, since ``reset``)."""
        self._fold()
        return [(self.nodes[owner].name, first, end) for owner, first, end in zip(self._owners, self._firsts, self._ends, strict=True)]

    def resolve(self) -> None:
        """Turn backward marks into durations and, on CUDA, event pairs into nanoseconds."""
        self._fold()
        marks, self._marks = self._marks, []
        for (durations, start), (_, end) in itertools.pairwise(marks):
            if durations is not None:
                durations.append(self._clock.elapsed(start, end))
        if marks and marks[-1][0] is not None:  # a backward pass still running: keep its open mark
            self._marks = [marks[-1]]
        if self._cuda:
            for samples in self._fwd:
                samples[:] = [CudaClock.resolve(s) for s in samples]

    def bwd_ns(self, index: int) -> list[int]:
        """Backward duration of each forward call of node ``index`` whose backward ran."""
        return self.bwd[index] + [sum(durations) for durations in self._spans[index] if durations]

    def _row(self, node: fx.Node) -> int:
        """The index in ``nodes`` of the row a node's times go to: an existing row of its name, or a new one."""
        return self._row_of(node.meta.get(ROW) or node_info(node))

    def _row_of(self, info: NodeInfo) -> int:
        row = self._rows.get(info.name)
        if row is None:
            row = self._rows[info.name] = len(self.nodes)
            self.nodes.append(info)
            for samples in (self._fwd, self._starts, self.mem_delta, self.mem_peak, self.bwd, self._spans):
                samples.append([])
        return row


    def mark(self) -> tuple[Any, ...]:
        """Where every log of samples ends now: ``drop_since`` forgets what came after."""
        self._fold()
        per_row = [(len(a), len(b), len(c), len(d), len(e)) for a, b, c, d, e in
                   zip(self._fwd, self._starts, self._spans, self.mem_delta, self.mem_peak, strict=True)]
        return (per_row, len(self._firsts), len(self.anchors), len(self._marks), len(self.forward_walls_ns),
                len(self.call_starts), self.forward_inputs, self._folded_calls)

    def drop_since(self, mark: tuple[Any, ...]) -> None:
        """Forget the samples logged since ``mark`` (``mark``)."""
        self._fold()
        per_row, calls, anchors, marks, walls, call_starts, inputs, _ = mark
        for row, lists in enumerate(zip(self._fwd, self._starts, self._spans, self.mem_delta, self.mem_peak, strict=True)):
            for values, length in zip(lists, per_row[row] if row < len(per_row) else (0,) * 5, strict=True):
                del values[length:]
        for entries in (self._firsts, self._ends, self._owners, self._totals):
            del entries[calls:]
        del self.anchors[anchors:], self._marks[marks:], self.forward_walls_ns[walls:], self.call_starts[call_starts:]
        self.forward_inputs = inputs

    def drop_forward_since(self, mark: tuple[Any, ...]) -> None:
        """Forget the forward samples logged since ``mark`` and the calls that logged them, but not which autograd
        nodes those calls created: their backward is still to be timed (a reentrant checkpointed region recomputed
        in backward, whose forward time is its ``_recompute`` row's)."""
        self._fold()
        per_row, calls = mark[0], mark[-1]
        for row, lists in enumerate(zip(self._fwd, self._starts, self.mem_delta, self.mem_peak, strict=True)):
            lengths = per_row[row] if row < len(per_row) else (0,) * 5
            for values, length in zip(lists, (lengths[0], lengths[1], lengths[3], lengths[4]), strict=True):
                del values[length:]
        self._folded_calls = calls



def _append_each(lists: list[list[Any]], values: Iterator[Any]) -> None:
    """``lists[i].append(value i)`` for each value (no more than there are lists), looped in C."""
    collections.deque(map(list.append, lists, values), maxlen=0)
