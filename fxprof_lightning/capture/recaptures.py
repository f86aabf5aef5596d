"""What a capture made again learns: whether the guards that failed are on a state the call itself makes (it comes
back), on what a hook or a helper read (run it eagerly), or on something that changes at every call (refuse), and the
words ``Capture.recaptures`` gives for it. ``DynamoTimer._capture_call`` reads them."""

from __future__ import annotations

import functools
import os
import re
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from fxprof_lightning import torch_api

__all__ = ["RECAPTURES_IN_A_ROW", "VARYING_CALLS", "ParameterFlags", "global_hooks", "guarded_in", "hook_functions",
           "hooks_refusal", "in_a_row_refusal", "on_a_value_of_the_call", "recapture_reason", "run_eagerly",
           "untimed_text"]

# Timed calls that miss the guards this many times in a row, each right after a capture: the graphs are refused.
RECAPTURES_IN_A_ROW = 3
# A call made another number of graph calls than its state's, and the capture after it found no guard failing.
VARYING_CALLS = ("the forward's graph calls changed in number with no guard failing (its own control flow: a random "
                 "layer drop): a different count is no longer read as a miss")


def hook_functions(root: nn.Module) -> tuple[Callable[..., Any], ...]:
    """The Python functions of the forward hooks and pre-hooks on ``root`` and its submodules, as Dynamo inlines them
    (a bound method's function, a partial's, a callable object's ``__call__``)."""
    found = []
    for module in root.modules():
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            while isinstance(hook, functools.partial):
                hook = hook.func
            hook = getattr(hook, "__func__", hook)
            if isinstance(hook, nn.Module):  # its __call__ is every module's: left to Dynamo
                continue
            if not isinstance(hook, types.FunctionType):
                hook = getattr(type(hook).__call__, "__func__", type(hook).__call__)
            if isinstance(hook, types.FunctionType) and not getattr(hook, "_torchdynamo_disable", False):
                found.append(hook)
    return tuple(dict.fromkeys(found))


def on_a_value_of_the_call(failure: str) -> bool:
    """Whether the guard of a Dynamo guard failure is on a value made inside the forward's call (``___stack0...``: what
    a frame resumed after a graph break was handed, such as the tuple of hidden states a random layer drop shortened),
    not on the module, the inputs or a global (``L[...]``, ``G[...]``): such states recur from call to call."""
    guard = _guard_line(failure).split("#")[0]
    return "___stack" in guard and not re.search(r"\b[LG]\[", guard)


def global_hooks() -> tuple[tuple[int, ...], ...]:
    """The handles of the hooks every module runs (``register_module_forward_hook`` and its kin), which Dynamo inlines
    at capture and does not guard on: a change means capturing again."""
    return tuple(tuple(hooks) for hooks in torch_api.GLOBAL_MODULE_HOOKS)


class ParameterFlags:
    """The ``requires_grad`` of the module's parameters at a capture, where Dynamo's guards miss a flip of it
    (``torch_api.PARAMETER_FLAGS_GUARDED``): compared before each call (~30 ns a parameter)."""

    def __init__(self, module: nn.Module) -> None:
        self.named = list(module.named_parameters())
        self.flags = [p.requires_grad for _, p in self.named]

    def flipped(self) -> str | None:
        """Why the module must be captured again (a parameter's flag changed), or None."""
        if [p.requires_grad for _, p in self.named] == self.flags:
            return None
        changed = [name for (name, p), flag in zip(self.named, self.flags, strict=True) if p.requires_grad != flag]
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return (f"requires_grad of {shown} changed (torch {torch_api.TORCH}'s Dynamo does not guard on a module "
                "parameter's requires_grad; checked by fxprof_lightning)")


def guarded_in(functions: tuple[Callable[..., Any], ...], failures: list[str]) -> bool:
    """Whether a guard that failed was on a value read in one of ``functions`` (the model's hooks): Dynamo ends each
    failure's lines with ``# file:line in function``."""
    places = {(os.path.basename(f.__code__.co_filename), f.__code__.co_name) for f in functions}
    if any((os.path.basename(path), name) in places
           for failure in failures for path, name in re.findall(r"# (\S+):\d+ in (\w+)", failure)):
        return True
    # Dynamo 2.6 gives no place; its guard on what a hook read names the hook's closure variable: ``L['counts']``
    free = {name for f in functions for name in f.__code__.co_freevars}
    return any(name in free for failure in failures for name in re.findall(r"L\['(\w+)'\]", failure))


def run_eagerly(functions: tuple[Callable[..., Any], ...]) -> str:
    """What runs eagerly: the functions found (``guarded_functions``), or the model's hooks."""
    if not functions:
        return "the model's forward hooks run eagerly"
    return ", ".join(f"{f.__name__} ({os.path.basename(f.__code__.co_filename)}:{f.__code__.co_firstlineno})"
                     for f in functions) + (" run" if len(functions) > 1 else " runs") + " eagerly"


def hooks_refusal(untimed: list[str]) -> str:
    shown = untimed[:5] + [f"{len(untimed) - 5} more"] * (len(untimed) > 5)
    return (f"with the model's forward hooks run eagerly, between graphs, {', '.join(shown)} ran outside Dynamo's "
            "graphs, untimed (a graph break inside a loop, here at a hook's call, makes Dynamo run that loop's whole "
            "frame eagerly)")


def recapture_reason(reason: str, failures: list[str]) -> str:
    """``reason`` with the first line of each of Dynamo's guard failures since the last capture (what changed)."""
    if not failures or reason == "first call":
        return reason
    firsts = (re.sub(r"\s+", " ", _guard_line(f)).strip() for f in failures)
    return f"{reason}: {'; '.join(dict.fromkeys(firsts))}"


def _guard_line(failure: str) -> str:
    """A Dynamo guard failure's first line, the guard and where it was read, without its ``frame/compile:`` prefix (the
    lines after it are the user's stack)."""
    lines = failure.strip().splitlines()
    return re.sub(r"^\d+/\d+: ", "", lines[0]) if lines else ""


def in_a_row_refusal(reason: str) -> str:
    return (f"the graphs missed Dynamo's guards at {RECAPTURES_IN_A_ROW} calls in a row, each right after a capture "
            f"({reason}): the code changes what Dynamo guards on at every call (a forward that appends to a list makes "
            "it guard on the list's length; the model's forward hooks already ran eagerly), so no graph would ever be "
            "used")


def untimed_text(misses: int, last: str) -> str:
    """Why calls of the cycle ran untimed: ``misses`` calls failed a guard, the last capture's reason ``last``."""
    return (f"{misses} call(s) failed Dynamo's guards and ran the module's own code, untimed; each next call "
            f"captured it again. The last reason: {last}. When the calls right after {RECAPTURES_IN_A_ROW} "
            "captures in a row all fail (a hook that appends to a list makes Dynamo guard on the list's length), "
            "the model's forward hooks run eagerly, between graphs; if that does not help, the graphs are refused.")
