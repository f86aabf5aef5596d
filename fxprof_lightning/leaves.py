"""Tracing with leaves: the submodule torch.fx fails in is kept whole, and tracing is tried again.

Both tracing rungs of the capture ladder (``capture.capture``) use this loop: plain symbolic
tracing and tracing on a recorded call (``observed``). When tracing fails inside a submodule,
the innermost such submodule becomes a *leaf* (one ``call_module`` node, called as a whole)
and tracing starts over, so one untraceable block costs node granularity in that block only.
A failure in the root's own forward ends the loop: no graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx, nn

__all__ = ["MAX_LEAF_RETRIES", "LeafTrace", "LeafTracer", "short_error", "trace_with_leaves"]

MAX_LEAF_RETRIES = 64


class LeafTracer(fx.Tracer):
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


@dataclass
class LeafTrace:
    """What ``trace_with_leaves`` got.

    Attributes:
        graph_module: the traced graph, or None when tracing failed in the root's own forward.
        leaves: submodules traced as single nodes, with the error that made each one a leaf.
        first_error: the first try's error ('' when it succeeded).
        error: why no graph was made ('' when one was).
    """

    graph_module: fx.GraphModule | None
    leaves: dict[str, str] = field(default_factory=dict)
    first_error: str = ""
    error: str = ""


def short_error(error: BaseException) -> str:
    """``Type: first line`` of an exception, for reports."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:200]}"


def trace_with_leaves(make_tracer: Callable[[set[str]], LeafTracer],
                      trace: Callable[[LeafTracer], fx.GraphModule]) -> LeafTrace:
    """Run ``trace(make_tracer(leaves))``, adding the submodule each failure happened in to ``leaves``.

    Args:
        make_tracer: a new tracer that keeps the given submodule paths as leaves.
        trace: traces the module with that tracer and returns the ``GraphModule``.
    """
    leaves: dict[str, str] = {}
    first_error = ""
    for _ in range(MAX_LEAF_RETRIES):
        tracer = make_tracer(set(leaves))
        try:
            return LeafTrace(trace(tracer), leaves, first_error)
        except Exception as error:  # tracing user code can fail in any way
            first_error = first_error or short_error(error)
            culprit = tracer.failed_in
            if not culprit or culprit in leaves:  # the failure is in the module's own forward
                return LeafTrace(None, leaves, first_error, short_error(error))
            leaves[culprit] = short_error(error)
    return LeafTrace(None, leaves, first_error, f"more than {MAX_LEAF_RETRIES} submodules failed to trace")
