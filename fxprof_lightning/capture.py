"""The capture ladder: how much of a module torch.fx can turn into a graph.

1. ``symbolic_trace`` of the whole module;
2. on failure, the innermost submodule whose tracing failed becomes a leaf (called as a
   whole, timed as one node) and tracing is tried again, until it succeeds: a model with
   one data-dependent block keeps node granularity everywhere else (``leaves``);
3. if the module's own forward cannot be traced, ``capture`` returns no graph and the
   caller times modules with hooks instead (``module_hooks.ModuleHookTimer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from fxprof_lightning.leaves import LeafTracer, trace_with_leaves

__all__ = ["Capture", "capture"]


@dataclass
class Capture:
    """How a module was captured.

    Attributes:
        method: ``"symbolic_trace"``, ``"symbolic_trace+leaves"`` or ``"module_hooks"``.
        graph_module: the traced graph (None for ``module_hooks``).
        leaves: submodules traced as single nodes, with the error that made them leaves.
        error: why tracing the whole module failed ('' when it did not).
    """

    method: str
    graph_module: fx.GraphModule | None = None
    leaves: dict[str, str] = field(default_factory=dict)
    error: str = ""

    def describe(self) -> str:
        """One line for logs and reports."""
        text = self.method
        if self.leaves:
            text += f" ({len(self.leaves)} leaf module(s): " + "; ".join(f"{k} [{v}]" for k, v in self.leaves.items()) + ")"
        if self.method == "module_hooks":
            text += f" (torch.fx failed on the module's own forward: {self.error})"
        return text


def capture(module: nn.Module) -> Capture:
    """Trace ``module`` as far down as torch.fx allows; see the module docstring."""
    plain = trace_with_leaves(LeafTracer, lambda tracer: _graph_module(module, tracer))
    if plain.graph_module is None:
        return Capture("module_hooks", None, plain.leaves, plain.error)
    method = "symbolic_trace+leaves" if plain.leaves else "symbolic_trace"
    return Capture(method, plain.graph_module, plain.leaves, plain.first_error)


def _graph_module(module: nn.Module, tracer: fx.Tracer) -> fx.GraphModule:
    graph = tracer.trace(module)
    return fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
