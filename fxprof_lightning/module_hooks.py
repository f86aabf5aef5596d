"""Module-level timing with hooks, for modules torch.fx cannot trace at all.

``ModuleHookTimer`` has the interface of ``NodeTimer`` (``nodes``, ``fwd``, ``bwd_ns``,
``reset``, ``resolve``, ``install``, ``uninstall``), with one "node" per module: its *self*
time (its inclusive time less that of its child modules), so nodes add up without double
counting. Forward pre/post hooks are registered by ``install`` and removed by ``uninstall``:
nothing stays on the model between recorded steps. Backward: the autograd nodes a module
created and no child module claimed are timed with hooks on those autograd nodes.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from fxprof_lightning.node_timing import (
    BackwardSpan,
    NodeInfo,
    enter_range,
    exit_range,
    hook_autograd_nodes,
    sequence_nr_now,
)

__all__ = ["ModuleHookTimer"]


class ModuleHookTimer:
    """Self forward and backward time of every module of ``root``, measured with hooks (host time).

    With ``annotate``, each module call is also a ``record_function`` range named after the module.
    """

    def __init__(self, root: nn.Module, annotate: bool = False) -> None:
        self._annotate = annotate
        self.nodes: list[NodeInfo] = []
        self._index: dict[int, int] = {}
        for path, module in root.named_modules():
            stack = tuple(".".join(path.split(".")[: i + 1]) for i in range(len(path.split(".")))) if path else ()
            self._index[id(module)] = len(self.nodes)
            self.nodes.append(NodeInfo(path or "(root)", "module", type(module).__name__, path, stack))
        self._modules = [m for _, m in root.named_modules()]
        self._handles: list[RemovableHandle] = []
        self._open: list[list[Any]] = []  # per running module: [index, start ns, child ns, sequence nr, range]
        self.forward_inputs = None  # FLOPs are counted for traced graphs only
        self.reset()

    def reset(self) -> None:
        self.fwd: list[list[int]] = [[] for _ in self.nodes]
        self.bwd: list[list[BackwardSpan]] = [[] for _ in self.nodes]
        self.mem_delta: list[list[int]] = [[] for _ in self.nodes]  # CUDA allocator stats: NodeTimer only
        self.mem_peak: list[list[int]] = [[] for _ in self.nodes]
        self._claimed: set[Any] = set()
        self._open = []

    uses_backward_events = False  # backward is timed with hooks on the autograd nodes

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        """Backward times come from hooks here: profiler events are not needed."""

    def resolve(self) -> None:
        """Host time needs no conversion."""

    def bwd_ns(self, index: int) -> list[int]:
        return [sum(span.samples) for span in self.bwd[index] if span.samples]

    def install(self, module: nn.Module) -> None:
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
        self._claimed = set()  # hold no autograd node past the step

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not self._open:
            self._claimed = set()  # a new forward of the root: autograd nodes of the last one are gone
        index = self._index[id(module)]
        annotation = enter_range(self.nodes[index].name) if self._annotate else None
        self._open.append([index, time.perf_counter_ns(), 0, sequence_nr_now(), annotation])

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._open:
            return
        index, start, children, sequence_nr, annotation = self._open.pop()
        elapsed = time.perf_counter_ns() - start
        if annotation is not None:
            exit_range(annotation)
        self.fwd[index].append(elapsed - children)
        if self._open:
            self._open[-1][2] += elapsed
        if sequence_nr != sequence_nr_now():
            span = BackwardSpan(None)
            self.bwd[index].append(span)
            hook_autograd_nodes(output, sequence_nr, span, self._claimed)
