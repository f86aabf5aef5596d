"""The Python state a model's forward and its hooks change, kept before a checking call and put back after it.

A capture runs the user's forward more than training does: once eagerly for reference, once (or more) through
Dynamo to check the graphs against it, each forward with a backward of its own. Without this, a hook that counts
its calls or stores activations would see those calls too. Put back after each checking call, so that the hooks'
side effects happen exactly as often as training calls the model:

* every module's own attributes that are not tensors or modules (``self.calls += 1`` in a forward);
* what each hook (forward, pre-forward and backward hooks of every module, hooks on parameters, global module hooks)
  can reach: its closure cells, its object's attributes (a bound method, a module's too, such as the LightningModule's;
  a callable object; a ``functools.partial``'s arguments) and the module globals its code names;
* inside those, lists, dicts, sets and objects' attributes two levels down (``activations[name].append(out)``), and
  tensors that are not parameters or buffers (a running total updated in place).

What is out of that reach (a file written, a tensor three containers down) is not put back.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxprof_lightning import torch_api

Restore = Callable[[], None]
PLAIN_DICTS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
DEPTH = 2  # containers inside containers followed


def kept(root: nn.Module) -> Restore:
    """Keep the Python state ``root``'s forward and hooks can change; the function returned puts it back."""
    model_tensors = {id(t) for t in (*root.parameters(), *root.buffers())}
    restores: list[Restore] = []
    for module in root.modules():
        restores.append(_attributes(module.__dict__, model_tensors, skip_tensors=True))
    for hook in _hooks(root):
        restores += _reach(hook, model_tensors)

    def restore() -> None:
        for undo in restores:
            with contextlib.suppress(Exception):  # something that refuses to be changed back: left as it is
                undo()

    return restore


def _hooks(root: nn.Module) -> list[Any]:
    found = [hook for hooks in torch_api.GLOBAL_MODULE_HOOKS for hook in hooks.values()]
    for holder in root.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            found += list((getattr(holder, name, None) or {}).values())
    for parameter in root.parameters():
        found += list((parameter._backward_hooks or {}).values())
        found += list((getattr(parameter, "_post_accumulate_grad_hooks", None) or {}).values())
    return found


def _reach(hook: Any, model_tensors: set[int]) -> list[Restore]:
    """Restores for what ``hook`` can change: closure cells, its object's attributes, the globals its code names."""
    restores: list[Restore] = []
    if _ours(hook):
        return restores
    while isinstance(hook, functools.partial):
        restores += [_value(v, model_tensors, DEPTH) for v in (*hook.args, *hook.keywords.values())]
        hook = hook.func
    if isinstance(hook, types.MethodType):
        owner = hook.__self__  # a module's method: the LightningModule's, counting in ``self.calls`` (its own state)
        restores.append(_attributes(owner.__dict__, model_tensors, skip_tensors=True) if isinstance(owner, nn.Module)
                        else _value(owner, model_tensors, DEPTH))
        hook = hook.__func__
    if not isinstance(hook, types.FunctionType):
        if isinstance(hook, nn.Module):
            return restores
        restores.append(_value(hook, model_tensors, DEPTH))
        hook = getattr(type(hook).__call__, "__func__", type(hook).__call__)
    if isinstance(hook, types.FunctionType):
        for cell in hook.__closure__ or ():
            restores.append(_cell(cell, model_tensors))
        names = [n for n in hook.__code__.co_names if n in hook.__globals__]
        restores.append(_attributes(hook.__globals__, model_tensors, names=names))
    return restores


def _cell(cell: types.CellType, model_tensors: set[int]) -> Restore:
    try:
        value = cell.cell_contents
    except ValueError:  # not yet bound
        return _nothing
    inner = _value(value, model_tensors, DEPTH)

    def restore() -> None:
        cell.cell_contents = value
        inner()

    return restore


def _attributes(values: dict[str, Any], model_tensors: set[int], skip_tensors: bool = False,
                names: list[str] | None = None, depth: int = DEPTH) -> Restore:
    """Put back the entries of ``values`` (a module's or an object's ``__dict__``, a module's globals: only ``names``)
    that were there and are plain data, and remove those added (not for globals)."""
    keys = list(values) if names is None else names
    saved = {k: values[k] for k in keys if _plain(values[k], skip_tensors)}
    inner = [_value(v, model_tensors, depth) for v in saved.values()]
    before = set(values) if names is None else None

    def restore() -> None:
        for key, value in saved.items():
            if values.get(key, _MISSING) is not value:
                values[key] = value
        if before is not None:
            for key in [k for k in values if k not in before and _plain(values[k], skip_tensors)]:
                del values[key]
        for undo in inner:
            undo()

    return restore


def _value(value: Any, model_tensors: set[int], depth: int) -> Restore:
    """Put back the contents of a container, an object's attributes, a tensor's values (not the model's)."""
    if depth < 0:
        return _nothing
    if isinstance(value, torch.Tensor):
        if id(value) in model_tensors or isinstance(value, nn.Parameter) or value.requires_grad:
            return _nothing
        copy = value.detach().clone()

        def restore_tensor() -> None:
            if value.shape == copy.shape and not torch.equal(value, copy):
                with torch.no_grad():
                    value.copy_(copy)

        return restore_tensor
    if type(value) is list:
        items = list(value)
        inner = [_value(v, model_tensors, depth - 1) for v in items]

        def restore_list() -> None:
            if len(value) != len(items) or any(a is not b for a, b in zip(value, items, strict=True)):
                value[:] = items
            for undo in inner:
                undo()

        return restore_list
    if type(value) in PLAIN_DICTS:  # (not a subclass that refuses changes: diffusers' FrozenDict)
        entries = dict(value)
        inner = [_value(v, model_tensors, depth - 1) for v in entries.values()]

        def restore_dict() -> None:
            if len(value) != len(entries) or any(value.get(k, _MISSING) is not v for k, v in entries.items()):
                value.clear()
                value.update(entries)
            for undo in inner:
                undo()

        return restore_dict
    if type(value) is set:
        members = set(value)

        def restore_set() -> None:
            if value != members:
                value.clear()
                value.update(members)

        return restore_set
    if _has_attributes(value):
        return _attributes(vars(value), model_tensors, skip_tensors=False, depth=depth - 1)
    return _nothing


def _plain(value: Any, skip_tensors: bool) -> bool:
    """Data a forward or hook may change (not code, modules, classes or, for a module's attributes, tensors)."""
    if isinstance(value, nn.Module | type | types.ModuleType | types.FunctionType | types.MethodType
                  | types.BuiltinFunctionType | functools.partial):
        return False
    return not (skip_tensors and isinstance(value, torch.Tensor))


def _has_attributes(value: Any) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(value, nn.Module | type | types.ModuleType)
            and not callable(getattr(value, "__get__", None)) and type(value).__module__ != "builtins"
            and not _ours(value))


def _ours(value: Any) -> bool:
    """The profiler's own hooks and objects (its timers' logs are not the user's state)."""
    function = getattr(value, "__func__", value)
    while isinstance(function, functools.partial):
        function = function.func
    module = getattr(function, "__module__", None) or type(value).__module__
    return module.split(".")[0] == __name__.split(".")[0]


def _nothing() -> None:
    pass


_MISSING = object()
