"""Rung 3 of the capture ladder: trace a module on one real call of it (HuggingFace transformers).

Plain symbolic tracing fails in the forward of HuggingFace models for reasons a real call
answers: decorators pass ``**kwargs`` on (torch.fx turns them into one Proxy), and the forward
branches in Python on shapes, ``None`` arguments and masks. Given an ``Example`` (a copy of the
arguments of one call, recorded by ``observe_first_call``), ``trace_on_example``:

1. gives the forward an explicit signature: its named parameters plus each ``**kwargs`` key of
   the call (``example_forward``); the forward's decorators still run, as in eager mode;
2. makes each argument holding a plain constant (None, a bool, a number, a string, a dtype, a
   device) a constant of the graph (``concrete_args``): ``if attention_mask is not None`` works;
3. traces with ``ExampleTracer``, which also runs every node on the example (no grad; random
   state and buffers restored) and answers Python's questions about proxies from those values:
   truth, ``len``, iteration, use as an int, static tensor attributes (``dtype``, ``device``...).
   The truth of a tensor (``if x.sum() > 0``) is not answered: the data decides it, batch by
   batch, so tracing fails there as it would have (a leaf, or module hooks);
4. keeps a submodule whole where tracing still fails (``leaves.trace_with_leaves``), activation
   checkpointing on traced values included (a ``GradientCheckpointingLayer`` stays whole);
5. runs the module's own forward and the graph on the example (with grad, from the same state,
   put back after each: ``verify.State``) and refuses the graph unless the output has the same
   structure and the two calls are bitwise the same by ``verify.first_difference``, the comparison
   Dynamo's capture uses: output tensors, gradients, buffers after the call, random states,
   tensors saved for backward. Some Python questions never reach the tracer: ``isinstance(x, torch.Tensor)``
   is False for a proxy, ``hasattr`` True, ``x is y`` compares proxies. Their answers are baked
   into the graph without a guard (a torch.fx limitation); this check catches those that change
   the recorded call's output. Rungs 1 and 2 have no recorded call and cannot check this.

Every answer specialises the graph on the example, so a *guard* node that checks it again goes
into the graph, the constant arguments included. Guards are bookkeeping, not timed
(``nodes.mark_untimed``). A call the graph does not fit fails a guard
(``GraphMismatch``); ``GuardedNodeTimer`` then runs the module's own forward for that call and
stops using the graph.

Objects in the graph's arguments and outputs (HuggingFace): a ``ModelOutput`` (a dict subclass)
is rebuilt with its class; a config (a dataclass) and any other object without traced values
becomes a constant of the graph; an object built in the forward that holds traced values (a
``DynamicCache``, built with the default ``use_cache=True``) is rebuilt at run time from the
graph's values, as HuggingFace's pytree flattening of caches for ``torch.export`` does
(``Rebuild``): a new object per call, like the forward's own.

The rung's parts: the recorded call and the explicit forward (``recorded_call``), the tracer
(``example_tracer``), the guards (``example_guards``), objects built again (``rebuild``), the
timer (``guarded_timer``); this module traces, fixes the graph up and checks it.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture import verify
from fxprof_lightning.capture.example_guards import check_argument
from fxprof_lightning.capture.example_tracer import ExampleTracer
from fxprof_lightning.capture.leaves import LeafTrace, short_error, slot_names, trace_with_leaves
from fxprof_lightning.capture.recorded_call import PLAIN_CONSTANTS, Example, example_forward
from fxprof_lightning.nodes import mark_untimed

__all__ = ["trace_on_example"]


def trace_on_example(module: nn.Module, example: Example) -> LeafTrace:
    """Trace ``module`` on a recorded call (see the module docstring), with leaf retries.

    The graph takes the forward's arguments by their names, placeholders first, so
    ``NodeTimer`` can time it; run it with ``GuardedNodeTimer``.
    """
    try:
        forward, concrete_args, examples = example_forward(module, example)
    except Exception as error:
        return LeafTrace(None, error=f"the recorded call has no explicit signature: {short_error(error)}")
    original = type(module)
    traced_class = type(original.__name__, (original,), {"forward": forward, "__module__": original.__module__})

    def trace(tracer: ExampleTracer) -> fx.GraphModule:
        module.__class__ = traced_class  # fx traces type(root).forward
        try:
            graph = tracer.trace(module, concrete_args)
            _placeholders_first(graph)
            _guard_constant_arguments(graph, concrete_args)
            return fx.GraphModule(module, graph, class_name=original.__name__)
        finally:
            module.__class__ = original
            for name in (*tracer.constants.values(), *tracer.root_constants):  # the graph module holds them now
                module.__dict__.pop(name, None)

    traced = trace_with_leaves(lambda leaves: ExampleTracer(leaves, examples), trace)
    if traced.graph_module is not None:
        difference = _difference_on_example(module, traced.graph_module, example)
        if difference:
            return LeafTrace(None, traced.leaves, traced.first_error,
                             "the graph traced on the recorded call does not reproduce the module's output on that "
                             f"call (e.g. an isinstance check on a traced value); {difference}")
    return traced


def _difference_on_example(module: nn.Module, graph_module: fx.GraphModule, example: Example) -> str:
    """How the graph's call on the example differs from the module's own forward's ('' if in no way).

    Both run on fresh copies of the example, with grad as in the training call it was recorded from
    (libraries decide on ``torch.is_grad_enabled()``: transformers keeps its cache without grad
    under gradient checkpointing), from the same state, put back after each run (``verify.State``:
    buffers, random states, the Python state the forward and hooks change). The output's structure
    (objects opened: a cache in a ``ModelOutput``) and its leaves' types must match; then
    ``verify.first_difference``, the comparison Dynamo's capture uses, compares the two calls: output
    tensors, gradients, buffers after the call, random states, tensors saved for backward, bitwise.
    Python decisions fx does not ask a proxy about (``isinstance``, ``hasattr``, ``is``) are
    baked into the graph without a guard: this is where a wrong one shows. An FSDP2 model on a torch whose FSDP2
    state cannot be put back after a backward (``verify.fsdp2_kept``: before 2.14) is checked on the forward alone,
    without gradients.
    """
    results: list[verify.CallResult] = []
    structures: list[tuple[Any, list[type]]] = []
    backward = verify.fsdp2_kept() or not any(verify.is_fsdp(m) for m in module.modules())
    state = verify.State(module, fsdp=backward)
    for run in (module.forward, graph_module):
        call = Example.copy_of(example.args, example.kwargs)
        try:
            with torch.enable_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(verify.run_checked(_flattened(run, structures), module, call.args, call.kwargs,
                                                  gradients=backward))
        except Exception as error:
            return f"{'the graph' if results else 'the module'} failed on it: {short_error(error)}"
        finally:
            state.restore()
    (expected_spec, expected_types), (got_spec, got_types) = structures
    if expected_spec != got_spec:
        return f"the output's structure differs: {got_spec} instead of {expected_spec}"
    for i, (a, b) in enumerate(zip(expected_types, got_types, strict=True)):
        if a is not b:
            return f"output {i} is a {b.__name__} instead of a {a.__name__}"
    return verify.first_difference(*results) or ""


def _flattened(run: Callable[..., Any], structures: list[tuple[Any, list[type]]]) -> Callable[..., list[Any]]:
    """``run`` returning its output's leaves, objects opened: the tensors ``verify`` compares are then every one in
    the output, those inside objects (a cache) included; the structure goes to ``structures``."""

    def call(*args: Any, **kwargs: Any) -> list[Any]:
        leaves, spec = torch_api.tree_flatten(_opened(run(*args, **kwargs)))
        structures.append((spec, [type(leaf) for leaf in leaves]))
        return leaves

    return call


def _opened(value: Any, depth: int = 12) -> Any:
    """``value`` with every object (a cache in a ``ModelOutput``) replaced by its class and its attributes, for comparing."""
    if depth == 0 or isinstance(value, (*PLAIN_CONSTANTS, torch.Tensor, nn.Module, type)):
        return value
    if isinstance(value, (list, tuple)):
        return [_opened(item, depth - 1) for item in value]
    if isinstance(value, dict):
        return {key: _opened(item, depth - 1) for key, item in value.items()}
    if hasattr(value, "__dict__") or slot_names(type(value)):
        state = dict(getattr(value, "__dict__", {}))
        state.update({slot: getattr(value, slot) for slot in slot_names(type(value)) if hasattr(value, slot)})
        return [type(value).__qualname__, {key: _opened(item, depth - 1) for key, item in state.items()}]
    return value


def _placeholders_first(graph: fx.Graph) -> None:
    """Move every placeholder, in order, before the first other node (``concrete_args`` puts an assert after each).

    ``NodeTimer`` notes a call's inputs once all placeholders have run.
    """
    nodes = list(graph.nodes)
    first_other = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    for node in nodes[first_other:]:
        if node.op == "placeholder":
            nodes[first_other].prepend(node)


def _guard_constant_arguments(graph: fx.Graph, concrete_args: dict[str, Any]) -> None:
    """Turn fx's asserts on ``concrete_args`` into ``check_argument`` guards, and give those arguments their names.

    fx names the placeholder of a constant argument ``name_1`` and asserts ``name_1 is None`` or
    ``name_1 == value``; the forward then takes ``name_1``, which a call by keyword cannot pass.
    """
    for node in list(graph.nodes):
        compare = None
        if node.target is torch_api.assert_is_none:  # (None where missing: no target is None)
            placeholder, expected = node.args[0], None
        elif node.target is torch_api.torch_assert and getattr(node.args[0], "target", None) is operator.eq:
            compare = node.args[0]
            placeholder, expected = compare.args
        else:
            continue
        name = getattr(placeholder, "target", "").removesuffix("_1")
        if getattr(placeholder, "op", None) != "placeholder" or name not in concrete_args:
            continue  # the model's own assert
        with graph.inserting_before(node):
            mark_untimed(graph.call_function(check_argument, (placeholder, expected, name)))
        graph.erase_node(node)
        if compare is not None and not compare.users:
            graph.erase_node(compare)
        if all(n.target != name for n in graph.nodes if n.op == "placeholder"):
            placeholder.target = name

