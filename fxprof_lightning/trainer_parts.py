"""What the Lightning callback (``callback.FXProfilerCallback``) reads from the Trainer and the LightningModule: the
module to time (``module=``), a batch's size, where to print."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from fxprof_lightning.capture.children import timed_children
from fxprof_lightning.timing.forward_swap import own_class

__all__ = ["batch_size", "module_to_time", "printer"]


def module_to_time(pl_module: pl.LightningModule, path: str | None) -> nn.Module:
    """The submodule of ``pl_module`` at ``path`` (the callback's ``module=``), or a ValueError listing the children
    that do exist. Without ``module=``: the LightningModule where it has a ``forward`` of its own, else its one child
    with parameters (the model its ``training_step`` calls); with several such children (a GAN's generator and
    discriminator), the LightningModule, whose children are then each captured on their own (``capture.children``);
    ``module=`` picks one."""
    module: nn.Module = pl_module
    if path is None and own_class(module).forward is pl.LightningModule.forward:
        children = timed_children(module)
        if len(children) == 1:
            return next(iter(children.values()))
    for depth, part in enumerate(path.split(".") if path else []):
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            where = ".".join(path.split(".")[:depth]) or type(pl_module).__name__
            children = [name for name, _ in module.named_children()] or ["(none)"]
            raise ValueError(f"FXProfilerCallback(module={path!r}): {where} has no submodule {part!r}. "
                             f"Its child modules are: {', '.join(children)}")
        module = child
    return module


def printer(trainer: pl.Trainer) -> Callable[[str], None]:
    """Prints through the Trainer's progress bar (its ``print`` writes above a running bar), else ``print``."""
    bar = trainer.progress_bar_callback
    return bar.print if bar is not None else print


def batch_size(batch: Any) -> int | None:
    """Samples in a batch, as Lightning counts them for its logs (None when it cannot tell)."""
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    if isinstance(first, torch.Tensor):  # what extract_batch_size finds first, without its walk (~30 us in a step)
        return 1 if first.ndim == 0 else first.size(0)
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return extract_batch_size(batch)
    except Exception:
        return None
