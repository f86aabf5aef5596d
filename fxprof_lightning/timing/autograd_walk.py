"""Small facts about tensors, the autograd graph and random states that capture, timing and FLOP counting need."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

try:
    import numpy
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    numpy = None

__all__ = ["autograd_nodes", "host_random_state", "random_states_kept", "sequence_nr_now", "set_host_random_state",
           "tensors_in"]

sequence_nr_now = torch.autograd._get_sequence_nr  # the sequence number the next autograd node created will get


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple/list/dict output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def autograd_nodes(roots: list[Any], first: int, end: int) -> Iterator[Any]:
    """The autograd nodes with sequence numbers in [first, end) that ``roots`` reach (those in the range included)."""
    pending = list(dict.fromkeys(fn for fn in roots if fn is not None and first <= fn._sequence_nr() < end))
    seen = set(pending)
    while pending:
        fn = pending.pop()
        yield fn
        for next_fn, _ in fn.next_functions:
            if next_fn is not None and next_fn not in seen and first <= next_fn._sequence_nr() < end:
                seen.add(next_fn)
                pending.append(next_fn)


def host_random_state() -> tuple[Any, Any]:
    """Python's and NumPy's random states."""
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def set_host_random_state(state: tuple[Any, Any]) -> None:
    random.setstate(state[0])
    if state[1] is not None:
        numpy.random.set_state(state[1])


@contextlib.contextmanager
def random_states_kept(cuda_devices: list[int] | tuple[int, ...] = ()) -> Iterator[None]:
    """Torch's random state on the CPU (and the given CUDA devices), NumPy's and Python's are as before, after.

    For work the user's training must not notice: tracing on an example, the output check, the FLOP pass.
    """
    host = host_random_state()
    with torch.random.fork_rng(devices=list(cuda_devices)):
        try:
            yield
        finally:
            set_host_random_state(host)
