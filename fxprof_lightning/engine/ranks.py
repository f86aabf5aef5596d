"""The ranks of a distributed run, as the engine sees them: this process's rank and the world's size, and the two
collectives it uses (every rank's value; rank 0's value). Without ``torch.distributed`` initialised: one rank."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_gather", "broadcast", "distributed", "global_rank", "world_size"]


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` when not distributed)."""
    if not distributed() or torch.distributed.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself when not distributed)."""
    if not distributed() or torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def global_rank() -> int:
    """Global rank from ``torch.distributed`` (0 when it is not initialised)."""
    return torch.distributed.get_rank() if distributed() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if distributed() else 1
