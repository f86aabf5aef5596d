"""The memory a model holds outside the activations, per module: its parameters, their gradients and the optimizer's
state for them, each tensor counted once, with the submodules' (a module's figure includes its children's).

The optimizers are those that step while a cycle is open (``OptimizerWatch``: torch.optim's global post-step hook,
which notes the optimizer and does nothing else), so that neither the Lightning callback nor a plain loop has to
name them."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fxprof_lightning.report import ModuleStats

__all__ = ["OptimizerWatch", "state_bytes", "with_state_bytes"]


class OptimizerWatch:
    """Notes every ``torch.optim.Optimizer`` that steps until ``close()`` (a weak reference each)."""

    def __init__(self) -> None:
        self.seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handle = register_optimizer_step_post_hook(self._note)

    def _note(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.seen.add(optimizer)

    def close(self) -> list[torch.optim.Optimizer]:
        """Stop watching; the optimizers seen."""
        self._handle.remove()
        return list(self.seen)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def state_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer] | None
                ) -> dict[str, tuple[int, int, int | None]]:
    """Module path -> bytes of (its parameters, their gradients, the optimizers' state for them), with its
    submodules'. A shared parameter counts for the first module that holds it; gradients are counted for the trainable
    parameters, at their size; the optimizer's state (None without ``optimizers``) sums the tensors each optimizer's
    ``state`` holds for the module's parameters (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    states = [optimizer.state for optimizer in optimizers or ()]
    totals: dict[str, list[int]] = {}
    for name, parameter in module.named_parameters():  # (each parameter once)
        held = [_nbytes(parameter), _nbytes(parameter) if parameter.requires_grad else 0, 0]
        for state in states:
            held[2] += sum(_nbytes(v) for v in state.get(parameter, {}).values() if isinstance(v, torch.Tensor))
        path = name.rpartition(".")[0]
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            total = totals.setdefault(".".join(parts[:depth]), [0, 0, 0])
            for k in range(3):
                total[k] += held[k]
    return {path: (p, g, o if optimizers else None) for path, (p, g, o) in totals.items()}


def with_state_bytes(modules: list[ModuleStats], module: nn.Module,
                     optimizers: list[torch.optim.Optimizer] | None) -> list[ModuleStats]:
    """The module rows with their parameters', gradients' and optimizer state's bytes (``state_bytes``; 0 for a
    module without parameters, None for a row that names no submodule: a compiled module's rows name Dynamo's)."""
    held = state_bytes(module, optimizers)
    empty, unknown = (0, 0, 0 if optimizers else None), (None, None, None)
    return [replace(m, param_bytes=p, grad_bytes=g, optimizer_bytes=o) for m in modules
            for p, g, o in (held.get(m.path, empty if _holds(module, m.path) else unknown),)]


def _holds(module: nn.Module, path: str) -> bool:
    """Whether ``module`` has a submodule at ``path``."""
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True
