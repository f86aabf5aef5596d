"""The one place random state is saved and put back: torch's on the CPU and on every CUDA device in use, Python's
and NumPy's. What the profiler runs that training must not notice (the capture's checking calls, tracing on an
example, the FLOP pass, a graph call that did not fit) leaves every generator as it found it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

try:
    import numpy
except ImportError:  # pragma: no cover - torch installs it in practice
    numpy = None

__all__ = ["kept", "restore", "same", "save"]


def save(cuda: bool = True, host: bool = True, every_device: bool = True) -> dict[str, Any]:
    """Every generator's state, by a name a message can show: ``torch CPU``, ``CUDA`` (where CUDA is in use and
    ``cuda``: every device's, or the current device's alone without ``every_device``, for a call made at every step),
    ``Python`` and ``NumPy`` (with ``host``; NumPy's costs about 10 us, so a call made at every step leaves them out
    where nothing draws from them)."""
    states: dict[str, Any] = {"torch CPU": torch.get_rng_state()}
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        if every_device:
            states["CUDA"] = torch.cuda.get_rng_state_all()
        else:
            states["CUDA (current device)"] = (torch.cuda.current_device(), torch.cuda.get_rng_state())
    if host:
        states["Python"] = random.getstate()
        if numpy is not None:
            states["NumPy"] = numpy.random.get_state()
    return states


def restore(states: dict[str, Any]) -> None:
    """Put back what ``save`` returned."""
    torch.set_rng_state(states["torch CPU"])
    if "CUDA" in states:
        torch.cuda.set_rng_state_all(states["CUDA"])
    if "CUDA (current device)" in states:
        device, state = states["CUDA (current device)"]
        torch.cuda.set_rng_state(state, device)
    if "Python" in states:
        random.setstate(states["Python"])
    if "NumPy" in states:
        numpy.random.set_state(states["NumPy"])


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Every generator as before, after the block (also when it raises)."""
    states = save()
    try:
        yield
    finally:
        restore(states)


def same(a: Any, b: Any) -> bool:
    """Whether two saved states (or one generator's, from ``save``) are equal: tensors, NumPy arrays, nested tuples."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a).__name__ == "ndarray":
        return type(b).__name__ == "ndarray" and a.shape == b.shape and bool((a == b).all())
    return a == b
