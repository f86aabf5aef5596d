"""The recorded call of rung 3: one call's arguments copied (``Example``, recorded by ``observe_first_call``), and
the forward with an explicit signature for that call (``example_forward``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fxprof_lightning import torch_api

__all__ = ["PLAIN_CONSTANTS", "Example", "copy_tensors", "example_forward", "observe_first_call"]

# Argument values that become constants of the graph (each guarded by ``check_argument``).
PLAIN_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class Example:
    """The arguments of one call of a module; tensors are copies (detached, ``requires_grad`` kept)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def copy_of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Example:
        return cls(copy_tensors(tuple(args)), copy_tensors(dict(kwargs)))


def copy_tensors(tree: Any) -> Any:
    """``tree`` with each tensor copied (detached, ``requires_grad`` kept)."""
    return torch_api.tree_map(_copy_tensor, tree)


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
