"""The code generator of node timing: an instrumented copy of a graph whose generated code logs each timed node's
clock reads and autograd sequence numbers into a ``NodeTimer``, and the profiler ranges it may open around nodes."""

from __future__ import annotations

import copy
import itertools
import operator
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from fxprof_lightning.nodes import JOINS, NESTS, is_timed
from fxprof_lightning.timing.autograd_walk import sequence_nr_now
from fxprof_lightning.timing.clocks import cuda_allocated

if TYPE_CHECKING:
    from fxprof_lightning.timing.node_timing import NodeTimer

__all__ = ["GraphLog", "enter_range", "exit_range", "instrument"]


def instrument(self: NodeTimer, traced: fx.GraphModule, annotate: bool, hooked: bool) -> fx.GraphModule:
    """``NodeTimer``'s code generator: a copy of ``traced`` that logs into the timer ``self``; ``hooked``: backward
    timed by hooks (``_hooked_record``), else by events.

    Unhooked (CPU), each timed node becomes, in the generated code::

        stamps.append(perf_counter_ns()); out = node(...); stamps.append(perf_counter_ns())
        sequence_nrs.append(autograd.sequence_nr())   # with backward timing or saved bytes

    (the two lists are those ``_begin_call`` returns at the start of the call), and ``_fold`` makes samples of them.
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
    hooked_record, record_cuda_memory = self._hooked_record, self._record_cuda_memory
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
            row = self._row(node)
            for each in open_logs:
                each.add(row)
        if index == 0 and opens and self._trace_ranges and lean:
            graph.call_function(anchor)
        callee = _callee(graph, node, traced, modules, log.called)
        if annotate and opens:
            annotation = graph.call_function(enter_range, (self.nodes[row].name,))
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
        self.rows: list[int] = []
        self.fwd: list[list[Any]] = []
        self.starts: list[list[int]] = []
        self.called: list[nn.Module] = []  # the modules the graph calls, in order (``_callee``)

    def add(self, row: int) -> None:
        self.rows.append(row)
        self.fwd.append(self.timer._fwd[row])
        self.starts.append(self.timer._starts[row])

    def begin(self) -> tuple[list[int], list[int], list[nn.Module], Any]:
        return self.timer._begin_call(self)

    def resume(self) -> None:
        """Go on with the running call in this log (its rows: those after a nested graph's call)."""
        self.timer._calls.append((len(self.timer._stamps), len(self.timer._sequence_nrs), self))


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
