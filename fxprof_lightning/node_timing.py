"""Node-level forward timing with torch.fx, knowing nothing of Lightning.

``trace_module`` turns a module into a ``GraphModule`` once. ``NodeTimer`` builds an
instrumented copy of that graph in which every node is bracketed by a monotonic
nanosecond clock read (and, optionally, a ``torch.profiler.record_function`` range named
after the node), and lets ``GraphModule`` generate the Python code for it: no
``torch.fx.Interpreter`` dispatch in timed steps. ``install``/``uninstall`` swap that code
in as the module's ``forward`` and put the module's own forward back.

The instrumented graph runs the same operations, in the same order, on the same
parameters and buffers as the module's own forward, so outputs, gradients and the use of
random numbers are unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = ["NodeInfo", "NodeTimer", "TraceError", "trace_module"]

# Node kinds that run code worth timing; placeholders, get_attr and output only move references.
TIMED_OPS = ("call_module", "call_function", "call_method")


class TraceError(RuntimeError):
    """``torch.fx`` could not trace the module."""


@dataclass(frozen=True)
class NodeInfo:
    """What a timed FX node is: its name, kind, target and the module it belongs to."""

    name: str
    op: str
    target: str
    module_path: str


def trace_module(module: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with an error that names the module and the cause.

    Raises:
        TraceError: the module cannot be traced (data-dependent control flow, ...).
    """
    try:
        return fx.symbolic_trace(module)
    except Exception as error:  # tracing user code can fail in any way
        raise TraceError(
            f"torch.fx could not trace {type(module).__name__}: {type(error).__name__}: {error}"
        ) from error


def describe_target(node: fx.Node) -> str:
    """A readable target: ``layer1.0.conv1``, ``torch.flatten``, ``operator.add``, ``view``."""
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    if module in ("_operator", "builtins"):
        module = "operator" if module == "_operator" else ""
    elif module.startswith("torch._C._nn") or module == "torch.nn.functional":
        module = "torch.nn.functional"
    elif module.startswith("torch._C") or (module.startswith("torch") and hasattr(torch, name)):
        module = "torch"
    return f"{module}.{name}" if module else name


def owning_module_path(node: fx.Node) -> str:
    """Qualified name of the module a node belongs to ('' for the traced module itself)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _module_type = list(stack.values())[-1]
        return str(path)
    return ""


class NodeTimer:
    """An instrumented copy of a traced module that records each node's wall time.

    ``samples[i]`` holds one duration in nanoseconds per execution of node ``nodes[i]``
    since the last ``reset()``; a forward called twice in a step adds two samples.

    Example:
        >>> timer = NodeTimer(trace_module(model))
        >>> timer.install(model); model(x); timer.uninstall(model)
        >>> timer.nodes[0].name, timer.samples[0]
    """

    def __init__(self, traced: fx.GraphModule, annotate: bool = False) -> None:
        self.nodes: list[NodeInfo] = []
        self.samples: list[list[int]] = []
        self.graph_module = self._instrument(traced, annotate)
        self._saved_forward: dict[int, Any] = {}

    def reset(self) -> None:
        """Forget every sample recorded so far."""
        self.samples = [[] for _ in self.nodes]

    def install(self, module: nn.Module) -> None:
        """Make ``module(...)`` run the instrumented graph until ``uninstall``."""
        if id(module) in self._saved_forward:
            return
        self._saved_forward[id(module)] = module.__dict__.get("forward")
        module.forward = self.graph_module.forward

    def uninstall(self, module: nn.Module) -> None:
        """Give ``module`` its own forward back (safe to call when not installed)."""
        if id(module) not in self._saved_forward:
            return
        previous = self._saved_forward.pop(id(module))
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous

    def _record(self, index: int, start_ns: int) -> None:
        self.samples[index].append(time.perf_counter_ns() - start_ns)

    def _instrument(self, traced: fx.GraphModule, annotate: bool) -> fx.GraphModule:
        graph = fx.Graph()
        copies: dict[fx.Node, fx.Node] = {}
        for node in traced.graph.nodes:
            if node.op not in TIMED_OPS:
                copies[node] = graph.node_copy(node, copies.__getitem__)
                continue
            index = len(self.nodes)
            self.nodes.append(NodeInfo(node.name, node.op, describe_target(node), owning_module_path(node)))
            if annotate:
                annotation = graph.call_function(_enter_range, (node.name,))
            start = graph.call_function(time.perf_counter_ns)
            copies[node] = graph.node_copy(node, copies.__getitem__)
            graph.call_function(self._record, (index, start))
            if annotate:
                graph.call_function(_exit_range, (annotation,))
        self.reset()
        return fx.GraphModule(traced, graph, class_name=f"{type(traced).__name__}Timed")


def _enter_range(name: str) -> torch.profiler.record_function:
    annotation = torch.profiler.record_function(name)
    annotation.__enter__()
    return annotation


def _exit_range(annotation: torch.profiler.record_function) -> None:
    annotation.__exit__(None, None, None)
