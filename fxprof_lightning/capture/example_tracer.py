"""The tracer of rung 3 (``ExampleTracer``): it runs every node on the recorded call and answers Python's questions
about proxies (truth, ``len``, iteration, ints, static tensor attributes) from those values, each with a guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning.capture.example_guards import check_attribute, check_index, check_length, check_truth
from fxprof_lightning.capture.leaves import LeafProxy, LeafTracer, holds_traced
from fxprof_lightning.capture.rebuild import Rebuild
from fxprof_lightning.capture.recorded_call import PLAIN_CONSTANTS, copy_tensors
from fxprof_lightning.nodes import mark_untimed
from fxprof_lightning.timing import random_states

__all__ = ["ExampleProxy", "ExampleTracer", "state_restored"]

# Tensor attributes read from the example as constants (guarded by ``check_attribute``).
STATIC_ATTRIBUTES = ("dtype", "device", "layout", "ndim", "is_cuda", "is_sparse", "is_quantized", "is_meta")
_MISSING = object()


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
        self.examples = copy_tensors(examples)  # evaluating may change them in place
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
        with _patched_len(self), state_restored(root), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the model's own warnings already showed in eager mode
            return super().trace(root, concrete_args)


@contextlib.contextmanager
def state_restored(module: nn.Module) -> Iterator[None]:
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
