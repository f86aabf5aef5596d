"""The timing side of ``DynamoTimer``: each graph Dynamo hands the backend, instrumented and run in the forward's
place (a copy with its own rows for another module of the same code), a call through the graphs, the backward time
of checkpointed regions' recomputes, and FLOPs and bytes per row."""

from __future__ import annotations

import bisect
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture.checkpoints import (
    checkpointed_bodies,
    inline_checkpoints,
    open_checkpoints,
    recompute_log,
    separate_copy,
)
from fxprof_lightning.capture.fsdp_rows import FsdpRows
from fxprof_lightning.capture.graph_breaks import break_row
from fxprof_lightning.capture.row_names import Anchor, Owners, annotate_rows, frame_of, graph_anchor, names_moved
from fxprof_lightning.nodes import JOINS, ROW, is_timed, node_info
from fxprof_lightning.timing.autograd_walk import sequence_nr_now
from fxprof_lightning.timing.flops import NodeCosts, count_costs
from fxprof_lightning.timing.node_timing import NodeTimer

__all__ = ["DynamoGraphs"]


@dataclass
class _Graph:
    """One graph Dynamo captured: as captured, and instrumented (events) and hooked (CUDA, or another profiler); and
    its copies for the other modules that run it, with their own rows (by the module's path)."""

    captured: fx.GraphModule
    lean: fx.GraphModule
    hooked: fx.GraphModule | None = None
    anchor: Anchor | None = None
    inputs: list[Any] = field(default_factory=list)  # the capture's inputs for counting FLOPs (``_meta_input``)
    compile_id: Any = None  # the Dynamo compile it came from (``torch_api.forget_compiles``)
    others: dict[str, _Graph] = field(default_factory=dict)


