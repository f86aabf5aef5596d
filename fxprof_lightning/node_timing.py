"""Node-level forward and backward timing with torch.fx, knowing nothing of Lightning.

``NodeTimer`` builds an instrumented copy of a traced graph in which every node is
bracketed by a clock read (and, optionally, a ``torch.profiler.record_function`` range named
after the node), and lets ``GraphModule`` generate the Python code for it: no
``torch.fx.Interpreter`` dispatch in timed steps. ``install``/``uninstall`` swap that code in
as the module's ``forward`` and put the module's own forward back.

Backward: the autograd sequence number is read before and after each node; the autograd
nodes the node created (sequence numbers in that range, reachable from its outputs) get a
pre-hook and a hook that time their execution. Hooks on autograd nodes touch no tensor and
work with in-place ops; they die with the step's autograd graph.

Clocks: on CPU, ``time.perf_counter_ns`` (host wall time). On CUDA, ``CudaClock``: events
recorded on the current stream around each node and autograd node, read after the step
(``resolve()``), with no synchronisation per node; plus the allocator's delta and peak.

The instrumented graph runs the same operations, in the same order, on the same
parameters and buffers as the module's own forward, so outputs, gradients and the use of
random numbers are unchanged.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = ["BackwardSpan", "CudaClock", "NodeInfo", "NodeTimer", "describe_target", "enter_range", "exit_range", "hook_autograd_nodes", "is_timed", "tensors_in"]

# Node kinds that run code worth timing; placeholders, get_attr and output only move references.
TIMED_OPS = ("call_module", "call_function", "call_method")
# Functions a capture puts into a graph that are bookkeeping, not the model's work (e.g. guards).
UNTIMED_TARGETS: set[Any] = set()


def is_timed(node: fx.Node) -> bool:
    """Whether a node runs the model's code (and gets a row, a clock and FLOPs)."""
    return node.op in TIMED_OPS and node.target not in UNTIMED_TARGETS

sequence_nr_now = torch.autograd._get_sequence_nr


@dataclass(frozen=True)
class NodeInfo:
    """What a timed node is: its name, kind, target, and the modules it is inside.

    ``module_stack`` lists the module calls the node runs inside, outermost first (the node's
    own module last for ``call_module``), each as ``path`` or ``path@N`` for the N-th extra
    call of a module used several times; ``module_path`` is the innermost path.
    """

    name: str
    op: str
    target: str
    module_path: str
    module_stack: tuple[str, ...] = ()


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


def node_info(node: fx.Node) -> NodeInfo:
    # nn_module_stack keys are "path", or "path@N" for the N-th extra call of a shared module.
    entries = (node.meta.get("nn_module_stack") or {}).items()
    stack = tuple(key if key.split("@")[0] == path else path for key, (path, _type) in entries)
    if node.op == "call_module" and (not stack or stack[-1].split("@")[0] != node.target):
        stack = (*stack, str(node.target))
    return NodeInfo(node.name, node.op, describe_target(node), stack[-1].split("@")[0] if stack else "", stack)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple/list/dict output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


