"""The capture ladder: how much of a module torch.fx can turn into a graph.

1. ``symbolic_trace`` of the whole module;
2. on failure, the innermost submodule whose tracing failed becomes a leaf (called as a
   whole, timed as one node) and tracing is tried again, until it succeeds: a model with
   one data-dependent block keeps node granularity everywhere else (``leaves``);
3. if the module's own forward cannot be traced and a real call of it was recorded (an
   ``recorded_call.Example``), tracing on that call: the forward gets the call's explicit
   signature, its constant arguments and Python decisions are the call's, each checked by a
   guard node at run time; leaves as in 2 (``traced_on_example.trace_on_example``). The graph is kept
   only if it reproduces the module's output on that call. HuggingFace transformers models get
   here. Time such a graph with ``guarded_timer.GuardedNodeTimer``;
4. else ``capture`` returns no graph and the caller times modules with hooks instead
   (``module_hooks.ModuleHookTimer``).

A module that calls activation checkpointing (``torch.utils.checkpoint``) on traced values is
never traced through: it becomes a leaf (in the root's own forward: no graph on that rung), so
it keeps its checkpoint.
"""

from __future__ import annotations

from torch import fx, nn

from fxprof_lightning.capture.example_guards import GUARDS
from fxprof_lightning.capture.leaves import LeafTracer, trace_with_leaves
from fxprof_lightning.capture.recorded_call import Example
from fxprof_lightning.capture.traced_on_example import trace_on_example
from fxprof_lightning.nodes import Capture

__all__ = ["Capture", "capture"]


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