class DynamoGraphs(NodeTimer):
    """A ``NodeTimer`` over the graphs Dynamo captures (``DynamoTimer``, its subclass, captures them): the backend
    Dynamo calls with each graph, a call through them (``_timed_call``), and their rows' costs.

    Args:
        training: the train/eval mode it times.
        sharded: the module holds FSDP2 modules: on CPU their collectives are rows too (``fsdp_rows``).
        The rest as ``NodeTimer``.
    """

    def __init__(self, training: bool, *, backward: bool = True, device: str = "cpu", annotate: bool = False,
                 trace_ranges: bool = False, sharded: bool = False) -> None:
        self._fsdp: FsdpRows | None = None  # (``reset`` runs in the base's __init__)
        super().__init__(annotate=annotate, backward=backward, device=device, trace_ranges=trace_ranges)
        self._fsdp = FsdpRows() if sharded and not self.on_cuda and FsdpRows.usable() else None
        self.training = training
        self.graphs: list[_Graph] = []
        self._uncounted: list[tuple[fx.GraphModule, list[Any]]] = []  # graphs captured since the last ``costs()``
        self._row_costs: dict[int, list[int | None]] = {}  # row -> fwd FLOPs, bwd FLOPs, out bytes, bytes moved (per call)
        self.costs_error: str | None = None
        self._pending: str | None = "first call"  # capture (and verify) at the next call, for this reason
        self._pending_for: int | None = None  # at the next call of this state only (a miss after a graph break)
        self._expected: dict[int | None, int] = {}  # graph calls in one forward call, as verified, per state (entry)
        # The forward's own control flow varies its graph calls (a random layer drop: a recapture after a call with
        # another count found no guard failing): a count no longer tells a miss. ``_count_missed``: the last miss was one.
        self._counts_vary, self._count_missed = False, False
        # Every capture in the cache is one graph of the forward's own frame (no graph break, no frame of ours): then a
        # call whose guards one capture passes runs that capture's code directly (None: nothing captured yet).
        self._one_frame: bool | None = None
        self._hooks_now = False
        self._names: dict[int, tuple[str, nn.Module]] = {}
        self._tensor_owners = Owners(None)  # the module of each parameter and buffer
        self._streak = 0  # calls in a row that missed the guards
        self._gap: tuple[int, int] | None = None  # the row of the code after the last graph's break, and when it began
        self._inputs_seen: set[int] | None = None  # ids of what the graphs were given, while noted
        self._compiled: Callable[..., Any] | None = None  # the installed module's forward under our Dynamo context

    def _backend(self, captured: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        anchor = graph_anchor(captured, example_inputs, self._tensor_owners.owners, self._names)
        for graph_module in (captured, *checkpointed_bodies(captured)):
            annotate_rows(graph_module, self._names, anchor.frame if anchor else "")
        graph = _Graph(captured, self._instrument(captured, self._annotate, hooked=self._cuda), anchor=anchor,
                       inputs=[_meta_input(t) for t in example_inputs], compile_id=torch_api.current_compile_id())
        self.graphs.append(graph)
        # Counted when asked (``costs``, after the cycle), not here inside the capture's checked calls.
        self._uncounted.append((inline_checkpoints(captured), graph.inputs))
        info = None if self._cuda else break_row(getattr(captured, "compile_subgraph_reason", None), self._root)
        after = self.samples.row_of(info) if info is not None else None  # the code run eagerly after the graph's break

        def run(*args: Any) -> Any:
            if self._inputs_seen is not None:
                self._inputs_seen.update(id(a) for a in args)
            if self._gap is not None:  # the code since the last graph of this call, from its break on
                row, end = self._gap
                self.samples.durations[row].append(time.perf_counter_ns() - end)
                self.samples.starts[row].append(end)
                self._gap = None
            chosen = graph if anchor is None or args[anchor.index] is anchor.tensor else self._run_for(graph, args)
            if self._hooks_now and not self._cuda:
                if chosen.hooked is None:
                    chosen.hooked = self._instrument(chosen.captured, self._annotate, hooked=True)
                out = chosen.hooked.forward(*args)
            else:
                out = chosen.lean.forward(*args)
            self._gap = (after, time.perf_counter_ns()) if after is not None else None
            return out

        return run

    def _run_for(self, graph: _Graph, args: tuple[Any, ...]) -> _Graph:
        """The copy of ``graph`` whose rows are named for the module it runs for now (``Anchor``), made at its first
        call; ``graph`` itself where that module is the capture's, or cannot be told."""
        anchor = graph.anchor
        assert anchor is not None
        owner = self._tensor_owners.of(args[anchor.index])
        frame = frame_of(owner, anchor.inner) if owner is not None else None
        if frame is None or frame == anchor.frame:
            return graph
        other = graph.others.get(frame)
        if other is None:
            names = names_moved(anchor, frame, self._root)
            if names is None:
                return graph
            copied = separate_copy(graph.captured)
            for graph_module in (copied, *checkpointed_bodies(copied)):
                annotate_rows(graph_module, names, frame)
            other = graph.others[frame] = _Graph(copied, self._instrument(copied, self._annotate, hooked=self._cuda))
            self._uncounted.append((inline_checkpoints(copied), graph.inputs))
        return other

    def _timed_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], state: int | None,
                    after_capture: bool = True, entered: int | None = None, run: Callable[..., Any] | None = None) -> Any:
        """A call through the captured graphs of ``state`` (``EntryGuards.check``); where a guard fails, that code runs
        eagerly (untimed: fewer graph calls than that state's) and the next call captures again. A call that fits
        every guard, and was not just captured, ends a streak of misses. Wall time from ``entered`` (guards asked).
        ``run`` (one frame, ``_one_frame``): the code Dynamo made for ``state`` (``EntryGuards.fitting``), called
        directly, without Dynamo's frame evaluation and its second guard check."""
        samples = self.samples
        before, start, self._gap, first = samples.calls, time.perf_counter_ns(), None, sequence_nr_now()
        if self._trace_ranges:
            samples.call_starts.append(start)
        if self._fsdp is not None:
            self._fsdp.in_call = True
        try:
            with self.saved.noting_hooks(self.reads_saved()):
                if run is not None:
                    out = run(*args, **kwargs)
                else:
                    with torch.compiler.set_stance("eager_on_recompile"):
                        out = self._compiled(*args, **kwargs)
        finally:
            if self._fsdp is not None:
                self._fsdp.in_call = False
        self._gap = None
        if samples.calls - before != self._expected.get(state) and not self._counts_vary:
            self._pending, self._pending_for = "a guard failed", state  # captured again at that state's next call
            self._count_missed = True
            self._misses, self._streak, self.interruptions = self._misses + 1, self._streak + 1, self.interruptions + 1
            self.interrupted_by = "a call missed Dynamo's guards inside the forward and ran untimed"
        else:
            self._streak = self._streak if after_capture else 0
            if not self._cuda:  # the call whole, for the time between the rows (``CycleReport.unowned``)
                samples.forward_walls_ns.append(time.perf_counter_ns() - (entered or start))
            self.saved.read(out, first, self._root, self.reads_saved())
        return out

    def _instrument(self, traced: fx.GraphModule, annotate: bool, hooked: bool) -> fx.GraphModule:
        """``NodeTimer``'s instrumented graph, with each checkpointed region opened: its ops are rows of their own
        (``open_checkpoints``)."""
        opened = open_checkpoints(traced, lambda body: self._instrument(body, annotate, hooked),
                                  functools.partial(recompute_log, self, self._recomputed, hooked))
        return super()._instrument(opened, annotate, hooked)

    def _recomputed(self, *entry: int) -> None:
        """A checkpointed region's recompute in backward (``checkpoints.recompute_log``): its row, the sequence number
        of the autograd node that asked for it, its ns and the autograd nodes it created."""
        self._recomputes.append(entry)

    def reset(self) -> None:
        super().reset()
        self._recomputes: list[tuple[int, ...]] = []  # (row, the asking node's sequence number, ns, its autograd nodes)
        self._misses = 0  # calls since that failed a guard (and ran untimed)
        if self._fsdp is not None:
            self._fsdp.reset()

    def collect(self, backward: list[tuple[int, int]], trace_events: list[Any]) -> str | None:
        """``NodeTimer.collect``; under FSDP2, its collectives' rows added (``fsdp_rows``), their time taken out of the
        backward events, the rows and the forward wall that held it (the module's own hooks run around its call)."""
        fsdp = self._fsdp
        if fsdp is None:
            return super().collect(backward, trace_events)
        nothing = super().collect(fsdp.events_less(backward), trace_events)
        samples = self.samples
        fsdp.take_from(samples.starts, samples.durations)
        if samples.forward_walls_ns:
            samples.forward_walls_ns[-1] += fsdp.around_forward_ns()
        for info, forward, backward_ns in fsdp.rows():
            row = samples.row_of(info)
            samples.durations[row] += forward
            samples.bwd[row] += backward_ns
        return nothing

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        """``NodeTimer.add_backward``, with each checkpointed region's recompute moved out of the backward time of
        the autograd node that ran it (matched by sequence number) into the region's ``_recompute`` row.

        A reentrant region's asking node is ``checkpoint``'s own (``CheckpointBackward``): its region's backward
        runs inside it, timed as the rows whose recomputed ops created those autograd nodes, and the rest of it (the
        recompute, putting random states back, starting that inner backward) is the ``_recompute`` row's."""
        if not self._recomputes:
            return super().add_backward(events)
        numbers = sorted(events)
        sums = list(itertools.accumulate((duration for _, duration in numbers), initial=0))
        inside: dict[int, int] = {}
        whole: dict[int, int] = {}  # asking node of a reentrant region -> its recompute's index
        for i, (_row, sequence_nr, ns, first, end) in enumerate(self._recomputes):
            if first == end:
                inside[sequence_nr] = inside.get(sequence_nr, 0) + ns
            else:
                nested = (sums[bisect.bisect_left(numbers, (end,))] - sums[bisect.bisect_left(numbers, (first,))])
                inside[sequence_nr], whole[sequence_nr] = nested, i
        adjusted, own = [], [ns for _, _, ns, _, _ in self._recomputes]
        for sequence_nr, duration in events:
            taken = min(duration, inside.pop(sequence_nr, 0))
            if sequence_nr in whole:
                own[whole.pop(sequence_nr)], taken = duration - taken, duration
            adjusted.append((sequence_nr, duration - taken))
        super().add_backward(adjusted)
        for (row, *_), ns in zip(self._recomputes, own, strict=True):
            self.samples.bwd[row].append(ns)

    def costs(self, training: bool | None = None) -> NodeCosts | None:
        """FLOPs and bytes per row (``NodeCosts`` over ``nodes``; None for a row no captured graph counted), counted
        for each graph at its capture's inputs (``training``: the timer's own mode, accepted for ``timers.Timer``)."""
        for captured, inputs in self._uncounted:
            _count_costs(self, captured, inputs)
        self._uncounted.clear()
        if not self._row_costs:
            return None
        rows = [self._row_costs.get(i) for i in range(len(self.samples.nodes))]
        return NodeCosts(*([r[k] if r else None for r in rows] for k in range(4)))

    def mark(self) -> tuple[Any, ...]:
        return super().mark(), len(self._recomputes), self._fsdp.mark() if self._fsdp is not None else None

    def drop_since(self, mark: tuple[Any, ...]) -> None:
        super().drop_since(mark[0])
        del self._recomputes[mark[1]:]
        if self._fsdp is not None:
            self._fsdp.drop_since(mark[2])


