"""Putting a timed forward on a module for a step, and taking it off, without writing into the module's ``__dict__``.

A write into a module's ``__dict__`` (``module.forward = ...``) changes the dict's version tag. Dynamo's guards skip
an ``nn.Module``'s whole subtree while the version tags of the dicts under it are those of the last check
(``use_recursive_dict_tags_for_guards``), and stop doing so for good once one differs: a forward written into the
module at every recorded step made every later guard check the full one (MLP-300: 160 us a call against 20).

So for the step the module's class is a subclass of its own whose ``forward`` runs the timed forward
(``put_forward``), and the class is given back after it (``take_forward``). The subclass has the class's name, and
pickles and copies as the class itself; a copy made while the module was timed (``copy.deepcopy``) runs its own
forward. A module with a forward of its own in ``__dict__`` (a library's wrapper) gets the timed one there, as
before, since a forward in ``__dict__`` comes before the class's.
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["own_class", "put_forward", "take_forward"]

_SUBCLASSES: dict[type, type] = {}  # a module class -> the subclass a timed module of it has for the step
_SWAPPED: set[type] = set()  # those subclasses
_FORWARDS: dict[int, Callable[..., Any]] = {}  # id(module) -> the timed forward it runs (while its class is swapped)


def _timed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = _FORWARDS.get(id(self))
    if forward is None:  # (a copy of a timed module, or one its class was given to otherwise: its own forward)
        return super(type(self), self).forward(*args, **kwargs)
    return forward(*args, **kwargs)


def _reduce_ex(self: nn.Module, protocol: Any) -> Any:
    """Pickled and copied as an instance of the class itself (pickle refuses ``copyreg.__newobj__`` of another class
    than the object's: ``copyreg._reconstructor`` makes it, as protocols 0 and 1 do)."""
    reduced = super(type(self), self).__reduce_ex__(protocol)
    if not (isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1] and reduced[1][0] is type(self)):
        return reduced
    base = type(self).__base__
    if reduced[0] is copyreg.__newobj__ and len(reduced[1]) == 1:
        return (copyreg._reconstructor, (base, object, None), *reduced[2:])
    return (reduced[0], (base, *reduced[1][1:]), *reduced[2:])


def _subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": _timed_forward, "__reduce_ex__": _reduce_ex,
                                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _SWAPPED.add(_SUBCLASSES[cls])
    return _SUBCLASSES[cls]


def own_class(module: nn.Module) -> type:
    """The module's class, also while a timed forward is on it (its class then the subclass of it)."""
    cls = type(module)
    return cls.__base__ if cls in _SWAPPED else cls


def put_forward(module: nn.Module, forward: Callable[..., Any]) -> Any:
    """Make ``module(...)`` run ``forward``; what ``take_forward`` needs to undo it."""
    cls = type(module)
    if "forward" not in vars(module) and cls not in _SWAPPED:  # (timed twice at once: the dict, as before)
        try:
            module.__class__ = _subclass(cls)
        except TypeError:  # (a class whose layout a subclass cannot take: __slots__, a C type's)
            pass
        else:
            _FORWARDS[id(module)] = forward
            return cls
    saved = vars(module).get("forward")
    module.forward = forward
    return (saved,)


def take_forward(module: nn.Module, saved: Any) -> None:
    """Give ``module`` its own forward back (``saved``: ``put_forward``'s answer)."""
    if isinstance(saved, type):
        _FORWARDS.pop(id(module), None)
        if type(module) is _SUBCLASSES.get(saved):
            module.__class__ = saved
    elif saved[0] is None:
        vars(module).pop("forward", None)
    else:
        module.forward = saved[0]