class CudaClock:
    """Device time: a CUDA event pair per span on the current stream, converted after the step."""

    @staticmethod
    def start() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def stop(start: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return start, CudaClock.start()

    @staticmethod
    def resolve(sample: Any) -> int:
        if isinstance(sample, int):
            return sample
        start, end = sample
        end.synchronize()
        return int(start.elapsed_time(end) * 1e6)


class BackwardSpan:
    """Backward time of one forward call of one node: the sum over the autograd nodes it created."""

    __slots__ = ("_start", "clock", "samples")

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.samples: list[Any] = []  # one duration (or CUDA event pair) per autograd node run
        self._start: Any = None

    def pre(self, grad_outputs: Any) -> None:
        self._start = self.clock.start() if self.clock else time.perf_counter_ns()

    def post(self, grad_inputs: Any, grad_outputs: Any) -> None:
        start, self._start = self._start, None
        if start is not None:
            self.samples.append(self.clock.stop(start) if self.clock else time.perf_counter_ns() - start)


class NodeTimer:
    """An instrumented copy of a traced module that records each node's forward and backward time.

    After ``reset()``: ``fwd[i]`` holds one forward duration in nanoseconds per execution of
    ``nodes[i]`` (a forward called twice in a step adds two), ``bwd[i]`` one backward span
    per execution that created autograd nodes. Call ``resolve()`` before reading durations
    (needed on CUDA, free on CPU); ``bwd_ns(i)`` gives the backward durations.

    Args:
        traced: the ``GraphModule`` from ``symbolic_trace`` (or the capture ladder).
        annotate: wrap each node in a ``record_function`` range named after it.
        backward: time the autograd nodes each node creates.
        device: ``"cuda"`` for device time from CUDA events, anything else for host time.

    Example:
        >>> timer = NodeTimer(fx.symbolic_trace(model))
        >>> timer.install(model); model(x).sum().backward(); timer.uninstall(model)
        >>> timer.nodes[0].name, timer.fwd[0], timer.bwd_ns(0)
    """

    def __init__(self, traced: fx.GraphModule, annotate: bool = False, backward: bool = True, device: str = "cpu") -> None:
        self.nodes: list[NodeInfo] = []
        self.fwd: list[list[Any]] = []
        self.bwd: list[list[BackwardSpan]] = []
        self.mem_delta: list[list[int]] = []
        self.mem_peak: list[list[int]] = []
        self.forward_inputs: tuple[Any, ...] | None = None  # the first call's inputs after reset (for FLOP counting)
        self._clock = CudaClock if device == "cuda" else None
        self._backward = backward
        self.graph_module = self._instrument(traced, annotate)
        self._saved_forward: dict[int, Any] = {}

    def reset(self) -> None:
        """Forget every sample recorded so far."""
        self.fwd = [[] for _ in self.nodes]
        self.bwd = [[] for _ in self.nodes]
        self.mem_delta = [[] for _ in self.nodes]
        self.mem_peak = [[] for _ in self.nodes]
        self.forward_inputs = None

    def resolve(self) -> None:
        """Turn pending CUDA event pairs into nanoseconds (waits for the device once)."""
        if self._clock is None:
            return
        self.fwd = [[CudaClock.resolve(s) for s in samples] for samples in self.fwd]
        for spans in self.bwd:
            for span in spans:
                span.samples = [CudaClock.resolve(s) for s in span.samples]

    def bwd_ns(self, index: int) -> list[int]:
        """Backward duration of each forward call of node ``index`` whose backward ran."""
        return [sum(span.samples) for span in self.bwd[index] if span.samples]

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

    # The generated forward calls these: keep them lean, they run once per node per call.

    def _inputs(self, *args: Any) -> None:
        if self.forward_inputs is None:
            self.forward_inputs = args

    def _record(self, index: int, start: Any, sequence_nr: int, output: Any) -> None:
        self.fwd[index].append(self._clock.stop(start) if self._clock else time.perf_counter_ns() - start)
        if self._backward and sequence_nr != sequence_nr_now():
            span = BackwardSpan(self._clock)
            self.bwd[index].append(span)
            hook_autograd_nodes(output, sequence_nr, span)

    def _record_cuda_memory(self, index: int, allocated_before: int) -> None:
        self.mem_delta[index].append(torch.cuda.memory_allocated() - allocated_before)
        self.mem_peak[index].append(torch.cuda.max_memory_allocated() - allocated_before)

    def _instrument(self, traced: fx.GraphModule, annotate: bool) -> fx.GraphModule:
        graph = fx.Graph()
        copies: dict[fx.Node, fx.Node] = {}
        start_clock = self._clock.start if self._clock else time.perf_counter_ns
        graph.set_codegen(copy.deepcopy(traced.graph._codegen))  # keep how inputs are passed (e.g. pytree codegen)
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        for node in traced.graph.nodes:
            if node.op != "placeholder" and placeholders and all(n in copies for n in placeholders):
                graph.call_function(self._inputs, tuple(copies[n] for n in placeholders))  # once all inputs exist
                placeholders = []
            if not is_timed(node):
                copies[node] = graph.node_copy(node, copies.__getitem__)
                continue
            index = len(self.nodes)
            self.nodes.append(node_info(node))
            if annotate:
                annotation = graph.call_function(enter_range, (node.name,))
            if self._clock:
                allocated = graph.call_function(_cuda_allocated_and_reset_peak)
            sequence_nr = graph.call_function(sequence_nr_now) if self._backward else -1
            start = graph.call_function(start_clock)
            copies[node] = copied = graph.node_copy(node, copies.__getitem__)
            graph.call_function(self._record, (index, start, sequence_nr, copied))
            if self._clock:
                graph.call_function(self._record_cuda_memory, (index, allocated))
            if annotate:
                graph.call_function(exit_range, (annotation,))
        self.reset()
        return fx.GraphModule(traced, graph, class_name=f"{type(traced).__name__}Timed")


def hook_autograd_nodes(output: Any, first_sequence_nr: int, span: BackwardSpan, claimed: set | None = None) -> None:
    """Time, into ``span``, every autograd node created since ``first_sequence_nr`` that ``output`` reaches.

    Nodes in ``claimed`` (already timed by an inner module) are walked through but not hooked;
    the hooked ones are added to it.
    """
    end = sequence_nr_now()
    pending = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    seen = set()
    while pending:
        fn = pending.pop()
        if fn is None or fn in seen or not first_sequence_nr <= fn._sequence_nr() < end:
            continue
        seen.add(fn)
        if claimed is None or fn not in claimed:
            if claimed is not None:
                claimed.add(fn)
            fn.register_prehook(span.pre)
            fn.register_hook(span.post)
        pending.extend(next_fn for next_fn, _ in fn.next_functions)


def _cuda_allocated_and_reset_peak() -> int:
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def enter_range(name: str) -> torch.profiler.record_function:
    annotation = torch.profiler.record_function(name)
    annotation.__enter__()
    return annotation


def exit_range(annotation: torch.profiler.record_function) -> None:
    annotation.__exit__(None, None, None)
