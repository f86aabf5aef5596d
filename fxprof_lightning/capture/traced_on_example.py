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
5. runs the module's own forward and the graph on the example (no grad, the same random state;
   random state and buffers restored) and refuses the graph unless every output tensor is
   bitwise the same. Some Python questions never reach the tracer: ``isinstance(x, torch.Tensor)``
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.hooks import RemovableHandle

from fxprof_lightning.capture import side_effects
from fxprof_lightning.capture.leaves import (
    HOST_RANDOM,
    FunctionApply,
    LeafProxy,
    LeafTrace,
    LeafTracer,
    holds_traced,
    short_error,
    slot_names,
    trace_with_leaves,
)
from fxprof_lightning.nodes import mark_untimed
from fxprof_lightning.timing import random_states
from fxprof_lightning.timing.node_timing import NodeTimer

__all__ = ["GUARDS", "Example", "ExampleTracer", "GraphMismatch", "GuardedNodeTimer", "Rebuild", "example_forward",
           "observe_first_call", "trace_on_example"]

# Argument values that become constants of the graph (each guarded by ``check_argument``).
PLAIN_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)
# Tensor attributes read from the example as constants (guarded by ``check_attribute``).
STATIC_ATTRIBUTES = ("dtype", "device", "layout", "ndim", "is_cuda", "is_sparse", "is_quantized", "is_meta")
_MISSING = object()


# ------------------------------------------------------------------ the recorded call


@dataclass(frozen=True)
class Example:
    """The arguments of one call of a module; tensors are copies (detached, ``requires_grad`` kept)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def copy_of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Example:
        return cls(tree_map(_copy_tensor, tuple(args)), tree_map(_copy_tensor, dict(kwargs)))


def _copy_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def observe_first_call(module: nn.Module, training: bool, on_call: Callable[[Example], None]) -> RemovableHandle:
    """Give ``on_call`` a copy of the first call ``module`` gets in the given mode, then stop observing.

    A forward pre-hook that removes itself; it returns nothing (the call is unchanged) and never
    raises into the forward (a call whose arguments cannot be copied is given up on).
    """

    def hook(called: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if called.training != training:
            return
        handle.remove()
        with contextlib.suppress(Exception):
            on_call(Example.copy_of(args, kwargs))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return handle


# ------------------------------------------------------------------ guards: run in the graph


class GraphMismatch(RuntimeError):
    """A call does not fit the example the graph was traced on (a guard failed)."""


def _on_meta(value: Any) -> bool:
    """Values on the meta device (the untimed FLOP-counting pass) have no data to check."""
    return isinstance(value, torch.Tensor) and value.is_meta


def check_truth(value: Any, expected: bool, what: str) -> None:
    """Guard: ``bool(value)`` (an ``if`` on a traced value) is what it was on the example."""
    if not _on_meta(value) and bool(value) != expected:
        raise GraphMismatch(f"bool({what}) was {expected} on the example, now {not expected}")


def check_length(value: Any, expected: int, what: str) -> None:
    """Guard: ``len(value)`` (unpacking, iteration) is what it was on the example."""
    if len(value) != expected:
        raise GraphMismatch(f"len({what}) was {expected} on the example, now {len(value)}")


def check_index(value: Any, expected: int, what: str) -> None:
    """Guard: an int used as a Python int (a size, a range) is what it was on the example."""
    if operator.index(value) != expected:
        raise GraphMismatch(f"{what} was {expected} on the example, now {operator.index(value)}")


def check_attribute(value: Any, attribute: str, expected: Any) -> None:
    """Guard: a tensor attribute read as a constant (``x.dtype``, ``x.device``) has not changed."""
    found = getattr(value, attribute, None)  # None: no longer a tensor (an argument left out)
    if not _on_meta(value) and found != expected:
        raise GraphMismatch(f".{attribute} was {expected} on the example, now {found}")


def check_argument(value: Any, expected: Any, name: str) -> None:
    """Guard: an argument made a constant of the graph has the example's value."""
    if not (value is expected or (type(value) is type(expected) and value == expected)):
        raise GraphMismatch(f"argument {name} was {expected!r} on the example, now {value!r}")


