"""Dynamo's rules changed while it captures: torch functions it traces into rather than keeps whole, the model's
hooks it runs eagerly (their frames skipped), ``torch.compiler.is_compiling()`` answered as eager answers it, and
torch's own checks that Dynamo cannot trace run as traceable twins while a timer is installed (``TRACEABLE``)."""

from __future__ import annotations

import contextlib
import os
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fxprof_lightning import torch_api
from fxprof_lightning.timing.forward_swap import own_class
from fxprof_lightning.timing.quiet import hold_dynamo_filters, release_dynamo_filters

__all__ = ["COMPILING", "TRACEABLE", "frames_skipped", "guarded_functions", "hooks_eager", "not_compiling", "opened_frames"]


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


def opened_frames(functions: tuple[Callable[..., Any], ...]) -> contextlib.AbstractContextManager[None]:
    """Let Dynamo trace into ``functions`` (rather than keep each call whole) inside the block."""
    return _traced_as(functions, None)


def frames_skipped(functions: tuple[Callable[..., Any], ...], skipped: bool) -> None:
    """Whether Dynamo leaves the frames of ``functions``, and the frames they call, to run eagerly (an eager hook's
    own frame, run after its graph break, would otherwise be captured as a graph of its own)."""
    torch_api.frames_skipped(functions, skipped)


def hooks_eager(functions: tuple[Callable[..., Any], ...]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, Dynamo breaks its graph at each call of ``functions`` (the model's hooks) and runs it eagerly,
    as a function of its own rules marks skipped: code that changes what Dynamo would guard on at every call (a hook
    that appends to a list: its length) then runs as eager runs it, and the graphs around it keep their guards."""
    return _traced_as(functions, torch_api.SkipFunctionVariable)


# What Dynamo answers for "are we compiling?" while it traces (constant-folded: no guard on it).
# ``torch.compiler.is_exporting`` too: Dynamo 2.11 answers it True while tracing (2.14 reads the real flag), and HF
# keeps its attention mask on that branch.
COMPILING = tuple(f for f in (torch.compiler.is_compiling, torch.compiler.is_dynamo_compiling,
                              torch_api.external_is_compiling, torch_api.utils_is_compiling,
                              getattr(torch.compiler, "is_exporting", None)) if f is not None)


@contextlib.contextmanager
def not_compiling(on: bool) -> Iterator[None]:
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


def _check_key_padding_mask(key_padding_mask: torch.Tensor, src_len: int, bsz: int) -> None:
    """``F._check_key_padding_mask`` as plain checks, the same conditions, error and message. The original passes its
    message to ``torch._check_with`` as a closure over the mask's shape, which Dynamo cannot trace: it breaks the
    graph inside the opened attention, which then stays one row whenever a padding mask is given."""
    if key_padding_mask.shape[0] != bsz:
        raise AssertionError(f"Expected key_padded_mask.shape[0] to be {bsz}, but got {key_padding_mask.shape[0]}")
    if key_padding_mask.shape[1] != src_len:
        raise AssertionError(f"Expected key_padded_mask.shape[1] to be {src_len}, but got {key_padding_mask.shape[1]}")


class _TraceableChecks:
    """While a ``DynamoTimer`` is installed, torch's own checks that Dynamo cannot trace run as traceable equivalents
    (``_check_key_padding_mask``; ``torch.compiler.is_exporting`` where this torch lacks it): each function keeps its identity and gets the other's code, since Dynamo guards on
    the code it traced (put back at uninstall, the graphs would miss their guards); and Dynamo's log filters stay on
    the handlers (``quiet.hold_dynamo_filters``). Counted: timers may overlap."""

    def __init__(self) -> None:
        self.users = 0
        self.original: Any = None  # torch's own code, while ours runs in its place

    def enter(self) -> None:
        self.users += 1
        if self.users == 1:
            torch_api.lend_missing_queries(True)
            torch_api.lend_stream_query(True)
            hold_dynamo_filters()  # (and a timed call's ``quiet_dynamo`` block only marks its thread)
        function = torch_api.check_key_padding_mask
        code, ours = getattr(function, "__code__", None), _check_key_padding_mask.__code__
        if self.users == 1 and code is not None and code.co_argcount == ours.co_argcount and not code.co_freevars:
            self.original, function.__code__ = code, ours

    def exit(self) -> None:
        self.users = max(self.users - 1, 0)
        if self.users == 0:
            torch_api.lend_missing_queries(False)
            torch_api.lend_stream_query(False)
            release_dynamo_filters()
        if self.users == 0 and self.original is not None:
            torch_api.check_key_padding_mask.__code__, self.original = self.original, None


TRACEABLE = _TraceableChecks()


def guarded_functions(root: torch.nn.Module, failures: list[str]) -> tuple[Callable[..., Any], ...]:
    """The plain Python functions (not a module's ``forward``) whose reads the failed guards were on (Dynamo ends each
    failure's lines with ``# file:line in function``): a helper that reads a step counter from a global makes Dynamo
    guard on its value, which changes at every call. Run eagerly, between graphs, it is a row of its own, named by
    the line that calls it. Found among the names of the module's forwards' globals."""
    places = {(os.path.basename(path), int(line), name)
              for failure in failures for path, line, name in re.findall(r"# (\S+):(\d+) in (\w+)", failure)}
    # Dynamo 2.6 gives no place: the globals its guards name (``G['STEP']``), read by a function a forward calls
    read = {name for failure in failures for name in re.findall(r"G\['(\w+)'\]", failure)} if not places else set()
    called = {name for module in root.modules()
              for name in getattr(getattr(own_class(module).forward, "__code__", None), "co_names", ())}
    found: dict[int, Callable[..., Any]] = {}
    for module in root.modules():
        for value in getattr(own_class(module).forward, "__globals__", {}).values():
            code = getattr(value, "__code__", None)
            if isinstance(value, types.FunctionType) and code.co_name != "forward" and (
                    (read & set(code.co_names) and code.co_name in called) or any(
                    name == code.co_name and os.path.basename(code.co_filename) == path and code.co_firstlineno <= line
                    for path, line, name in places)):
                found[id(value)] = value
    return tuple(found.values())
