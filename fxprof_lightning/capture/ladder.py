"""The capture ladder: how much of a module torch.fx can turn into a graph.

1. ``symbolic_trace`` of the whole module;
2. on failure, the innermost submodule whose tracing failed becomes a leaf (called as a
   whole, timed as one node) and tracing is tried again, until it succeeds: a model with
   one data-dependent block keeps node granularity everywhere else (``leaves``);
3. if the module's own forward cannot be traced and a real call of it was recorded (an
   ``traced_on_example.Example``), tracing on that call: the forward gets the call's explicit
   signature, its constant arguments and Python decisions are the call's, each checked by a
   guard node at run time; leaves as in 2 (``traced_on_example.trace_on_example``). The graph is kept
   only if it reproduces the module's output on that call. HuggingFace transformers models get
   here. Time such a graph with ``traced_on_example.GuardedNodeTimer``;
4. else ``capture`` returns no graph and the caller times modules with hooks instead
   (``module_hooks.ModuleHookTimer``).

A module that calls activation checkpointing (``torch.utils.checkpoint``) on traced values is
never traced through: it becomes a leaf (in the root's own forward: no graph on that rung), so
it keeps its checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from fxprof_lightning.capture.leaves import LeafTracer, trace_with_leaves
from fxprof_lightning.capture.traced_on_example import GUARDS, Example, trace_on_example

__all__ = ["Capture", "capture"]


@dataclass
class Capture:
    """How a module was captured.

    Attributes:
        method: ``"symbolic_trace"``, ``"symbolic_trace+leaves"``, ``"traced_on_example"``,
            ``"traced_on_example+leaves"``, ``"module_hooks"`` or ``"compiled"`` (a torch.compile'd module,
            timed from its kernels: ``capture/compiled.py``).
        graph_module: the traced graph (None for ``module_hooks``).
        leaves: submodules traced as single nodes, with the error that made them leaves.
        error: why tracing the whole module failed ('' when it did not).
        guards: guard nodes of a graph traced on an example (0 for the other methods).
        fused: ``compiled``: the rows whose kernels were fused across modules, with those kernels.
        graph_breaks: ``compiled`` and ``dynamo``: Dynamo's graph breaks, by reason, with their counts.
        graphs: ``dynamo``: the graphs captured so far (one per graph break and per recapture).
        recaptures: ``dynamo``: why each capture after the first was made (the guard that failed).
        host_reads: ``dynamo``: where the forward reads tensors' values on the host (``.item()``, a branch on a
            value: host syncs on a GPU), module path -> what and where (``dynamo_capture.host_reads``).
        capture_s: seconds of each capture: ``dynamo``: Dynamo, the check against eager, the call; the torch.fx ladder:
            the tracing (with its retries and checks).
    """

    method: str
    graph_module: fx.GraphModule | None = None
    leaves: dict[str, str] = field(default_factory=dict)
    error: str = ""
    guards: int = 0
    fused: dict[str, list[str]] = field(default_factory=dict)
    graph_breaks: dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    recaptures: list[str] = field(default_factory=list)
    host_reads: dict[str, str] = field(default_factory=dict)
    capture_s: list[float] = field(default_factory=list)

    @property
    def on_example(self) -> bool:
        """Whether the graph was traced on a recorded call (and must be run with guards honoured)."""
        return self.method.startswith("traced_on_example")

    def describe(self) -> str:
        """One line for logs and reports."""
        text = self.method
        if self.leaves:
            text += f" ({len(self.leaves)} leaf module(s): " + "; ".join(f"{k} [{v}]" for k, v in self.leaves.items()) + ")"
        if self.on_example:
            text += (f" (torch.fx failed on the module's own forward: {self.error}; traced on a recorded call "
                     f"instead, with {self.guards} guard(s) that send a call the graph does not fit to the "
                     "module's own forward)")
        if self.method == "dynamo":
            text += f" ({self.error}; {self.graphs} graph(s)"
            if self.graph_breaks:
                text += "; graph breaks: " + "; ".join(f"{reason.splitlines()[0]} (x{n})" for reason, n in self.graph_breaks.items())
            if self.recaptures:
                text += "; captured again: " + "; ".join(self.recaptures)
            text += ")"
        if self.method == "module_hooks":
            text += f" (torch.fx failed on the module's own forward: {self.error})"
        if self.method == "compiled":
            text += f" ({self.error}; kernels fused across modules: "
            text += "; ".join(f"{row} [{', '.join(kernels)}]" for row, kernels in self.fused.items()) or "none"
            # Dynamo's reasons run to many lines of hints; the first says what broke (graph_breaks keeps them whole).
            text += "; graph breaks: " + ("; ".join(f"{reason.splitlines()[0]} (x{n})" for reason, n in self.graph_breaks.items())
                                          or "none") + ")"
        return text


def capture(module: nn.Module, example: Example | None = None) -> Capture:
    """Trace ``module`` as far down as torch.fx allows; see the module docstring.

    Args:
        module: the module to capture, in the mode (train/eval) it will run in.
        example: a recorded call of ``module`` in that mode, for rung 3 (None: no rung 3).
    """
    plain = trace_with_leaves(LeafTracer, lambda tracer: _graph_module(module, tracer))
    if plain.graph_module is not None:
        method = "symbolic_trace+leaves" if plain.leaves else "symbolic_trace"
        return Capture(method, plain.graph_module, plain.leaves, plain.first_error)
    if example is None:
        return Capture("module_hooks", None, plain.leaves, plain.error)
    traced = trace_on_example(module, example)
    if traced.graph_module is None:
        return Capture("module_hooks", None, plain.leaves, f"{plain.error}; on a recorded call: {traced.error}")
    method = "traced_on_example+leaves" if traced.leaves else "traced_on_example"
    guards = sum(1 for node in traced.graph_module.graph.nodes if node.target in GUARDS)
    return Capture(method, traced.graph_module, traced.leaves, plain.error, guards)


def _graph_module(module: nn.Module, tracer: fx.Tracer) -> fx.GraphModule:
    graph = tracer.trace(module)
    graph_module = fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
    for name in tracer.root_constants:  # the graph module holds them now
        module.__dict__.pop(name, None)
    return graph_module
