"""Dynamo's rules changed while it captures: torch functions it traces into rather than keeps whole, the model's
hooks it runs eagerly (their frames skipped), and ``torch.compiler.is_compiling()`` answered as eager answers it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fxprof_lightning import torch_api

__all__ = ["COMPILING"]


@contextlib.contextmanager
def _traced_as(functions: tuple[Callable[..., Any], ...], rule: type | None) -> Iterator[None]:
    """Inside the block, Dynamo's trace rule for each of ``functions`` is ``rule`` (None: none, so that Dynamo traces
    into it as into the user's code); the rules there were before are put back after."""
    rules = torch_api.trace_rules.get_torch_obj_rule_map()
    saved = {f: rules.pop(f) for f in functions if f in rules}
    if rule is not None:
        rules.update(dict.fromkeys(functions, rule))
    try:
        yield
    finally:
        for function in functions:
            rules.pop(function, None)
        rules.update(saved)


def _opened(functions: tuple[Callable[..., Any], ...]) -> contextlib.AbstractContextManager[None]:
    """Let Dynamo trace into ``functions`` (rather than keep each call whole) inside the block."""
    return _traced_as(functions, None)


def _frames_skipped(functions: tuple[Callable[..., Any], ...], skipped: bool) -> None:
    """Whether Dynamo leaves the frames of ``functions``, and the frames they call, to run eagerly (an eager hook's
    own frame, run after its graph break, would otherwise be captured as a graph of its own)."""
    torch_api.frames_skipped(functions, skipped)


def _hooks_eager(functions: tuple[Callable[..., Any], ...]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, Dynamo breaks its graph at each call of ``functions`` (the model's hooks) and runs it eagerly,
    as a function of its own rules marks skipped: code that changes what Dynamo would guard on at every call (a hook
    that appends to a list: its length) then runs as eager runs it, and the graphs around it keep their guards."""
    return _traced_as(functions, torch_api.SkipFunctionVariable)


# What Dynamo answers for "are we compiling?" while it traces (constant-folded: no guard on it).
COMPILING = tuple(f for f in (torch.compiler.is_compiling, torch.compiler.is_dynamo_compiling,
                              torch_api.external_is_compiling, torch_api.utils_is_compiling) if f is not None)


@contextlib.contextmanager
def _not_compiling(on: bool) -> Iterator[None]:
    """Inside the block (``on``), Dynamo answers ``torch.compiler.is_compiling()`` and its aliases with False, so the
    traced code takes the branches eager takes (or breaks the graph where those cannot be traced)."""
    if not on:
        yield
        return
    answers = torch_api.compiling_answers()
    saved = {f: answers[f] for f in COMPILING if f in answers}
    answers.update(dict.fromkeys(saved, False))
    try:
        yield
    finally:
        answers.update(saved)