GUARDS = (check_truth, check_length, check_index, check_attribute, check_argument)


# ------------------------------------------------------------------ the explicit forward


def example_forward(module: nn.Module, example: Example) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    """A forward with an explicit signature for the example's call, its ``concrete_args``, the example's values.

    The signature is that of ``type(module).forward`` (seen through ``functools.wraps``) without
    ``*args`` (which must be empty in the call), plus each ``**kwargs`` key of the call as a
    keyword parameter (default None). The function calls the module's forward, decorators
    included, passing arguments by keyword where it can. ``concrete_args`` holds the arguments
    whose example value is a plain constant (``PLAIN_CONSTANTS``); the values map each
    parameter to the example's value.

    Raises:
        TypeError: the call does not bind to the forward, or uses ``*args``, or a keyword that is
            not an identifier.
    """
    forward = type(module).forward
    signature = inspect.signature(forward)
    bound = signature.bind(module, *example.args, **example.kwargs).arguments
    positional: list[str] = []
    keyword: list[str] = []
    passed: list[str] = []
    defaults: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for p in list(signature.parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            if bound.get(p.name):
                raise TypeError(f"the call passes *{p.name}")
            continue
        if p.kind is p.VAR_KEYWORD:
            for key, value in bound.get(p.name, {}).items():
                if not key.isidentifier():
                    raise TypeError(f"the call passes the keyword {key!r}")
                defaults[key], values[key] = None, value
                keyword.append(f"{key}=__fxprof_defaults[{key!r}]")
                passed.append(f"{key}={key}")
            continue
        values[p.name] = bound.get(p.name, p.default)
        text = p.name
        if p.default is not p.empty:
            defaults[p.name] = p.default
            text += f"=__fxprof_defaults[{p.name!r}]"
        (keyword if p.kind is p.KEYWORD_ONLY else positional).append(text)
        passed.append(p.name if p.kind is p.POSITIONAL_ONLY else f"{p.name}={p.name}")
    parameters = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    namespace = {"__fxprof_forward": forward, "__fxprof_defaults": defaults}
    exec(f"def forward({parameters}):\n    return __fxprof_forward({', '.join(['self', *passed])})\n", namespace)
    concrete_args = {name: value for name, value in values.items() if isinstance(value, PLAIN_CONSTANTS)}
    return namespace["forward"], concrete_args, values


# ------------------------------------------------------------------ the tracer


class ExampleProxy(LeafProxy):
    """A proxy whose static tensor attributes and Python-int uses are the example's values, guarded."""

    def __getattr__(self, k: str) -> Any:
        if k in STATIC_ATTRIBUTES:
            value = self.tracer.value_of(self)
            if isinstance(value, torch.Tensor):
                constant = getattr(value, k)
                self.tracer.guard(check_attribute, self, k, constant)
                return constant
        return super().__getattr__(k)

    def __index__(self) -> int:
        value = self.tracer.value_of(self)
        if isinstance(value, bool) or not isinstance(value, int):
            raise fx.proxy.TraceError(f"{self.node.format_node()} is used as an int, and its example value is "
                                      f"{type(value).__name__}")
        self.tracer.guard(check_index, self, value, self.node.name)
        return value


class ExampleTracer(LeafTracer):
    """A ``LeafTracer`` that runs every node on the example and answers control flow from the values.

    ``bool``, ``len`` and iteration of a proxy, and ``ExampleProxy`` attributes, return the value
    the example gives and add a guard node. Questions about a node whose value cannot be computed
    (an input without an example), or about the truth of a tensor, are not answered: tracing
    fails as it would have.

    Args:
        leaves: submodule paths to keep whole.
        examples: the example's value of each parameter of the traced forward.
    """

    def __init__(self, leaves: set[str], examples: dict[str, Any]) -> None:
        super().__init__(leaves)
        self.examples = tree_map(_copy_tensor, examples)  # evaluating may change them in place
        self.values: dict[fx.Node, Any] = {}
        self.proxy_buffer_attributes = True  # self.position_ids[:, :seq]: the buffer becomes a node too
        self.evaluating = False  # True while a node runs eagerly for its value
        self.constants: dict[int, str] = {}  # id of an object the graph holds -> its attribute name

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ExampleProxy(node, self)

    def value_of(self, proxy: fx.Proxy) -> Any:
        return self.values.get(proxy.node, _MISSING)

    def own_constants(self) -> set[str]:
        return set(self.constants.values())

    def same_value(self, old: Any, new: fx.Proxy) -> bool:
        """An assignment of a traced value equal to the old one on the example changes nothing: CTRL's
        ``x = x.to(device)``, Swin's ``self.window_size = min(resolution)`` on a resolution that needs no clamping."""
        value = self.value_of(new) if isinstance(new, fx.Proxy) else _MISSING
        if isinstance(old, PLAIN_CONSTANTS):
            return type(value) is type(old) and value == old
        return (isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.dtype == value.dtype
                and old.device == value.device and old.shape == value.shape and torch.equal(old, value))

    def guard(self, check: Callable[..., None], *args: Any) -> None:
        """Put ``check(*args)`` into the graph."""
        mark_untimed(self.create_proxy("call_function", check, args, {}).node)

    # Python asking about a proxy: the example answers, a guard asks again at run time.

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self._known(obj, "its truth")
        if isinstance(value, torch.Tensor):  # the data decides: no branch to bake in, each batch may differ
            raise fx.proxy.TraceError(f"data-dependent control flow on {obj.node.format_node()}")
        decision = bool(value)
        self.guard(check_truth, obj, decision, obj.node.name)
        return decision

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = self._known(obj, "iteration")
        if not isinstance(value, (tuple, list, torch.Size)):
            raise fx.proxy.TraceError(f"cannot iterate over a traced {type(value).__name__}")
        self.guard(check_length, obj, len(value), obj.node.name)
        return iter([obj[i] for i in range(len(value))])

    def length(self, obj: fx.Proxy) -> int:
        size = len(self._known(obj, "len"))
        self.guard(check_length, obj, size, obj.node.name)
        return size

    def _known(self, obj: fx.Proxy, question: str) -> Any:
        value = self.value_of(obj)
        if value is _MISSING:
            raise fx.proxy.TraceError(f"no example value to answer {question} of {obj.node.format_node()}")
        return value

    # Every node created also gets its value on the example.

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **more: Any) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
        value = _MISSING
        if kind == "placeholder":
            value = self.examples.get(target, _MISSING)
        elif kind == "get_attr":
            value = self._evaluate(operator.attrgetter(target), (self.root,), {})
        elif kind in ("call_function", "call_method", "call_module"):
            value = self._evaluate_node(kind, target, args, kwargs)
        if value is not _MISSING:
            self.values[proxy.node] = value
        return proxy

    def _evaluate_node(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        args, kwargs = self._concrete(args), self._concrete(kwargs)
        if args is _MISSING or kwargs is _MISSING:
            return _MISSING
        if kind == "call_method":
            return self._evaluate(getattr(args[0], target), args[1:], kwargs)
        if kind == "call_module":
            return self._evaluate(self.root.get_submodule(target).forward, args, kwargs)
        return self._evaluate(target, args, kwargs)

    def _evaluate(self, function: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        evaluating, self.evaluating = self.evaluating, True  # module calls and attributes inside are plain eager code
        try:
            with torch.no_grad():
                return function(*args, **kwargs)
        except Exception:  # no value: only a question about it would fail
            return _MISSING
        finally:
            self.evaluating = evaluating

    def _concrete(self, tree: Any) -> Any:
        """``tree`` with every proxy replaced by its value (``_MISSING`` if one has none)."""
        missing = False

        def value(x: Any) -> Any:
            nonlocal missing
            if isinstance(x, fx.Proxy):
                found = self.value_of(x)
            elif holds_traced(x):
                found = self._concrete_object(x)
            else:
                return x
            missing = missing or found is _MISSING
            return found

        concrete = fx.node.map_aggregate(tree, value)
        return _MISSING if missing else concrete

    def _concrete_object(self, obj: Any) -> Any:
        """A copy of an object holding traced values (a cache handed to a leaf) with their values, as ``Rebuild``
        gives the leaf at run time: evaluating the leaf on the object itself would trace it (``_MISSING`` if it
        cannot be built)."""
        proxies: list[fx.Proxy] = []
        try:
            recipe = Rebuild.recipe_of(obj, proxies)
        except fx.proxy.TraceError:
            return _MISSING
        values = self._concrete(proxies)
        return _MISSING if values is _MISSING else Rebuild(recipe)(*values)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self.evaluating:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self.evaluating:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    # Objects in the graph's arguments and outputs.

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and type(a) is not dict and not isinstance(a, fx.immutable_collections.immutable_dict):
            # A dict subclass built in the forward (an HF ModelOutput): rebuilt at run time, with its class.
            return self.create_node("call_function", type(a), (), {k: self.create_arg(v) for k, v in a.items()})
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            return self._constant(a)  # else fx would rebuild it from its fields (an HF config)
        try:
            return super().create_arg(a)
        except NotImplementedError:  # any other object: a constant attribute of the graph
            return self._constant(a)

    def _constant(self, a: Any) -> fx.Node:
        if holds_traced(a):  # built in the forward from traced values: built again at run time
            values: list[fx.Proxy] = []
            recipe = Rebuild.recipe_of(a, values)
            return mark_untimed(self.create_node("call_function", Rebuild(recipe), tuple(self.create_arg(v) for v in values), {}))
        name = self.constants.get(id(a))
        if name is None:
            name = self.constants[id(a)] = f"_fxprof_constant_{len(self.constants)}"
            setattr(self.root, name, a)
        return self.create_node("get_attr", name, (), {})

    def trace(self, root: nn.Module, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """Trace with ``len(proxy)`` patched; random state and buffers are restored."""
        with _patched_len(self), _state_restored(root), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the model's own warnings already showed in eager mode
            return super().trace(root, concrete_args)


@contextlib.contextmanager
def _state_restored(module: nn.Module) -> Iterator[None]:
    """The random states (``random_states``) and the module's buffers are as before, after."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    with random_states.kept():
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


@contextlib.contextmanager
def _patched_len(tracer: ExampleTracer) -> Iterator[None]:
    """``len(proxy)`` asks ``tracer.length`` (fx.Proxy has no hook for it)."""
    original = fx.Proxy.__len__

    def length(proxy: fx.Proxy) -> int:
        return tracer.length(proxy) if proxy.tracer is tracer else original(proxy)

    fx.Proxy.__len__ = length
    try:
        yield
    finally:
        fx.Proxy.__len__ = original


@dataclass(frozen=True)
class _Slot:
    """In a ``Rebuild`` recipe: the n-th graph value the object is built from."""

    index: int


@dataclass(frozen=True)
class _Object:
    """In a ``Rebuild`` recipe: an object of ``cls`` whose ``__dict__`` is built from ``state``."""

    cls: type
    state: dict[str, Any]


class Rebuild:
    """A graph function that builds, from the graph's values, an object the forward built from traced values.

    The recipe is the object with each traced value replaced by a slot: plain lists, tuples and
    dicts on the way to a traced value are built anew, other objects through ``cls.__new__`` and
    their ``__dict__`` (as HuggingFace flattens caches for ``torch.export``); whatever holds no
    traced value (a config, a dtype) is shared with the example. Bookkeeping, not timed.
    """

    __name__ = "rebuild"  # node names

    def __init__(self, recipe: Any) -> None:
        self.recipe = recipe
        self.__qualname__ = f"rebuild_{_type_name(recipe)}"

    def __call__(self, *values: Any) -> Any:
        return self._build(self.recipe, values)

    def __repr__(self) -> str:
        return self.__qualname__

    @classmethod
    def recipe_of(cls, obj: Any, values: list[fx.Proxy], depth: int = 8, family: str | None = None) -> Any:
        """``obj`` as a recipe; its traced values are appended to ``values``.

        Besides what holds traced values, plain lists and dicts and the objects whose class comes
        from the same file as ``obj``'s (a cache's layers) are built anew at each call too, as
        the forward builds them: a caller changing one call's cache does not change the next's.
        """
        family = type(obj).__module__ if family is None else family
        if isinstance(obj, fx.Proxy):
            values.append(obj)
            return _Slot(len(values) - 1)
        own = type(obj) in (list, dict) or (type(obj).__module__ == family and isinstance(getattr(obj, "__dict__", None), dict)
                                           and not isinstance(obj, (nn.Module, torch.Tensor, type)))
        if not own and not holds_traced(obj):
            return obj
        if depth == 0:
            raise fx.proxy.TraceError(f"a {type(obj).__name__} built while tracing holds traced values too deep inside")
        if type(obj) in (list, tuple):
            return type(obj)(cls.recipe_of(item, values, depth - 1, family) for item in obj)
        if type(obj) is dict:
            return {key: cls.recipe_of(item, values, depth - 1, family) for key, item in obj.items()}
        if isinstance(getattr(obj, "__dict__", None), dict) and not slot_names(type(obj)) and not isinstance(obj, (list, tuple, dict, set)):
            return _Object(type(obj), {k: cls.recipe_of(v, values, depth - 1, family) for k, v in vars(obj).items()})
        raise fx.proxy.TraceError(f"a {type(obj).__name__} built while tracing holds traced values and cannot be "
                                  "built again from them")

    @classmethod
    def _build(cls, recipe: Any, values: tuple[Any, ...]) -> Any:
        kind = type(recipe)
        if kind is _Slot:
            return values[recipe.index]
        if kind is _Object:
            obj = recipe.cls.__new__(recipe.cls)
            obj.__dict__.update({k: cls._build(v, values) for k, v in recipe.state.items()})
            return obj
        if kind in (list, tuple):
            return kind(cls._build(item, values) for item in recipe)
        if kind is dict:
            return {key: cls._build(item, values) for key, item in recipe.items()}
        return recipe


def _type_name(recipe: Any) -> str:
    return recipe.cls.__name__ if isinstance(recipe, _Object) else type(recipe).__name__


# ------------------------------------------------------------------ the rung


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
    """How the graph's output on the example differs from the module's own forward's ('' if in no way).

    Both run on fresh copies of the example, with grad as in the training call it was recorded from
    (libraries decide on ``torch.is_grad_enabled()``: transformers keeps its cache without grad
    under gradient checkpointing), from the same random state; the
    random state and the buffers are restored after each run (batch-norm statistics, dropout).
    Python decisions fx does not ask a proxy about (``isinstance``, ``hasattr``, ``is``) are
    baked into the graph without a guard: this is where a wrong one shows.
    """
    outputs = []
    for run in (module.forward, graph_module):
        call = Example.copy_of(example.args, example.kwargs)
        put_back = side_effects.kept(module)  # what the forward and its hooks change in Python: as before, after
        try:
            with _state_restored(module), torch.enable_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                output = run(*call.args, **call.kwargs)
                outputs.append(tree_flatten(_opened(tree_map(_detached, output))))
        except Exception as error:
            return f"{'the graph' if outputs else 'the module'} failed on it: {short_error(error)}"
        finally:
            put_back()
    (expected, expected_spec), (got, got_spec) = outputs
    if expected_spec != got_spec:
        return f"the output's structure differs: {got_spec} instead of {expected_spec}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if type(a) is not type(b):
            return f"output {i} is a {type(b).__name__} instead of a {type(a).__name__}"
        if isinstance(a, torch.Tensor) and (a.dtype != b.dtype or a.shape != b.shape):
            return f"output {i} is {b.dtype} {tuple(b.shape)} instead of {a.dtype} {tuple(a.shape)}"
        if isinstance(a, torch.Tensor) and not _same_values(a, b):
            return f"output {i} has other values (largest difference {(a.double() - b.double()).abs().max():.3g})"
    return ""


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


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


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same values, NaN where the other has NaN (a fully masked row, say) included."""
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


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
        if node.target is _assert_is_none:
            placeholder, expected = node.args[0], None
        elif node.target is torch._assert and getattr(node.args[0], "target", None) is operator.eq:
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


# ------------------------------------------------------------------ timing such a graph safely


class GuardedNodeTimer(NodeTimer):
    """``NodeTimer`` for a graph traced on an example: a call the graph does not fit runs the module's own forward.

    ``install`` makes ``module.forward`` a wrapper that saves the random state (CPU, and CUDA on
    CUDA; NumPy's and Python's too when the graph draws host random numbers) and runs the instrumented graph. If the graph raises (a guard failed: the call takes
    another path than the example; or any other error), the wrapper restores the random state
    and the grad mode, discards everything the timer recorded (``reset``), runs the module's own forward with the
    same arguments and returns its result; ``mismatch`` then says why, ``on_mismatch`` is told,
    and later calls run the module's own forward without the graph. ``uninstall`` gives the
    module its own forward back, as ``NodeTimer`` does.

    Residual risk: work the graph did before the failing guard is not undone, except the random
    state. A module that changes a buffer in place ahead of a guard (batch-norm running
    statistics) would see that update twice; forward hooks of submodules that ran before the
    guard run twice. HuggingFace models put their guards ahead of such work, or have none.

    Args:
        traced: the graph from ``trace_on_example``.
        annotate, backward, device, trace_ranges: as for ``NodeTimer``.
        on_mismatch: called once, with the reason, when a call does not fit the graph.
    """

    def __init__(self, traced: fx.GraphModule, annotate: bool = False, backward: bool = True, device: str = "cpu",
                 on_mismatch: Callable[[str], None] | None = None, trace_ranges: bool = False) -> None:
        super().__init__(traced, annotate=annotate, backward=backward, device=device, trace_ranges=trace_ranges)
        self.mismatch: str | None = None
        self._on_mismatch = on_mismatch
        # NumPy's state costs ~30 us to save: only for a graph that draws host random numbers.
        # Also for a leaf of the model's own code or a custom autograd Function, which may draw them.
        self._host_random = any(node.meta.get(HOST_RANDOM) or isinstance(node.target, FunctionApply)
                                or (node.op == "call_module"
                                    and not type(traced.get_submodule(node.target)).__module__.startswith("torch."))
                                for node in traced.graph.nodes)

    def install(self, module: nn.Module, **options: Any) -> None:
        """``NodeTimer.install`` (same ``options``), with the graph's forward inside the guarded wrapper."""
        if id(module) in self._saved_forward:
            return
        own_forward = module.forward
        super().install(module, **options)
        graph_forward = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.mismatch is None and module.training is self._traced.training:  # only the graph's errors are caught
                random_state = random_states.save(cuda=self.on_cuda, host=self._host_random, every_device=False)
                grad_mode = torch.is_grad_enabled()
                try:
                    return graph_forward(*args, **kwargs)
                except Exception as error:  # the graph does not fit this call: it must not cost the user anything
                    random_states.restore(random_state)
                    torch._C._set_grad_enabled(grad_mode)  # a guard inside a no_grad block
                    self._stop_using_graph(short_error(error))
            return own_forward(*args, **kwargs)

        module.forward = forward

    def _stop_using_graph(self, reason: str) -> None:
        self.mismatch = reason
        self.reset()
        if self._on_mismatch is not None:
            with contextlib.suppress(Exception):  # a warning turned into an error must not reach training
                self._on_mismatch(reason)
