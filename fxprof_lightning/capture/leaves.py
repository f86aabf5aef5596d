"""Tracing with leaves: the submodule torch.fx fails in is kept whole, and tracing is tried again.

Both tracing rungs of the capture ladder (``capture.capture``) use this loop: plain symbolic
tracing and tracing on a recorded call (``traced_on_example``). When tracing fails inside a submodule,
the innermost such submodule becomes a *leaf* (one ``call_module`` node, called as a whole)
and tracing starts over, so one untraceable block costs node granularity in that block only.
A failure in the root's own forward ends the loop: no graph.

Two things plain torch.fx refuses, and eager code does all the time, are traced here (both
rungs): item assignment into a traced tensor (``shifted[..., 1:] = ids[..., :-1]``, T5's
``_shift_right``) becomes an ``operator.setitem`` node, in place as in eager mode
(``LeafProxy``); a module built inside the forward, outside the module hierarchy (a
``CrossEntropyLoss()`` made when ``labels`` are given), is traced through, so its functional
calls become nodes of the module that built it.

Random numbers drawn on the host (NumPy, Python's ``random``) while tracing would be drawn
once and baked into the graph as constants: Wav2Vec2's SpecAugment masks would be the same
at every step. A module-level function of the model's own source files that draws them
(``_compute_mask_indices``) becomes one graph node instead (``host_random_functions``), which
draws anew at each call, as the model does. For the same reason a torch random factory
(``torch.rand([])``, LayerDrop's draw) is always a node, and the other factories are nodes
when a size or value is traced (``torch.ones(batch, seq)``, ``torch.tensor(head_dim)``).

Activation checkpointing (``torch.utils.checkpoint``) called on traced values would run the
checkpointed function on proxies and inline it: the graph would keep every activation the
user's model frees. ``LeafTracer`` makes such a call fail (``refusing_checkpoint``), so the
module calling it becomes a leaf and keeps its checkpoint.

What tracing cannot see: Python questions that ``fx.Proxy`` does not intercept get answered
about the proxy, not about the value, and the answer is baked into the graph without notice:
``isinstance(x, torch.Tensor)`` is False, ``hasattr(x, name)`` is True, ``x is y`` compares
proxies. A forward that branches on those yields a graph that differs from what the module
does. This is a torch.fx limitation; plain symbolic tracing (rungs 1 and 2) has no real call to
check the graph against. Rung 3 has one and checks it (``traced_on_example.trace_on_example``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.utils.checkpoint
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture.verify import is_fsdp, patched
from fxprof_lightning.nodes import mark_untimed
from fxprof_lightning.timing import random_states

try:
    import numpy
except ImportError:  # torch runs without NumPy
    numpy = None

__all__ = [
    "HOST_RANDOM",
    "MAX_LEAF_RETRIES",
    "FunctionApply",
    "LeafProxy",
    "LeafTrace",
    "LeafTracer",
    "ModuleState",
    "holds_traced",
    "host_random_functions",
    "patched",
    "refusing_checkpoint",
    "short_error",
    "slot_names",
    "trace_with_leaves",
]

MAX_LEAF_RETRIES = 64
# torch._dynamo functions that only annotate a tensor for torch.compile: no-ops on traced values.
COMPILE_MARKS = ("mark_static_address", "mark_dynamic", "maybe_mark_dynamic", "mark_static")
HOST_RANDOM = "fxprof_host_random"  # node.meta key: the node draws NumPy or Python random numbers
# torch functions that build a tensor from Python values: nodes when one of those is traced ...
FACTORIES = ("ones", "zeros", "empty", "full", "tensor", "as_tensor", "arange")
# ... and those that draw random numbers: always nodes (a draw made while tracing would be a constant).
RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson")
# What every way into activation checkpointing calls at run time (``checkpoint`` itself may be
# bound early: HuggingFace keeps a ``functools.partial(checkpoint, ...)``). Names a torch
# version lacks are skipped.
CHECKPOINT_INTERNALS = (
    *torch_api.CHECKPOINT_GENERATORS,  # use_reentrant=False
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
        self.root_constants: list[str] = []  # put on the root for the graph: pop them once a GraphModule holds them
        self.hooked: dict[str, str] = {}  # submodules kept whole because they have hooks, and which

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if hooks_of(m):  # a graph that traced through it would skip them
            self.hooked[module_qualified_name] = f"{hooks_of(m)}: they run only when the module is called whole"
            return True
        return module_qualified_name in self.extra_leaves or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """Trace ``root``; every module's state is as before, after (see ``ModuleState``)."""
        state = ModuleState(root) if isinstance(root, nn.Module) else None
        graph = None
        try:
            with (refusing_checkpoint(), _host_random_as_nodes(self, root), _recorded_factories(self),
                  _grad_mode_as_nodes(self), _functions_as_nodes(self), _compile_marks_ignored(), random_states.kept()):
                graph = super().trace(root, concrete_args)
        finally:
            written = state.written(self.same_value) if state is not None else []
            if state is not None:
                self.root_constants = state.restore(graph if not written else None)
        if written:  # the graph cannot make the assignment; the module that holds the attribute stays whole
            path, name, kind = written[0]
            culprit = path
            while culprit and culprit in self.extra_leaves:  # then the assignment is its parent's (or above)
                culprit = culprit.rpartition(".")[0]
            self.failed_in = culprit
            if not path and name in self.own_constants():
                raise fx.proxy.TraceError(f"a {kind} the graph would hold as a constant gets traced values later in the "
                                          "forward: one object cannot serve every call")
            raise fx.proxy.TraceError(f"the forward assigns a traced value to {path or 'self'}.{name}: a graph "
                                      "cannot make that assignment")
        return graph

    def own_constants(self) -> set[str]:
        """Names of the objects this tracer put on the root as constants of the graph (none here)."""
        return set()

    def same_value(self, old: Any, new: fx.Proxy) -> bool:
        """Whether assigning ``new`` over ``old`` changes nothing (unknown while tracing without an example)."""
        return False

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


