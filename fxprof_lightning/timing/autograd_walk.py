"""Small facts about tensors and the autograd graph that capture, timing and FLOP counting need."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fxprof_lightning import torch_api

__all__ = ["autograd_nodes", "sequence_nr_now", "tensors_in"]

sequence_nr_now = torch_api.sequence_nr_now  # the sequence number the next autograd node created will get


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
    pending = list(dict.fromkeys(fn for fn in roots if fn is not None and first <= torch_api.node_sequence_nr(fn) < end))
    seen = set(pending)
    while pending:
        fn = pending.pop()
        yield fn
        for next_fn, _ in fn.next_functions:
            if next_fn is not None and next_fn not in seen and first <= torch_api.node_sequence_nr(next_fn) < end:
                seen.add(next_fn)
                pending.append(next_fn)


