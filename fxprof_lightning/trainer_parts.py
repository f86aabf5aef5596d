"""What the Lightning callback (``callback.FXProfilerCallback``) reads from the Trainer and the LightningModule: the
module to time (``module=``), a batch's size, where to print, the directory, the sinks and the clock of a step's
phases it hands the engine at ``setup``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from fxprof_lightning import FxprofWarning
from fxprof_lightning.capture.children import timed_children
from fxprof_lightning.engine.step_phases import PhaseClock
from fxprof_lightning.layout import DEFAULT_DIRPATH
from fxprof_lightning.outputs.sinks import ConsoleSink, CsvSink, PictureSink, Sink
from fxprof_lightning.outputs.trackers import LoggerSink
from fxprof_lightning.timing.forward_swap import own_class

__all__ = ["batch_size", "log_dir", "module_to_time", "phase_clock", "printer", "trainer_sinks"]


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


def log_dir(trainer: pl.Trainer) -> Path:
    """Where the callback writes without ``dirpath=``: ``fxprof`` under the Trainer's log directory."""
    return Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_DIRPATH


def trainer_sinks(trainer: pl.Trainer, out_dir: Path) -> list[Sink]:
    """The callback's own sinks: the CSV and ``cycle.jsonl``, the pictures, the Trainer's loggers, the console (through
    the progress bar, naming TensorBoard's directory where it logs there). Warns when the Trainer has no logger."""
    if not trainer.loggers:
        rank_zero_warn("FXProfilerCallback: the Trainer has no logger, so no scalars or text are logged; "
                       f"the per-cycle CSV and traces are still written under {out_dir}", category=FxprofWarning)
    logdir = next((lg.root_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), out_dir)
    return [CsvSink(), PictureSink(), LoggerSink(trainer.loggers), ConsoleSink(logdir=logdir, write=printer(trainer))]


def phase_clock(trainer: pl.Trainer, state_key: str) -> Callable[[], PhaseClock]:
    """Makes the clock of a recorded step's phases, from what Lightning tells its profiler (made inside the callback's
    ``on_train_batch_end``, named ``[Callback]<state_key>``)."""
    own = f"[Callback]{state_key}"
    return functools.partial(PhaseClock, trainer.profiler, own, inside=f"{own}.on_train_batch_end")


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