def refusing_checkpoint() -> contextlib.AbstractContextManager[None]:
    """Activation checkpointing called with a traced value among its arguments raises ``TraceError``.

    Calls with real values (a leaf evaluated on an example) pass through untouched.
    """
    return patched([(owner, name, _refusing_proxies(getattr(owner, name))) for owner, name in CHECKPOINT_INTERNALS
                     if hasattr(owner, name)])


def _records(tracer: fx.Tracer, args: Any, kwargs: Any) -> bool:
    """Whether a patched call becomes a graph node: it has a traced argument and is not run for a value."""
    return _has_proxy((args, kwargs)) and not getattr(tracer, "evaluating", False)


def host_random_functions(root: Any) -> list[tuple[types.ModuleType, str, Callable[..., Any]]]:
    """``(source module, name, function)`` of each module-level function of the model's source files that draws host random numbers.

    The source files are those of the classes of ``root``'s modules, outside torch; a function
    draws them if ``random`` is among the names its code (nested functions included) uses:
    ``np.random.rand``, ``random.random``.
    """
    modules = root.modules() if isinstance(root, nn.Module) else ()
    sources = {type(m).__module__ for m in modules} - {None}
    found = []
    for source in sorted(s for s in sources if s.split(".")[0] != "torch" and s in sys.modules):
        module = sys.modules[source]
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) and value.__module__ == source and "random" in _names_used(value.__code__):
                found.append((module, name, value))
    return found


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_used(constant)
    return names


