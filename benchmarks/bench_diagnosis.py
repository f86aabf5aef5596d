"""Does the analysis name the planted problem? Small models, each with one bottleneck of known place and cause.

Each case trains a small model through a real Lightning ``Trainer`` with ``FXProfilerCallback`` (CPU), with one
planted problem, and reads what a user reads first: the first advice line of the last cycle, or the regression
flag for the regression case. A case scores when that text names the place (a module or the step's phase) and the
cause (the words expected). The steady case scores when no cycle flags anything, run twice (the second under load
from another process keeping a core busy).

    .venv/bin/python benchmarks/bench_diagnosis.py [--quick] [--threads N]

Cases: a Python loop over rows in forward, an unfused elementwise chain, a memory-bound op on a small batch, a dense
embedding gradient, a host sync (``.item()``) in forward, a DataLoader-bound step, an optimizer-bound step (Adam
over many parameters), a regression that triples the step, a slow rank in 2-process DDP (gloo, spawned; the first
advice line of rank 0's last cycle is read back from the run's files), a steady run.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from run_info import contention, cpu_stall_us, parse_args, quiet_stderr
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fxprof_lightning import FXProfilerCallback


class Lit(pl.LightningModule):
    def __init__(self, model: nn.Module, optimizer: str = "sgd", on_step: Callable[[int, nn.Module], None] | None = None):
        super().__init__()
        self.model, self._optimizer, self._on_step = model, optimizer, on_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self._on_step is not None:
            self._on_step(self.global_step, self.model)
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self._optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-4)
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class RowLoop(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([row * self.scale + 1 for row in x])  # a Python loop over the batch's rows


class Chain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):  # one elementwise op after another, each reading and writing the whole tensor
            x = torch.sin(x) * 1.01 + 0.1
        return x


class Synced(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        if x.abs().max().item() > 1e9:  # a host sync every call (and a graph break)
            x = x / 2
        return x


class Heavy(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w, self.work = nn.Parameter(torch.randn(width, width) / width**0.5), 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.work):
            x = torch.tanh(x @ self.w)
        return x


class SlowRank(Lit):
    """Rank 1 trains on 8x the samples of rank 0 in each step (uneven inputs): every layer is slower there."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1:
            x, y = x.repeat(8, 1), y.repeat(8)
        return F.cross_entropy(self.model(x), y)


class SlowData(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, seconds: float) -> None:
        self.x, self.y, self.seconds = x, y, seconds

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds)
        return self.x[i], self.y[i]


def mlp(*middle: nn.Module, width: int = 256, inputs: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), *middle, nn.Linear(width, 10))


def loader(inputs: int, batch: int, samples: int = 512, slow_s: float = 0.0, integer: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50_000, (samples,), generator=g) if integer else torch.randn(samples, inputs, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    data = SlowData(x, y, slow_s) if slow_s else TensorDataset(x, y)
    return DataLoader(data, batch_size=batch)


class EmbeddingBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(50_000, 64), nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


@dataclass
class Case:
    name: str
    make: Callable[[], tuple[Lit, DataLoader]]
    place: str  # a word the first line must hold: the module's name, or the phase
    cause: tuple[str, ...]  # any of these words names the cause
    steps: int = 24
    regression: bool = False
    ddp: bool = False  # on 2 processes


def regression_case() -> tuple[Lit, DataLoader]:
    def slow_down(step: int, model: nn.Module) -> None:
        if step == 20:  # cycle 4 (cycles of 5 steps: 1 idle, 1 warm-up, 3 recorded), after 4 baseline cycles
            model[2].work = 12

    return Lit(mlp(Heavy(256)), on_step=slow_down), loader(64, 64)


CASES = [
    Case("Python loop over rows in forward", lambda: (Lit(mlp(RowLoop(256))), loader(64, 64)), "2", ("overhead", "loop")),
    Case("unfused elementwise chain", lambda: (Lit(mlp(Chain(), width=1024)), loader(64, 256)), "2", ("fus",)),
    Case("memory-bound op, small batch", lambda: (Lit(nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 10))),
                                                  loader(4096, 2, samples=128)), "0", ("memory", "larger batch")),
    Case("dense embedding gradient", lambda: (Lit(EmbeddingBag()), loader(0, 8, integer=True)), "emb",
         ("sparse=True",)),
    Case("host sync (.item()) in forward", lambda: (Lit(mlp(Synced(256))), loader(64, 8)), "2", ("sync", "item")),
    Case("DataLoader-bound step", lambda: (Lit(mlp()), loader(64, 16, slow_s=0.002)), "batch", ("DataLoader", "num_workers")),
    Case("optimizer-bound step (Adam, 8M parameters)", lambda: (Lit(mlp(nn.Linear(2048, 2048), nn.Linear(2048, 2048),
                                                                        width=2048), optimizer="adam"), loader(64, 2)),
         "optimizer", ("optimizer",)),
    Case("a regression that triples the step", regression_case, "2", ("slower",), steps=40, regression=True),
    Case("a slow rank in 2-process DDP", lambda: (SlowRank(mlp(nn.Linear(256, 256))), loader(64, 64)), "2", ("rank 1",),
         steps=24, ddp=True),
]