def _count_costs(timer: DynamoGraphs, captured: fx.GraphModule, example_inputs: list[Any]) -> None:
    """FLOPs and bytes of each row of a captured graph, into ``timer``'s row costs, in a meta-device pass (never in
    a timed step); the ops of one row add up. A graph whose pass fails leaves its rows without costs."""
    try:
        costs = count_costs(captured, tuple(example_inputs), timer.training)
    except Exception as error:  # the graph cannot go to the meta device: no FLOPs, timing goes on
        timer.costs_error = f"for a whole graph ({type(error).__name__}: {error})"
        return
    if costs.failed:
        timer.costs_error = f"for {costs.failed}"
    row = None
    for i, node in enumerate(n for n in captured.graph.nodes if is_timed(n)):
        if row is None or not node.meta.get(JOINS):
            row = timer.samples.rows_by_name.get((node.meta.get(ROW) or node_info(node)).name)
            if row is None:
                continue
            timer._row_costs[row] = [0, 0, 0, 0]
        totals = timer._row_costs[row]  # a row one of whose ops was not counted has None
        for k, (value, add) in enumerate(((costs.fwd_flops[i], True), (costs.bwd_flops[i], True),
                                          (costs.out_bytes[i], False), (costs.fwd_bytes[i], True))):
            if totals[k] is None or value is None:
                totals[k] = None
            else:  # out bytes: the row's output, its last op's
                totals[k] = totals[k] + value if add else value


def _meta_input(value: Any) -> Any:
    """A graph input for counting FLOPs on the meta device: a tensor of its size; a symbolic size (Dynamo made a
    dimension dynamic: Mask R-CNN's boxes per image) as the number it stood for at capture, so that the counts are
    plain numbers. A scalar (0-dim, no gradient) is kept as it is: the graph may read its value (a dropout rate
    that changed mid-run is passed as one, and read with ``.item()``). An input that is no leaf of autograd (an
    activation, in a graph after a break) is none in the count either: the graph may write into it in place."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return value.node.hint
    if isinstance(value, torch.Tensor) and not value.dim() and not value.requires_grad and value.device.type == "cpu":
        return value.detach().clone()
    if isinstance(value, torch.Tensor):
        shape = [s.node.hint if isinstance(s, torch.SymInt) else s for s in value.shape]
        tensor = torch.empty(shape, dtype=value.dtype, device="meta").requires_grad_(value.requires_grad)
        return tensor.clone() if value.requires_grad and not value.is_leaf else tensor
    return value
