"""Shared test models and helpers: small real LightningModules trained by real Trainers.

Test files import these with ``from helpers import ...``; pytest puts ``tests/`` on ``sys.path`` (tests/conftest.py
makes sure of it), and subprocess scripts insert the directory themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["LitClassifier", "SmallNet", "image_loader", "make_trainer", "notices", "read_events"]


class SmallNet(nn.Module):
    """Modules, functional calls and tensor methods: every kind of FX node."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = x.mean(dim=(2, 3))
        return self.head(self.drop(x))


class LitClassifier(pl.LightningModule):
    """Trains ``self.model`` with cross-entropy and SGD."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model if model is not None else SmallNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def image_loader(samples: int = 64, batch_size: int = 4, size: int = 8, classes: int = 4, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, size, size, generator=generator)
    y = torch.randint(0, classes, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def make_trainer(root: Path, callbacks: list, max_steps: int, logger: bool | TensorBoardLogger = True, **kwargs) -> pl.Trainer:
    if logger is True:
        logger = TensorBoardLogger(save_dir=str(root), name="logs")
    return pl.Trainer(
        default_root_dir=str(root),
        logger=logger,
        callbacks=callbacks,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        **kwargs,
    )


def read_events(log_dir) -> EventAccumulator:
    """Everything a TensorBoard run directory holds, as TensorBoard reads it."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def notices(*phrases: str) -> pytest.MarkDecorator:
    """The profiler's notices (``FxprofWarning``) a test expects to see, each by a phrase of its message: the suite
    makes every other one an error (pyproject's ``filterwarnings``)."""
    return pytest.mark.filterwarnings(*(f"ignore:.*{re.escape(p)}:fxprof_lightning.FxprofWarning" for p in phrases))


def resnet18(**kwargs) -> nn.Module:
    """torchvision's ResNet18; the test is skipped where torchvision has no release for this torch (2.15 today)."""
    torchvision = pytest.importorskip("torchvision", reason="no torchvision release for this torch")
    return torchvision.models.resnet18(**kwargs)



def trace_module(model: nn.Module) -> torch.fx.GraphModule:
    """The model's graph for a ``NodeTimer`` of its own (tests of node timing itself): torch.fx's public tracing."""
    return torch.fx.symbolic_trace(model)


def own_forward(module: nn.Module) -> bool:
    """Whether ``module`` runs its own forward: no timed forward on it, in its ``__dict__`` or by its class swapped for
    a recorded step (``timing.forward_swap``)."""
    return "forward" not in vars(module) and type(module).forward.__name__ != "_timed_forward"