def _host_random_as_nodes(tracer: fx.Tracer, root: Any) -> contextlib.AbstractContextManager[None]:
    """While tracing, a call of a ``host_random_functions`` function with a traced argument is a graph node."""

    def as_node(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def node(*args: Any, **kwargs: Any) -> Any:
            if _records(tracer, args, kwargs):
                proxy = tracer.create_proxy("call_function", original, args, kwargs)
                proxy.node.meta[HOST_RANDOM] = True
                return proxy
            return original(*args, **kwargs)

        return node

    return patched([(module, name, as_node(original)) for module, name, original in host_random_functions(root)])


class ModuleState:
    """Every module's attributes, parameters, buffers and children, put back after tracing.

    Tracing runs the forward once more than the user did, on traced values: an assignment such
    as ``self.pos_encoding = self.pos_encoding.to(device)`` (CTRL) would leave a proxy in the
    user's module, and so would ``self.history.append(x)`` or ``self.config.scale = x``. The
    snapshot holds each module's entries and, one level down, the contents of the lists, dicts,
    sets and plain objects they hold. ``written`` names the entries that hold a traced value
    after tracing, as ``(module path, attribute)`` (an assignment ``same_value`` calls a no-op
    is left out): the graph cannot make those changes. ``restore`` puts everything back and
    removes the new entries, except the constants the graph reads (``get_attr`` on the root).
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.saved = [(path, m, [(store, dict(store)) for store in _stores(m)]) for path, m in root.named_modules()]
        self.contents = {id(v): (v, _contents(v)) for _, m, stores in self.saved for v in stores[0][1].values()
                         if _contents(v) is not None and not any(v is store for store, _ in stores)}

    def written(self, same_value: Callable[[Any, fx.Proxy], bool]) -> list[tuple[str, str, str]]:
        """``(module path, entry, type name of its value)`` of the entries that hold traced values."""
        found = []
        for path, _, stores in self.saved:
            for store, before in stores:
                for name, value in store.items():
                    old = before.get(name, _ABSENT)
                    if value is old and id(value) not in self.contents:
                        continue
                    if holds_traced(value) and not (value is not old and old is not _ABSENT and same_value(old, value)):
                        found.append((path, name, type(value).__name__))
        return found

    def restore(self, graph: fx.Graph | None) -> list[str]:
        """Put everything back; return the names of the constants left on the root for the graph."""
        read = {n.target for n in graph.nodes if n.op == "get_attr"} if graph is not None else set()
        kept: list[str] = []
        for value, contents in self.contents.values():
            _set_contents(value, contents)
        for _, module, stores in self.saved:
            for store, before in stores:
                constants = {name: value for name, value in store.items()
                             if module is self.root and name not in before and name in read}  # fx's tensor constants, ours
                store.clear()
                store.update(before)
                store.update(constants)
                kept += constants
        return kept


def _contents(value: Any) -> Any:
    """A copy of what a list, dict, set or plain object holds (None for anything else)."""
    if isinstance(value, (list, dict, set)):
        return type(value)(value) if type(value) in (list, dict, set) else None
    if isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType)) or callable(value):
        return None
    return dict(vars(value)) if isinstance(getattr(value, "__dict__", None), dict) else None


def _set_contents(value: Any, contents: Any) -> None:
    if isinstance(value, list):
        value[:] = contents
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(contents)
    else:
        vars(value).clear()
        vars(value).update(contents)


def holds_traced(value: Any, depth: int = 10, seen: set[int] | None = None) -> bool:
    """Whether a proxy hides in ``value``: in containers, objects' attributes and slots (modules and tensors excluded)."""
    if isinstance(value, fx.Proxy):
        return True
    seen = set() if seen is None else seen
    if depth == 0 or id(value) in seen or isinstance(value, (nn.Module, torch.Tensor, type, str, bytes, int, float, bool,
                                                             types.ModuleType)):
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values()) if isinstance(getattr(value, "__dict__", None), dict) else []
        items += [getattr(value, slot) for slot in slot_names(type(value)) if hasattr(value, slot)]
    return any(holds_traced(item, depth - 1, seen) for item in items)


def slot_names(cls: type) -> list[str]:
    """The slots a class and its bases declare (``__dict__`` and ``__weakref__`` aside)."""
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return names


def _stores(module: nn.Module) -> list[dict[str, Any]]:
    return [module.__dict__, module._parameters, module._buffers, module._modules]