def train(case: Case, root: str) -> FXProfilerCallback:
    lit, data = case.make()
    callback = FXProfilerCallback(wait=1, warmup=1, active=3, repeat=0, module="model")
    trainer = pl.Trainer(default_root_dir=root, logger=False, callbacks=[callback], max_steps=case.steps,
                         accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, max_epochs=-1)
    with warnings.catch_warnings(), quiet_stderr(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        trainer.fit(lit, data)
    return callback


def train_ddp(case: Case, root: str) -> str:
    """The case on 2 CPU processes (DDP, gloo, spawned); the first advice line of rank 0's last cycle, from disk."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from fxprof_lightning.outputs.runs import load_run

    lit, data = case.make()
    callback = FXProfilerCallback(wait=1, warmup=1, active=3, repeat=0, module="model")
    trainer = pl.Trainer(default_root_dir=root, logger=False, callbacks=[callback], max_steps=case.steps,
                         accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="spawn", timeout=timedelta(seconds=120)),
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=-1)
    with warnings.catch_warnings(), quiet_stderr(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        trainer.fit(lit, data)
    cycles = load_run(root)
    return cycles[-1].advice[0] if cycles and cycles[-1].advice else "(no advice)"


def first_line(callback: FXProfilerCallback, regression: bool) -> str:
    if regression:
        flagged = [f"`{r.node}` {r.direction} {r.ratio:.1f}x slower (cycle {c.index})" for c in callback.cycles
                   for r in c.regressions]
        return flagged[0] if flagged else "(no regression reported)"
    cycle = callback.cycles[-1] if callback.cycles else None
    return cycle.advice[0] if cycle is not None and cycle.advice else "(no advice)"


def scores(line: str, case: Case) -> bool:
    """The line names the place (the module or a node of it: `2`, `2 (Linear)`, `module 2`, `2_mul`, `2.fc`; or the
    phase's word) and the cause."""
    lowered = line.lower()
    names = [name.removeprefix("module ").split(" (")[0] for name in re.findall(r"`([^`]+)`", line)]  # (`0 (Linear)`)
    place = any(n == case.place or n.startswith((f"{case.place}_", f"{case.place}.")) for n in names) or (
        case.place in ("batch", "optimizer") and case.place in lowered)
    return place and any(word.lower() in lowered for word in case.cause)


def busy(seconds: float) -> None:
    """Keep one core busy (another process: the load a shared machine has)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(10_000))


def steady(root: str, load: bool) -> int:
    other = multiprocessing.get_context("spawn").Process(target=busy, args=(600.0,), daemon=True) if load else None
    if other is not None:
        other.start()
    try:
        callback = train(Case("steady", lambda: (Lit(mlp()), loader(64, 64)), "", (), steps=60), root)
    finally:
        if other is not None:
            other.terminate()
            other.join()
    return sum(len(c.regressions) for c in callback.cycles)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    began, stall = time.perf_counter(), cpu_stall_us()
    cases = CASES[:3] if args.quick else CASES
    right = 0
    print(f"{'case':<45}  {'scored':<6}  first thing the user reads")
    for case in cases:
        with tempfile.TemporaryDirectory() as root:
            line = train_ddp(case, root) if case.ddp else first_line(train(case, root), case.regression)
        ok = scores(line, case)
        right += ok
        print(f"{case.name:<45}  {'yes' if ok else 'NO':<6}  {line[:160]}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        idle = steady(root, load=False)
    with tempfile.TemporaryDirectory() as root:
        loaded = steady(root, load=not args.quick)
    right += idle == 0 and loaded == 0
    print(f"{'steady run, twice (second under load)':<45}  {'yes' if idle == 0 and loaded == 0 else 'NO':<6}  "
          f"{idle} and {loaded} regression(s) reported")
    share = contention(stall, began)
    load = "" if share is None else f", CPU contention {100 * share:.0f}%"
    print(f"\nScore: {right} of {len(cases) + 1} (torch threads {torch.get_num_threads()}{load}); "
          f"wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
