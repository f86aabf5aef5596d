"""Objects the forward built from traced values (a ``DynamicCache``), built again from the graph's values at each
call (``Rebuild``), as HuggingFace's pytree flattening of caches for ``torch.export`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning.capture.leaves import holds_traced, slot_names

__all__ = ["Rebuild"]


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