class FunctionApply:
    """A graph function calling a custom ``torch.autograd.Function``: one node, which keeps the Function's backward."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        self.function = function
        self.__name__ = self.__qualname__ = f"{function.__name__}.apply"
        self.__module__ = function.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return self.__name__


def _functions_as_nodes(tracer: fx.Tracer) -> contextlib.AbstractContextManager[None]:
    """A custom autograd Function applied to traced values is a ``FunctionApply`` node.

    Traced through, its forward's ops would be recorded and autograd would differentiate them,
    not run the Function's own backward (Bloom's GeLU, PhiMoE's router): other gradients.
    """
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if _records(tracer, args, kwargs):
            return tracer.create_proxy("call_function", FunctionApply(cls), args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    return patched([(torch.autograd.Function, "apply", classmethod(apply))])


def _grad_mode_as_nodes(tracer: fx.Tracer) -> contextlib.AbstractContextManager[None]:
    """``no_grad``, ``enable_grad`` and ``set_grad_enabled`` (blocks and decorators) in the forward are graph nodes.

    torch.fx does not see grad mode: a ``torch.no_grad()`` block would be traced as plain code and
    the graph would record autograd history the model does not (other gradients). Entering sets
    the mode with a ``torch._C._set_grad_enabled`` node; leaving sets back the mode read by a
    ``torch.is_grad_enabled`` node when entering, at run time. The grad mode itself does not
    change while tracing. Code run for a value while tracing (``evaluating``) is left alone.
    """
    no_grad, enable_grad, set_grad_enabled = (torch.autograd.grad_mode.no_grad, torch.autograd.grad_mode.enable_grad,
                                              torch.autograd.grad_mode.set_grad_enabled)

    def enter(mode: bool, original: Callable[..., Any]) -> Callable[..., Any]:
        def entered(self: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(tracer, "evaluating", False):
                return original(self, *args, **kwargs)
            self.mode = args[0] if args else kwargs.get("mode", mode)  # set_grad_enabled(mode) keeps it for clone()
            self.prev = tracer.create_proxy("call_function", torch.is_grad_enabled, (), {})
            mark_untimed(self.prev.node)
            mark_untimed(tracer.create_proxy("call_function", torch_api.set_grad_enabled, (self.mode,), {}).node)
            return None

        return entered

    def entered_again(original: Callable[..., Any]) -> Callable[..., Any]:
        def entered(self: Any) -> None:  # set_grad_enabled's own __enter__ sets the mode again
            return None if isinstance(getattr(self, "prev", None), fx.Proxy) else original(self)

        return entered

    def exit_(original: Callable[..., Any]) -> Callable[..., Any]:
        def exited(self: Any, *args: Any) -> None:
            if not isinstance(getattr(self, "prev", None), fx.Proxy):  # entered outside the trace
                return original(self, *args)
            mark_untimed(tracer.create_proxy("call_function", torch_api.set_grad_enabled, (self.prev,), {}).node)
            return None

        return exited

    return patched([
        (no_grad, "__enter__", enter(False, no_grad.__enter__)),
        (enable_grad, "__enter__", enter(True, enable_grad.__enter__)),
        (set_grad_enabled, "__init__", enter(True, set_grad_enabled.__init__)),
        (set_grad_enabled, "__enter__", entered_again(set_grad_enabled.__enter__)),
        *[(owner, "__exit__", exit_(owner.__exit__)) for owner in (no_grad, enable_grad, set_grad_enabled)],
    ])


def _compile_marks_ignored() -> contextlib.AbstractContextManager[None]:
    """``torch._dynamo.mark_static_address`` and the other marks do nothing to a traced value.

    They only annotate a tensor for ``torch.compile`` (HF's linear-attention caches mark their
    state tensors for CUDA graphs) and refuse a proxy, which would make the module a leaf.
    """
    dynamo = torch_api.dynamo
    names = [name for name in COMPILE_MARKS if dynamo is not None and hasattr(dynamo, name)]

    def ignoring_proxies(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def mark(t: Any, *args: Any, **kwargs: Any) -> Any:
            return None if isinstance(t, fx.Proxy) else original(t, *args, **kwargs)

        return mark

    return patched([(dynamo, name, ignoring_proxies(getattr(dynamo, name))) for name in names])


def _recorded_factories(tracer: fx.Tracer) -> contextlib.AbstractContextManager[None]:
    """``FACTORIES`` called with a traced value, and ``RANDOM_FACTORIES`` called at all, while tracing, are nodes.

    Sizes given as traced ints never reach ``__torch_function__``; a random draw made while
    tracing would be baked into the graph and the graph would draw one number less than the model.
    """

    def recorded(original: Callable[..., Any], always: bool) -> Callable[..., Any]:
        @functools.wraps(original)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if _records(tracer, args, kwargs) or (always and not getattr(tracer, "evaluating", False)):
                return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)

        return factory

    return patched([(torch, name, recorded(getattr(torch, name), name in RANDOM_FACTORIES))
                     for name in (*FACTORIES, *RANDOM_FACTORIES)])


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


def hooks_of(module: nn.Module) -> str:
    """What hooks run around ``module``'s forward ('' for none): FSDP2's unshard and reshard are such hooks."""
    kinds = [kind for kind, hooks in (("forward pre-hooks", module._forward_pre_hooks), ("forward hooks", module._forward_hooks),
                                      ("backward hooks", module._backward_hooks),
                                      ("backward pre-hooks", module._backward_pre_hooks)) if hooks]
    if not kinds:
        return ""
    fsdp = " (fully_shard: FSDP2 unshards and reshards its parameters in them)" if is_fsdp(module) else ""
    return f"has {' and '.join(kinds)}{fsdp}"


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
            graph_module = trace(tracer)
            return LeafTrace(graph_module, {**tracer.hooked, **leaves}, first_error)
        except Exception as error:  # tracing user code can fail in any way
            first_error = first_error or short_error(error)
            culprit = tracer.failed_in
            if not culprit or culprit in leaves:  # the failure is in the module's own forward
                return LeafTrace(None, leaves, first_error, short_error(error))
            leaves[culprit] = short_error(error)
    return LeafTrace(None, leaves, first_error, f"more than {MAX_LEAF_RETRIES} submodules failed to trace")
