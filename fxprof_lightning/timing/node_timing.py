"""Node-level forward and backward timing with torch.fx, knowing nothing of Lightning.

``NodeTimer`` builds an instrumented copy of a traced graph in which every node is
bracketed by a clock read (and, optionally, a ``torch.profiler.record_function`` range named
after the node), and lets ``GraphModule`` generate the Python code for it: no
``torch.fx.Interpreter`` dispatch in timed steps. On CPU the generated code only appends the
clock reads and autograd sequence numbers to two flat lists (``stamps.append(perf_counter_ns())``:
no Python function of ours runs per node); they become per-node samples after the call. ``install``/``uninstall`` swap that code in
as the module's ``forward`` and put the module's own forward back.

Backward: the autograd sequence number is read before and after each node, so the autograd
nodes a node created are those with sequence numbers in that range.

* On CPU the autograd nodes that run are timed in C++ by the profiler's callbacks for the
  backward scope alone (``BackwardEvents``, or the events of a torch.profiler that records
  the same steps): each event carries the sequence number of the node, and ``add_backward``
  adds its duration to the FX node whose range holds it. No Python runs per autograd node.
* On CUDA, for device time, a CUDA event is recorded as each node's backward starts (and on
  CPU a clock read, when profiler events cannot be had: ``install(..., backward_hooks=True)``). The
  engine runs the autograd nodes of one device in decreasing sequence-number order (its ready
  queue is a priority queue on it, and every node's consumers were created after it), so the
  autograd nodes of one FX node run one after the other, newest first. A pre-hook on the
  newest (the output's ``grad_fn``) marks where the node's backward begins; it ends at the
  next mark: the next node's start, the end of the first node's oldest autograd node (a
  hook), or the end of the backward pass (an engine callback). Hooks on autograd nodes touch
  no tensor and work with in-place ops; they die with the step's graph.

Clocks: on CPU, ``time.perf_counter_ns`` (host wall time). On CUDA, ``CudaClock``: events
recorded on the current stream around each node and at each backward mark, read after the
step (``resolve()``), with no synchronisation per node; plus the allocator's delta and peak.

The instrumented graph runs the same operations, in the same order, on the same
parameters and buffers as the module's own forward, so outputs, gradients and the use of
random numbers are unchanged.
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.nodes import JOINS, NESTS, is_timed
from fxprof_lightning.timing.autograd_walk import autograd_nodes, sequence_nr_now, tensors_in
from fxprof_lightning.timing.clocks import CudaClock, HostClock, cuda_allocated
from fxprof_lightning.timing.forward_swap import take_forward
from fxprof_lightning.timing.readings import Collected, Progress, Traits, cycle_collected
from fxprof_lightning.timing.samples import NodeSamples
from fxprof_lightning.timing.saved_memory import SavedReader

if TYPE_CHECKING:
    from fxprof_lightning.nodes import Capture

__all__ = ["ANCHOR", "GraphLog", "NodeTimer", "enter_range", "exit_range", "instrument"]

# Name prefix of the anchor ranges ``NodeTimer(trace_ranges=True)`` opens at the start and end of each forward call;
# numbered in threes, unique in the process (two timers' anchors may land in one trace).
ANCHOR = "fxprof_anchor#"
_anchor_numbers = itertools.count(step=3)


class NodeTimer:
    """Records each node's forward and backward time in the graphs it instruments (``instrument``): Dynamo's
    (``capture.dynamo_timing.DynamoGraphs``), or one graph traced by torch.fx (``fx_timer.FxNodeTimer``).

    It holds its samples (``samples``, a ``NodeSamples``) and the saved bytes it reads (``saved``, a ``SavedReader``).
    After ``reset()``: ``samples.fwd[i]`` holds one forward duration in nanoseconds per execution of
    ``samples.nodes[i]`` (a forward called twice in a step adds two); ``samples.bwd_ns(i)`` one backward duration per
    execution whose autograd nodes ran, after ``samples.resolve()`` (on CUDA it waits for the device once).

    Args:
        annotate: wrap each node in a ``record_function`` range named after it (10-15 us per node and
            call under torch.profiler, measured on a 2-core VM).
        trace_ranges: keep each node call's start (``range_spans``) and put three anchor ranges at
            the start and end of each forward call into a running profiler (``anchors``), so that
            ``torch_trace.add_node_ranges`` can write the node ranges into the exported trace afterwards,
            at no measurable cost per node at run time.
        backward: time the autograd nodes each node creates.
        device: ``"cuda"`` without ``trace_ranges``: device time from a CUDA event pair per node (the
            fallback when no profiler runs; each node's events are read after a sync) and the allocator's
            bytes per node. With ``trace_ranges`` a CUDA model is timed as on CPU (host clock, no event, no
            sync) and the device time per node comes from the trace's kernels afterwards (``gpu_trace``).

    Backward times come from profiler events given to ``add_backward`` on CPU (and on CUDA with
    ``trace_ranges``; see ``BackwardEvents``), and from hooks (``_hooked_record``) on CUDA without them or when
    installed with ``backward_hooks=True``.
    """

    def __init__(self, annotate: bool = False, backward: bool = True, device: str = "cpu", trace_ranges: bool = False) -> None:
        # CUDA events (a pair per node, read after a sync) only when no profiler trace gives device times:
        # with trace ranges the trace's kernels are tied to the node ranges afterwards (``gpu_trace``).
        self.on_cuda = device == "cuda"  # the model is on CUDA (its CUDA random state is kept with the rest)
        self._cuda = self.on_cuda and not trace_ranges
        self._clock = CudaClock if self._cuda else HostClock  # for hooked graphs
        self.samples = NodeSamples(self._cuda, self._clock)
        self.saved = SavedReader(self.samples)
        self._fwd = self.samples.durations  # the same lists, one attribute away for ``_hooked_record`` (once per node)
        self._backward = backward
        self._in_pass = False  # an engine callback will mark the end of the running backward pass
        self._first_of_call = False  # no node of the running forward call has created autograd nodes yet
        self._annotate = annotate
        self._hooks_now = False  # the installed forward times backward with hooks (no sequence ranges are logged)
        self._trace_ranges = trace_ranges and not self._cuda
        self._saved_forward: dict[int, Any] = {}  # id(module) -> ``forward_swap.put_forward``'s answer
        self._root: nn.Module | None = None  # the module installed on (for its own parameters and buffers)
        self.costs_error: str | None = None
        self.reset()

    @property
    def trace_ranges(self) -> bool:
        """Whether node starts and anchors are kept for ranges written into the trace afterwards (CPU)."""
        return self._trace_ranges

    @property
    def _sequences(self) -> bool:
        """Whether the generated code logs the autograd sequence range each node call created: for backward timing,
        and for the bytes saved for backward (``measure_memory``), which ``SavedReader`` gives to the rows by them."""
        return self._backward or self.measure_memory

    def reads_saved(self) -> bool:
        """Whether the timed forward call running (or just run) is the one whose saved bytes ``saved`` reads: the
        cycle's first on CPU, with grad, sequence ranges logged and no hooks timing backward."""
        return (self.measure_memory and self.saved.bytes is None and not self._cuda and not self._hooks_now
                and self._sequences and torch.is_grad_enabled())

    @property
    def uses_backward_events(self) -> bool:
        """Whether backward times come from ``add_backward`` (CPU) rather than hooks (CUDA) or nowhere."""
        return self._backward and not self._cuda

    # ``timers.Timer``: what the engine asks of every timer.
    measure_memory = False  # read what autograd saves for backward, once per cycle (``Timers`` sets it)
    interruptions = 0  # captures and untimed calls (Dynamo's timer counts them)
    interrupted_by = ""
    capture_s: list[float] = []  # noqa: RUF012 (never grown here; Dynamo's timer has its own)
    mismatch: str | None = None  # why the graph stopped fitting the calls (Dynamo's: refused)
    untimed: str | None = None  # why calls of the cycle ran untimed (Dynamo's guards), or None

    @property
    def traits(self) -> Traits:
        """Rows of its own (on CUDA their kernels' device time from the trace), backward times from events on CPU."""
        return Traits(self.uses_backward_events, reads_trace_events=False, device_times_from_trace=True,
                      without_events="come from hooks on the autograd nodes (slower)")

    @property
    def progress(self) -> Progress:
        return Progress(self.samples.calls, self.usable, self.untimed, self.interruptions, self.interrupted_by,
                        tuple(self.capture_s))

    def reset(self) -> None:
        """Forget every sample recorded so far."""
        self.samples.reset()
        self._in_pass = False

    def mark(self) -> Any:
        """Where the samples end now (``drop_since``): a subclass adds what it logs."""
        return self.samples.mark()

    def drop_since(self, mark: Any) -> None:
        self.samples.drop_since(mark)

    def save_point(self) -> Callable[[], None]:
        """A function that forgets the samples logged after this call (``mark`` and ``drop_since``)."""
        return functools.partial(self.drop_since, self.mark())

    def collected(self, backward: list[tuple[int, int]], trace_events: list[Any], training: bool) -> Collected | str:
        """The cycle's samples from its backward events, or why nothing was timed."""
        return cycle_collected(self, backward, trace_events, training, self.samples, self.saved.take)

    @property
    def usable(self) -> bool:
        """Whether the timer still times the calls (a graph that stopped fitting them times nothing)."""
        return self.mismatch is None

    def refusal(self, capture: Capture) -> str:
        """Why the graph was given up, for ``Capture.error`` (called when not ``usable``)."""
        return f"{capture.error}; the graph stopped fitting the calls: {self.mismatch}"

    def collect(self, backward: list[tuple[int, int]], trace_events: list[Any]) -> str | None:
        """Make the cycle's samples readable: backward events in, CUDA events resolved. Returns why nothing was
        timed, when the timer can tell (else None). Without backward timing the events are not read: the sequence
        ranges logged for the saved bytes would give them to the rows."""
        if self._backward:
            self.add_backward(backward)
        self.samples.resolve()
        return None

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        """Add each ``(sequence number, duration ns)`` to the node call whose autograd node it timed
        (``NodeSamples.add_backward``; a subclass moves some first)."""
        self.samples.add_backward(events)

    def node_ranges(self) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]], list[tuple[str, int, int]],
                                   list[int], dict[str, Any]] | None:
        """The anchors, node calls, their autograd sequence ranges, the starts of the forward calls and each node's
        module stack to write into the cycle's trace (``torch_trace.add_node_ranges``), when kept (``trace_ranges``)."""
        if not self.trace_ranges:
            return None
        samples = self.samples
        return (list(samples.anchors), samples.range_spans(), samples.backward_calls() if self.uses_backward_events else [],
                list(samples.call_starts), {info.name: info.module_stack for info in samples.nodes})

    def uninstall(self, module: nn.Module) -> None:
        """Give ``module`` its own forward back (safe to call when not installed)."""
        if id(module) in self._saved_forward:
            take_forward(module, self._saved_forward.pop(id(module)))

    # The generated forward calls these: keep them lean, they run once per node per call.

    def _root_attribute(self, name: str) -> Any:
        """A parameter of the module the graph runs as: the module's current one, as its own
        forward would read it (FSDP2 replaces the root's sharded parameters by unsharded ones in its
        pre-forward hook; the graph module's copies would be the sharded ones)."""
        return getattr(self._root, name)

    def _begin_call(self, log: GraphLog) -> tuple[list[int], list[int], list[nn.Module], Any]:
        """At the start of each call of a graph, before its first node: note where its log entries begin; the
        two logs, the modules the graph calls, and ``torch_api.AUTOGRAD`` (a local there: its
        ``sequence_nr`` is then one attribute away)."""
        self._first_of_call = True
        samples = self.samples
        samples.logged_calls.append((len(samples.stamps), len(samples.sequence_nrs), log))
        return samples.stamps, samples.sequence_nrs, log.called, torch_api.AUTOGRAD

    def _inputs(self, *args: Any) -> None:
        if self.samples.forward_inputs is None:
            self.samples.forward_inputs = args

    def _anchor(self) -> None:
        """At the start and the end of each forward call, with ``trace_ranges`` and a profiler running: three
        empty ranges named ``fxprof_anchor#N``, each between two clock reads, which tie ``perf_counter_ns`` to
        the profiler's clock (``torch_trace.add_node_ranges``).

        torch's ``_RecordFunctionFast`` opens and closes one in about 1 us (``record_function``: 3-7 us), so
        the two reads bound the range's place on the profiler's clock to about 1 us."""
        if not torch_api.profiler_enabled():
            return
        number = next(_anchor_numbers)
        first, second, third = (_fast_range(f"{ANCHOR}{n}") for n in (number, number + 1, number + 2))
        # Three in a row: the first often meets cold caches (a wide window), the later ones rarely do.
        before = time.perf_counter_ns()
        with first:
            pass
        middle = time.perf_counter_ns()
        with second:
            pass
        last = time.perf_counter_ns()
        with third:
            pass
        self.samples.anchors += ((number, before, middle), (number + 1, middle, last), (number + 2, last, time.perf_counter_ns()))

    def _hooked_record(self, index: int, start: Any, sequence_nr: int, output: Any) -> int:
        self._fwd[index].append(self._clock.stop(start))
        end = sequence_nr_now()
        if self._backward and sequence_nr != end:
            self._mark_backward(index, sequence_nr, end, output)
        return end

    def _mark_backward(self, index: int, first: int, end: int, output: Any) -> None:
        """Hook the newest autograd node the node created (and, for a call's first such node, its oldest)."""
        newest = None
        for tensor in (output,) if isinstance(output, torch.Tensor) else tensors_in(output):
            fn = tensor.grad_fn
            if fn is not None and torch_api.node_sequence_nr(fn) >= first and (newest is None or torch_api.node_sequence_nr(fn) > torch_api.node_sequence_nr(newest)):
                newest = fn
        if newest is None:
            return
        durations: list[Any] = []
        self.samples.spans[index].append(durations)
        newest.register_prehook(functools.partial(self._begin, durations))
        if self._first_of_call:  # created first, so run last: the model's backward ends with it
            self._first_of_call = False
            min(autograd_nodes([newest], first, end), key=lambda fn: torch_api.node_sequence_nr(fn)).register_hook(self._end)

    def _begin(self, durations: list[Any], grad_outputs: Any) -> None:
        self.samples.marks.append((durations, self._clock.start()))
        if not self._in_pass:
            self._in_pass = True
            torch_api.queue_callback(self._end_of_pass)

    def _end(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.samples.marks.append((None, self._clock.start()))

    def _end_of_pass(self) -> None:
        self._in_pass = False
        self.samples.marks.append((None, self._clock.start()))

    def _instrument(self, traced: fx.GraphModule, annotate: bool, hooked: bool) -> fx.GraphModule:
        """The instrumented graph (``instrument``); ``hooked``: backward timed by hooks, else by events."""
        return instrument(self, traced, annotate, hooked)


def _fast_range(name: str) -> Any:
    """A context manager that makes a profiler range: torch's lean one where it exists."""
    fast = torch_api.RecordFunctionFast
    return fast(name) if fast is not None else torch.profiler.record_function(name)


# The code generator of node timing: an instrumented copy of a graph whose generated code logs each timed node's clock
# reads and autograd sequence numbers into its ``NodeTimer``, and the profiler ranges it may open around nodes.

def instrument(self: NodeTimer, traced: fx.GraphModule, annotate: bool, hooked: bool) -> fx.GraphModule:
    """``NodeTimer``'s code generator: a copy of ``traced`` that logs into the timer ``self``; ``hooked``: backward
    timed by hooks (``_hooked_record``), else by events.

    Unhooked (CPU), each timed node becomes, in the generated code::

        stamps.append(perf_counter_ns()); out = node(...); stamps.append(perf_counter_ns())
        sequence_nrs.append(autograd.sequence_nr())   # with backward timing or saved bytes

    (the two lists are those ``_begin_call`` returns at the start of the call), and ``NodeSamples.fold`` makes samples
    of them.
    A node marked ``joins_previous`` (``JOINS``) is timed together with the timed node before it: one row, one
    pair of clock reads around both (the ops of one ``torch.nn`` layer in a Dynamo graph). A row is shared by
    every graph that has a node of its name. After a node marked ``NESTS`` (it runs an instrumented graph, whose
    call logs its own entries in between) the call goes on in a log of the rows still to come (``GraphLog.resume``).
    """
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    timed = [n for n in traced.graph.nodes if is_timed(n) and not _own_state_of_root(traced, n)]
    closes = {a for a, b in itertools.pairwise(timed) if not b.meta.get(JOINS)} | set(timed[-1:])
    log = GraphLog(self)
    open_logs = [log]  # the graph's log and those that go on with its call after a nested graph's
    index = -1
    graph.set_codegen(copy.deepcopy(traced.graph._codegen))  # keep how inputs are passed (e.g. pytree codegen)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    logs: Any = None  # (stamps, sequence_nrs, modules, autograd) of the running call
    sequence_nr: Any = None  # hooked: the sequence number after the last timed node, if there was one
    lean = not hooked
    # Each bound method read once: torch 2.6's code generation asks that a name's object be the same object each time.
    anchor, inputs, root_attribute, clock_start = self._anchor, self._inputs, self._root_attribute, self._clock.start
    hooked_record, record_cuda_memory = self._hooked_record, self.samples.record_cuda_memory
    for node in traced.graph.nodes:
        if node.op == "output" and index >= 0 and self._trace_ranges and lean:
            graph.call_function(anchor)
        if node.op != "placeholder" and logs is None:
            logs = graph.call_function(log.begin)
            stamps, sequence_nrs, modules, autograd = (graph.call_function(operator.getitem, (logs, i)) for i in range(4))
        if node.op != "placeholder" and placeholders and all(n in copies for n in placeholders):
            graph.call_function(inputs, tuple(copies[n] for n in placeholders))  # once all inputs exist
            placeholders = []
        if _own_state_of_root(traced, node):  # read from the module it runs as (FSDP2 swaps parameters)
            copies[node] = graph.call_function(root_attribute, (node.target,))
            continue
        if not is_timed(node):
            copies[node] = graph.node_copy(node, copies.__getitem__)
            if node.meta.get(NESTS):
                open_logs.append(resumed := GraphLog(self))
                graph.call_function(resumed.resume)  # hooked too: ``calls`` counts the same entries either way
                if lean and self._sequences and index >= 0:  # (before any timed node, the first one logs its own)
                    graph.call_method("append", (sequence_nrs, graph.call_method("sequence_nr", (autograd,))))
                sequence_nr = None  # hooked: read again after the nested graph's autograd nodes
            continue
        opens = index < 0 or not node.meta.get(JOINS)
        if opens:
            index += 1
            row = self.samples.row(node)
            for each in open_logs:
                each.add(row)
        if index == 0 and opens and self._trace_ranges and lean:
            graph.call_function(anchor)
        callee = _callee(graph, node, traced, modules, log.called)
        if annotate and opens:
            annotation = graph.call_function(enter_range, (self.samples.nodes[row].name,))
        if lean:
            if index == 0 and opens and self._sequences:
                graph.call_method("append", (sequence_nrs, graph.call_method("sequence_nr", (autograd,))))
            if opens:
                graph.call_method("append", (stamps, graph.call_function(time.perf_counter_ns)))
            copies[node] = _copy_node(graph, node, copies, callee)
            if node in closes:
                graph.call_method("append", (stamps, graph.call_function(time.perf_counter_ns)))
                if self._sequences:
                    graph.call_method("append", (sequence_nrs, graph.call_method("sequence_nr", (autograd,))))
        else:
            if opens:
                if self._cuda:
                    allocated = graph.call_function(cuda_allocated)
                if sequence_nr is None:
                    sequence_nr = graph.call_function(sequence_nr_now) if self._backward else -1
                start = graph.call_function(clock_start)
            copies[node] = copied = _copy_node(graph, node, copies, callee)
            if node in closes:
                sequence_nr = graph.call_function(hooked_record, (row, start, sequence_nr, copied))
                if self._cuda:
                    graph.call_function(record_cuda_memory, (row, allocated))
        if annotate and node in closes:
            graph.call_function(exit_range, (annotation,))
    return fx.GraphModule(traced, graph, class_name=f"{type(traced).__name__}Timed")


class GraphLog:
    """What the generated code of one instrumented graph logs into: its rows (in the order its timed spans run),
    their sample lists, and the modules it calls."""

    def __init__(self, timer: NodeTimer) -> None:
        self.timer = timer
        self.samples = timer.samples
        self.rows: list[int] = []
        self.fwd: list[list[Any]] = []
        self.starts: list[list[int]] = []
        self.called: list[nn.Module] = []  # the modules the graph calls, in order (``_callee``)

    def add(self, row: int) -> None:
        self.rows.append(row)
        self.fwd.append(self.samples.durations[row])
        self.starts.append(self.samples.starts[row])

    def begin(self) -> tuple[list[int], list[int], list[nn.Module], Any]:
        return self.timer._begin_call(self)

    def resume(self) -> None:
        """Go on with the running call in this log (its rows: those after a nested graph's call)."""
        samples = self.samples
        samples.logged_calls.append((len(samples.stamps), len(samples.sequence_nrs), self))


def _own_state_of_root(traced: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a node reads a parameter held by the root module itself (not by a submodule).

    Buffers stay the graph module's: tensor constants of the trace are buffers there, not on the root.
    """
    return node.op == "get_attr" and "." not in node.target and node.target in traced._parameters


def _callee(graph: fx.Graph, node: fx.Node, traced: fx.GraphModule, modules: fx.Node, called: list[nn.Module]) -> fx.Node | None:
    """For a ``call_module`` node, the module object, read from ``called`` (the list the generated code has
    as ``modules``, see ``_begin_call``); None for other nodes.

    The generated code then calls the module without looking it up through attribute chains
    (``getattr(self.layers, "0")``: two ``Module.__getattr__`` calls per node in a ModuleList).
    """
    if node.op != "call_module":
        return None
    called.append(traced.get_submodule(node.target))
    return graph.call_function(operator.getitem, (modules, len(called) - 1))


def _copy_node(graph: fx.Graph, node: fx.Node, copies: dict[fx.Node, fx.Node], callee: fx.Node | None) -> fx.Node:
    """The node in ``graph``; a module call becomes a call of ``callee``, its module (``_callee``)."""
    if callee is None:
        return graph.node_copy(node, copies.__getitem__)
    args, kwargs = fx.map_arg((node.args, node.kwargs), copies.__getitem__)
    copied = graph.call_method("__call__", (callee, *args), kwargs)
    copied.meta = copy.copy(node.meta)
    return copied


def enter_range(name: str) -> torch.profiler.record_function:
    annotation = torch.profiler.record_function(name)
    annotation.__enter__()
    return annotation


def exit_range(annotation: torch.profiler.record_function) -> None:
    annotation.__exit__(None, None, None)
