"""The capture ladder: how much of a module torch.fx can turn into a graph.

1. ``symbolic_trace`` of the whole module;
2. on failure, the innermost submodule whose tracing failed becomes a leaf (called as a
   whole, timed as one node) and tracing is tried again, until it succeeds: a model with
   one data-dependent block keeps node granularity everywhere else;
3. if the module's own forward cannot be traced, ``capture`` returns no graph and the
   caller times modules with hooks instead (``module_hooks.ModuleHookTimer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

__all__ = ["Capture", "capture"]

MAX_LEAF_RETRIES = 64


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


class _LeafTracer(fx.Tracer):
    """A tracer that keeps named submodules as leaves and notes which submodule tracing failed in."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.extra_leaves = leaves
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.extra_leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module sees the exception first
                try:
                    self.failed_in = self.path_of_module(m)
                except NameError:  # a module outside the hierarchy (built on the fly)
                    self.failed_in = ""
            raise


def _short(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:200]}"


def capture(module: nn.Module) -> Capture:
    """Trace ``module`` as far down as torch.fx allows; see the module docstring."""
    leaves: dict[str, str] = {}
    first_error = ""
    for _ in range(MAX_LEAF_RETRIES):
        tracer = _LeafTracer(set(leaves))
        try:
            graph = tracer.trace(module)
        except Exception as error:  # tracing user code can fail in any way
            first_error = first_error or _short(error)
            culprit = tracer.failed_in
            if not culprit or culprit in leaves:  # the failure is in the module's own forward
                return Capture("module_hooks", None, leaves, _short(error))
            leaves[culprit] = _short(error)
            continue
        graph_module = fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
        return Capture("symbolic_trace+leaves" if leaves else "symbolic_trace", graph_module, leaves, first_error)
    return Capture("module_hooks", None, leaves, f"more than {MAX_LEAF_RETRIES} submodules failed to trace")
