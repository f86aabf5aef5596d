"""Tracing with leaves: the submodule torch.fx fails in is kept whole, and tracing is tried again.

Both tracing rungs of the capture ladder (``capture.capture``) use this loop: plain symbolic
tracing and tracing on a recorded call (``observed``). When tracing fails inside a submodule,
the innermost such submodule becomes a *leaf* (one ``call_module`` node, called as a whole)
and tracing starts over, so one untraceable block costs node granularity in that block only.
A failure in the root's own forward ends the loop: no graph.

Two things plain torch.fx refuses, and eager code does all the time, are traced here (both
rungs): item assignment into a traced tensor (``shifted[..., 1:] = ids[..., :-1]``, T5's
``_shift_right``) becomes an ``operator.setitem`` node, in place as in eager mode
(``LeafProxy``); a module built inside the forward, outside the module hierarchy (a
``CrossEntropyLoss()`` made when ``labels`` are given), is traced through, so its functional
calls become nodes of the module that built it.

Activation checkpointing (``torch.utils.checkpoint``) called on traced values would run the
checkpointed function on proxies and inline it: the graph would keep every activation the
user's model frees. ``LeafTracer`` makes such a call fail (``refusing_checkpoint``), so the
module calling it becomes a leaf and keeps its checkpoint.

What tracing cannot see: Python questions that ``fx.Proxy`` does not intercept get answered
about the proxy, not about the value, and the answer is baked into the graph without notice:
``isinstance(x, torch.Tensor)`` is False, ``hasattr(x, name)`` is True, ``x is y`` compares
proxies. A forward that branches on those yields a graph that differs from what the module
does. This is a torch.fx limitation; plain symbolic tracing (rungs 1 and 2) has no real call to
check the graph against. Rung 3 has one and checks it (``observed.trace_on_example``).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.utils.checkpoint
from torch import fx, nn

__all__ = ["MAX_LEAF_RETRIES", "LeafProxy", "LeafTrace", "LeafTracer", "refusing_checkpoint", "short_error", "trace_with_leaves"]

MAX_LEAF_RETRIES = 64
# What every way into activation checkpointing calls at run time (``checkpoint`` itself may be
# bound early: HuggingFace keeps a ``functools.partial(checkpoint, ...)``). Names a torch
# version lacks are skipped.
CHECKPOINT_INTERNALS = (
    (torch.utils.checkpoint, "_checkpoint_without_reentrant_generator_impl"),  # use_reentrant=False
    (torch.utils.checkpoint, "_checkpoint_without_reentrant_generator"),  # the same, older torch
    (torch.utils.checkpoint.CheckpointFunction, "apply"),  # use_reentrant=True
)
_ABSENT = object()


class LeafProxy(fx.Proxy):
    """A proxy that records item assignment (``x[key] = value``) as an ``operator.setitem`` node."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class LeafTracer(fx.Tracer):
    """A tracer that keeps named submodules as leaves and notes which submodule tracing failed in.

    A module outside the root's hierarchy (built inside the forward) is traced through.
    """

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.extra_leaves = leaves
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.extra_leaves or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with refusing_checkpoint():
            return super().trace(root, concrete_args)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return LeafProxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        if not self._in_hierarchy(m):  # built in the forward (a loss module): no path to call it by
            return forward(*args, **kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module sees the exception first
                self.failed_in = self.path_of_module(m)
            raise

    def _in_hierarchy(self, m: nn.Module) -> bool:
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True


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


@contextlib.contextmanager
def refusing_checkpoint() -> Iterator[None]:
    """Activation checkpointing called with a traced value among its arguments raises ``TraceError``.

    Calls with real values (a leaf evaluated on an example) pass through untouched.
    """
    saved = [(owner, name, owner.__dict__.get(name, _ABSENT)) for owner, name in CHECKPOINT_INTERNALS
             if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, _refusing_proxies(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _ABSENT:  # inherited (``Function.apply``)
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _refusing_proxies(original: Callable[..., Any]) -> Callable[..., Any]:
    def refusing(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, functools.partial):  # HF: partial(forward, self, **kwargs)
                value = (value.args, value.keywords)
            if _has_proxy(value):
                raise fx.proxy.TraceError(
                    "activation checkpointing cannot be traced: torch.utils.checkpoint would run its function on "
                    "traced values and the graph would keep the activations it frees; the module calling it stays whole")
        return original(*args, **kwargs)

    return refusing


def _has_proxy(tree: Any) -> bool:
    found = []
    fx.node.map_aggregate(tree, lambda x: found.append(x) if isinstance(x, fx.Proxy) else None)
    return bool(found)


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
