"""The guards a graph traced on an example runs: each checks again, at every call, an answer the example gave while
tracing, and raises ``GraphMismatch`` where the call does not fit. Bookkeeping, not timed.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = ["GUARDS", "GraphMismatch", "check_argument", "check_attribute", "check_index", "check_length", "check_truth"]


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
