"""The guards of the graphs Dynamo captured for a forward's own frame, asked before a timed call (``EntryGuards``)."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fxprof_lightning import torch_api

__all__ = ["EntryGuards"]


@dataclass
class EntryGuards:
    """The guards of the graphs Dynamo captured for the forward's own frame, asked before a call: a call in a state no
    graph was captured for (a module called with and without grad, a new input shape) is then captured on that
    call, rather than run untimed with the next call captured in its place. ``code`` is the frame's code (Dynamo's
    ``wrap_inline`` frame around a forward of torch's own), ``bound`` the object of a bound method, ``free`` the
    values of its closure, ``function`` the function itself."""

    code: types.CodeType
    signature: inspect.Signature
    bound: tuple[Any, ...]
    free: dict[str, Any]
    region: int | None  # the context's own cache (``torch_api.region_of``; None: the code object's own)
    function: types.FunctionType

    def __post_init__(self) -> None:
        self._runs: dict[types.CodeType, Callable[..., Any] | None] = {}  # Dynamo's code for a capture, as a function
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in self.signature.parameters.values())
        self._positional = tuple(self.signature.parameters) if plain else None  # (None: ``bind`` pairs them)
        kinds = [(p.kind, name) for name, p in self.signature.parameters.items()]
        # ``(*args, **kwargs)``: Dynamo's ``wrap_inline`` frame around a forward of torch's own (``nn.Sequential``)
        starred = [kind for kind, _ in kinds] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
        self._starred = (kinds[0][1], kinds[1][1]) if starred and not self.bound else None
        self._defaults = {n: p.default for n, p in self.signature.parameters.items() if p.default is not p.empty}

    @classmethod
    def of(cls, compiled: Callable[..., Any], context: Any) -> EntryGuards | None:
        """For the function a Dynamo ``context`` wrapped (``compiled``: what the context returned)."""
        forward = getattr(compiled, "__wrapped__", None)
        function = getattr(forward, "__func__", forward)
        if not isinstance(function, types.FunctionType):
            return None
        bound = (forward.__self__,) if isinstance(forward, types.MethodType) else ()
        cells = function.__closure__ or ()
        try:
            free = {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, cells, strict=True)}
        except ValueError:  # an empty cell
            return None
        return cls(function.__code__, inspect.signature(function, follow_wrapped=False), bound, free,
                   torch_api.region_of(context), function)

    def _locals(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The frame's arguments and closure by name (None: the call does not fit the signature). Positional arguments
        of a plain signature are paired with their names directly, and ``(*args, **kwargs)`` takes them whole
        (``Signature.bind`` costs 2-5 us a call)."""
        if self._starred is not None:
            return {self._starred[0]: args, self._starred[1]: kwargs, **self.free}
        given = (*self.bound, *args)
        names = self._positional
        if not kwargs and names is not None and len(given) <= len(names) and all(n in self._defaults
                                                                               for n in names[len(given):]):
            return {**dict(zip(names, given)), **{n: self._defaults[n] for n in names[len(given):]}, **self.free}
        try:
            arguments = self.signature.bind(*given, **kwargs)
        except TypeError:
            return None
        arguments.apply_defaults()
        return {**arguments.arguments, **self.free}

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | None, str]:
        """The state of a call: the graph captured for the frame whose guards it passes (an id), or how it would miss
        them all (their first failing guard); (None, '') where that cannot be told."""
        entries, frame_locals, fits = self._fit(args, kwargs)
        if fits is not None:
            return id(fits.guard_manager), ""
        if frame_locals is None:
            return None, ""
        failed = entries[0].guard_manager.check_verbose(frame_locals).verbose_code_parts
        return None, re.sub(r"L\['([^']+)'\]", r"\1", str(failed[0]).strip()) if failed else "a guard failed"  # as Dynamo says it

    def fitting(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | None, Callable[..., Any] | None]:
        """The state of a call whose guards one capture passes (as ``check`` tells it), and that capture's frame code
        (the bytecode Dynamo made, which calls its graph) as the forward's own function, bound as it is: run directly,
        the call does what Dynamo's frame evaluation would do after asking the same guards again. (None, None) where
        no capture fits or that cannot be told (``check`` then says why)."""
        fits = self._fit(args, kwargs)[2]
        if fits is None:
            return None, None
        if fits.code not in self._runs:
            self._runs[fits.code] = self._as_function(fits.code)
        return id(fits.guard_manager), self._runs[fits.code]

    def _fit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any] | None, Any]:
        """Dynamo's cache entries for the frame, the frame's locals as the call would start it (None: none cached, or
        the call does not fit the signature), and the first entry whose guards they pass (None: none)."""
        entries = torch_api.cache_entries(self.code, self.region)
        frame_locals = self._locals(args, kwargs) if entries else None
        fits = None if frame_locals is None else next((e for e in entries if e.guard_manager.check(frame_locals)), None)
        return entries, frame_locals, fits

    def _as_function(self, code: types.CodeType) -> Callable[..., Any] | None:
        """``code`` with the function's globals (where Dynamo put the graphs it calls), defaults and closure, bound to
        the same object; None where the code does not fit them (its free variables are not the function's)."""
        function = self.function
        if code.co_freevars != function.__code__.co_freevars:
            return None
        run = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                                 function.__closure__)
        run.__kwdefaults__ = function.__kwdefaults__
        return types.MethodType(run, self.bound[0]) if self.bound else run
