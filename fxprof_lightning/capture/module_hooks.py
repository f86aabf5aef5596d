"""Module-level timing with hooks, where the Dynamo capture cannot be used.

``ModuleHookTimer`` has the interface of ``NodeSamples`` (``nodes``, ``fwd``, ``bwd_ns``,
``reset``, ``add_backward``, ``resolve``) and of a timer (``install``, ``uninstall``), with one "node" per
module: its *self* time (its inclusive time less that of its child modules), so nodes add up
without double counting. Forward pre/post hooks are registered by ``install`` and removed by
``uninstall``: nothing stays on the model between recorded steps. Backward: each module call
notes the autograd sequence numbers it consumed; ``add_backward`` gives each profiler event
(see ``backward_events.BackwardEvents``) to the innermost module call whose range holds it, which
is the module's self backward time. A forward run inside a backward pass (the recomputation
of activation checkpointing) is not counted: its work is part of the backward node that runs it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from fxprof_lightning import torch_api
from fxprof_lightning.nodes import NodeInfo, module_stack
from fxprof_lightning.timing.autograd_walk import sequence_nr_now
from fxprof_lightning.timing.node_timing import enter_range, exit_range
from fxprof_lightning.timing.readings import Uninterrupted

if TYPE_CHECKING:
    from fxprof_lightning.nodes import Capture

__all__ = ["ModuleHookTimer"]


class ModuleHookTimer(Uninterrupted):
    """Self forward and backward time of every module of ``root``, measured with hooks (host time).

    With ``annotate``, each module call is also a ``record_function`` range named after the module.
    """

    uses_backward_events = True  # backward times come from add_backward
    # ``timers.Timer``:
    mismatch = None
    untimed = None
    usable = True
    costs_error = None
    reads_trace_events = False
    device_times_from_trace = False  # host time per module (no node ranges for the trace's kernels)
    without_events = "are missing (module hooks take them from profiler events)"

    def __init__(self, root: nn.Module, annotate: bool = False) -> None:
        self._annotate = annotate
        self.nodes: list[NodeInfo] = []
        self._index: dict[int, int] = {}
        for path, module in root.named_modules():
            stack = module_stack(path)
            self._index[id(module)] = len(self.nodes)
            self.nodes.append(NodeInfo(path or "(root)", "module", type(module).__name__, path, stack))
        self._modules = [m for _, m in root.named_modules()]
        self._handles: list[RemovableHandle] = []
        self._open: list[list[Any]] = []  # per running module: [index, start ns, child ns, sequence nr, range]
        self.forward_inputs = None  # FLOPs are counted for traced graphs only
        self.reset()

    def reset(self) -> None:
        self.fwd: list[list[int]] = [[] for _ in self.nodes]
        self.bwd: list[list[int]] = [[] for _ in self.nodes]
        self.mem_delta: list[list[int]] = [[] for _ in self.nodes]  # CUDA allocator stats: NodeTimer only
        self.mem_peak: list[list[int]] = [[] for _ in self.nodes]
        self._calls: list[tuple[int, int, int, int]] = []  # per module call that made autograd nodes: first, end, depth, index
        self._totals: dict[tuple[int, int, int, int], int] = {}  # backward ns per call, from add_backward
        self._open = []
        self.backward_outside_ns = 0  # backward events that no module call's autograd nodes account for
        self.forward_walls_ns: list[int] = []  # (the rows are the module calls: nothing lies between them)

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        """Add each ``(sequence number, duration ns)`` to the innermost module call whose range holds it.

        Durations add up over calls of ``add_backward``: give each event once.
        """
        calls = sorted(self._calls, key=lambda c: (c[0], -c[1], c[2]))  # a call before the calls nested in it
        parents: list[int] = []
        open_calls: list[int] = []
        for i, (first, _end, _depth, _index) in enumerate(calls):
            while open_calls and calls[open_calls[-1]][1] <= first:
                open_calls.pop()
            parents.append(open_calls[-1] if open_calls else -1)
            open_calls.append(i)
        firsts = [c[0] for c in calls]
        totals = [0] * len(calls)
        for sequence_nr, duration in events:
            i = bisect.bisect_right(firsts, sequence_nr) - 1
            while i >= 0 and sequence_nr >= calls[i][1]:
                i = parents[i]
            if i >= 0:
                totals[i] += duration
            else:
                self.backward_outside_ns += duration
        for call, total in zip(calls, totals, strict=True):
            self._totals[call] = self._totals.get(call, 0) + total
        self.bwd = [[] for _ in self.nodes]
        for call in self._calls:
            if self._totals.get(call):
                self.bwd[call[3]].append(self._totals[call])

    @property
    def calls(self) -> int:
        """Module calls timed since ``reset`` (grows when the module runs)."""
        return sum(len(samples) for samples in self.fwd)

    def collect(self, backward: list[tuple[int, int]], trace_events: list[Any]) -> str | None:
        self.add_backward(backward)
        return None

    def node_ranges(self) -> None:
        """Nothing to write into the trace afterwards: with ``annotate`` each module call opened its own range."""

    def costs(self, training: bool) -> None:
        """FLOPs are counted for graphs only."""

    def describe(self, capture: Capture) -> Capture:
        return replace(capture)

    def refusal(self, capture: Capture) -> str:
        return capture.error

    def resolve(self) -> None:
        """Host time needs no conversion."""

    def bwd_ns(self, index: int) -> list[int]:
        return self.bwd[index]

    def install(self, module: nn.Module, backward_hooks: bool = False) -> None:
        """Register the hooks (``backward_hooks``: accepted for NodeTimer's interface; backward needs events)."""
        if self._handles:
            return
        for m in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def uninstall(self, module: nn.Module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open = []

    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch_api.current_graph_task_id() != -1:  # recomputed inside backward (activation checkpointing)
            return
        index = self._index[id(module)]
        annotation = enter_range(self.nodes[index].name) if self._annotate else None
        self._open.append([index, time.perf_counter_ns(), 0, sequence_nr_now(), annotation])

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._open or torch_api.current_graph_task_id() != -1:
            return
        index, start, children, sequence_nr, annotation = self._open.pop()
        elapsed = time.perf_counter_ns() - start
        if annotation is not None:
            exit_range(annotation)
        self.fwd[index].append(elapsed - children)
        if self._open:
            self._open[-1][2] += elapsed
        end = sequence_nr_now()
        if end != sequence_nr:
            self._calls.append((sequence_nr, end, len(self._open), index))
