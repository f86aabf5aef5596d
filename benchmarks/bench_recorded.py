"""What a recorded step costs, side by side in one process: FXProfilerCallback against torch.profiler through
Lightning's PyTorchProfiler, and against no profiler.

    .venv/bin/python benchmarks/bench_recorded.py --threads 1          # full run, about 4-6 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_recorded.py --threads 1 --quick  # smoke run (2 rounds, numbers are rough)

Workload (``--model``): torchvision ResNet18 (10 classes), batch 8 of 3x64x64 (``resnet18``, the default), or a
6-layer MLP (6 x [Linear(256, 256), ReLU] and a head, batch 32: ``mlp6``, a tiny model's ~1 ms step), SGD, CPU, real
``lightning.pytorch.Trainer`` fits
(logger=False, no checkpointing, no progress bar, no model summary). Configurations, each a fresh Trainer and model
(same seed, same data):

    none        no profiler
    lightning   Lightning's ``PyTorchProfiler(schedule=torch.profiler.schedule(wait=1, warmup=1, active=A),
                record_module_names=False)``: torch.profiler alone (CPU activity), through Lightning's profiler hooks
    ours        ``FXProfilerCallback(wait=1, warmup=1, active=A, repeat=1, module="model")``, defaults otherwise
    ours-noFX   the same with ``fx_timing=False`` (our torch.profiler session, phases, export)
    ours-noTP   the same with ``torch_profiler=False`` (FX timing with backward events alone)

Both schedules record the same steps. Lightning steps its profiler when ``training_step`` returns, so its step k
is wholly recorded when the schedule's actions at k and k+1 both record: steps 2..A, as ours (whose cycle is
steps 1 (warm-up), 2..A+1 (recorded)). Step A+1 holds the end of the cycle in both (the trace's export; ours
also folds the samples, writes the CSV, pictures, analysis).

A timing callback, first in the list, stamps every ``on_train_batch_start``; a step's period runs to the next
stamp, so it holds the whole loop (hooks of every callback, the next batch's fetch). Per fit:

* the median period of the interior recorded steps 2..A ("recorded step");
* the period of step A+1 less that median ("end of cycle": export, CSV, analysis);
* fit wall time less the sum of all periods ("outside steps": setup, capture in warm-up is *inside* step 1,
  teardown, ``end_run``, Lightning's profiler summary).

Phases: a ``step_phases.PhaseClock`` on the Trainer's profiler (every configuration alike) splits each interior
step into training_step (forward), backward, optimizer, zero_grad, callbacks (ours: "fxprof"), data, other.

Configurations alternate over rounds in a shuffled order; results are medians over rounds of per-round ratios of
medians, with a bootstrap ~95 % CI (rounds resampled) and the distribution-free median interval of
``bench_overhead``. The final weights of every configuration are compared bitwise with ``none`` in the first round.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import io
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torchvision
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from bench_idle import Lit, LitResNet
from run_info import contention, cpu_stall_us, median_ci, package_state, parse_args, quiet_stderr

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.engine.step_phases import PHASES, PhaseClock

ACTIVE = 12  # recorded steps per cycle (interior: 2..ACTIVE)
STEPS = ACTIVE + 4  # 0 idle, 1 warm-up, 2..A+1 recorded, then idle steps


def mlp6() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))


# --model: the LightningModule, one sample's shape, the batch size
MODELS: dict[str, tuple[Callable[[], pl.LightningModule], tuple[int, ...], int]] = {
    "resnet18": (LitResNet, (3, 64, 64), 8),
    "mlp6": (lambda: Lit(mlp6), (256,), 32),
}


@dataclass(frozen=True)
class Budget:
    least: int
    most: int
    seconds: float


FULL = Budget(least=6, most=14, seconds=300)
QUICK = Budget(least=2, most=2, seconds=0)


class StepClock(pl.Callback):
    """First in the list: stamps each ``on_train_batch_start`` / ``on_train_batch_end``; phases of every step."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.phases: list[dict[str, int]] = []
        self._clock: PhaseClock | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = PhaseClock(trainer.profiler, own="[Callback]FXProfilerCallback")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter_ns()
        if self._clock is not None and self.starts:
            self.phases.append(self._clock.lap())  # the previous period's phases
        elif self._clock is not None:
            self._clock.lap()
        self.starts.append(now)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.perf_counter_ns())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None:
            self.phases.append(self._clock.lap())
            self._clock.close()
            self._clock = None

    def periods(self) -> list[int]:
        """ns from each step's start to the next one's (the last: to its end)."""
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)] + [self.ends[-1] - self.starts[-1]]


def lightning_profiler(root: str) -> Any:
    from lightning.pytorch.profilers import PyTorchProfiler

    return PyTorchProfiler(dirpath=root, filename="pl", record_module_names=False,
                           schedule=torch.profiler.schedule(wait=1, warmup=1, active=ACTIVE))


def ours(root: str, **settings: Any) -> FXProfilerCallback:
    return FXProfilerCallback(wait=1, warmup=1, active=ACTIVE, repeat=1, module="model", dirpath=root, **settings)


CONFIGS: dict[str, Callable[[str], tuple[list[pl.Callback], Any]]] = {
    "none": lambda root: ([], None),
    "lightning": lambda root: ([], lightning_profiler(root)),
    "ours": lambda root: ([ours(root)], None),
    "ours-noFX": lambda root: ([ours(root, fx_timing=False)], None),
    "ours-noTP": lambda root: ([ours(root, torch_profiler=False)], None),
}


@dataclass
class FitResult:
    step_ms: float  # median period of the interior recorded steps
    end_ms: float  # the cycle's last step less that median
    warm_ms: float  # step 1 (warm-up; ours: the Dynamo capture) less that median
    outside_ms: float  # fit wall time less the sum of periods
    phases: dict[str, float]  # median ms per phase over the interior steps
    weights: list[torch.Tensor] = field(default_factory=list)


def data(model: str) -> DataLoader:
    _, shape, batch = MODELS[model]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * batch, *shape, generator=generator)
    y = torch.randint(0, 10, (STEPS * batch,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def fit(name: str, loader: DataLoader, keep_weights: bool, accelerator: str = "cpu", model: str = "resnet18") -> FitResult:
    with tempfile.TemporaryDirectory() as root:
        callbacks, profiler = CONFIGS[name](root)
        clock = StepClock()
        torch.manual_seed(0)
        lit = MODELS[model][0]()
        trainer = pl.Trainer(accelerator=accelerator, devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, callbacks=[clock, *callbacks], profiler=profiler, default_root_dir=root)
        gc.collect()
        with quiet_stderr(), contextlib.redirect_stdout(io.StringIO()):
            began = time.perf_counter_ns()
            trainer.fit(lit, loader)
            wall = time.perf_counter_ns() - began
    periods = clock.periods()
    if len(periods) != STEPS:
        raise RuntimeError(f"{name}: {len(periods)} steps, expected {STEPS}")
    interior = range(2, ACTIVE + 1)
    step = statistics.median(periods[k] for k in interior)
    phases = {p: statistics.median(clock.phases[k].get(p, 0) for k in interior) / 1e6 for p in PHASES}
    weights = [p.detach().clone() for p in lit.parameters()] if keep_weights else []
    return FitResult(step / 1e6, (periods[ACTIVE + 1] - step) / 1e6, (periods[1] - step) / 1e6,
                     (wall - sum(periods)) / 1e6, phases, weights)


# ------------------------------------------------------------------ statistics


def bootstrap_ci(values: list[float], resamples: int = 4000) -> tuple[float, float]:
    """Percentile bootstrap ~95 % interval of the median (rounds resampled with replacement)."""
    rng = random.Random(12345)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def estimate(values: list[float], digits: int = 3) -> str:
    low, high = bootstrap_ci(values)
    dlow, dhigh = median_ci(values)
    return f"{statistics.median(values):.{digits}f} [{low:.{digits}f}-{high:.{digits}f}] ({dlow:.{digits}f}-{dhigh:.{digits}f})"


# ------------------------------------------------------------------ main


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def device(accelerator: str) -> str:
    return torch.cuda.get_device_name(0) if accelerator in ("cuda", "gpu") else accelerator.upper()


def header(quick: bool, accelerator: str, model: str) -> str:
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return "\n".join([
        f"fxprof_lightning recorded-step benchmark ({'quick' if quick else 'full'} run)",
        f"date      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine   {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load avg {load}",
        f"versions  python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}, lightning {lightning.__version__}",
        f"package   {package_state()}",
        f"workload  {model}, batch {MODELS[model][2]} of {'x'.join(map(str, MODELS[model][1]))}, SGD, {device(accelerator)}; "
        f"{STEPS} steps per fit, recorded 2..{ACTIVE + 1}, "
        f"interior recorded steps 2..{ACTIVE}",
    ])


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda parser: parser.add_argument(
        "--model", choices=sorted(MODELS), default="resnet18", help="the model trained (default resnet18)"))
    budget = QUICK if args.quick else FULL
    quiet_lightning()
    began, stall = time.perf_counter(), cpu_stall_us()
    print(header(args.quick, args.accelerator, args.model), flush=True)
    loader = data(args.model)
    names = list(CONFIGS)
    results: dict[str, list[FitResult]] = {name: [] for name in names}
    for name in names:  # warm-up fits, thrown away (imports, first Dynamo use, allocator)
        fit(name, loader, keep_weights=False, accelerator=args.accelerator, model=args.model)
    deadline = time.perf_counter() + budget.seconds
    for r in range(budget.most):
        if r >= budget.least and time.perf_counter() > deadline:
            break
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            results[name].append(fit(name, loader, keep_weights=r == 0, accelerator=args.accelerator, model=args.model))
        print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1].step_ms:.1f}" for n in names) + " ms", flush=True)

    rounds = len(results["none"])
    reference = results["none"][0].weights
    same = {name: all(torch.equal(a, b) for a, b in zip(reference, results[name][0].weights, strict=True))
            for name in names}

    def per_round(name: str, base: str) -> list[float]:
        return [a.step_ms / b.step_ms for a, b in zip(results[name], results[base], strict=True)]

    print("-" * 108)
    print(f"{'configuration':<12} {'recorded step ms':>16}  {'/ none [boot 95 %] (median CI)':<36} "
          f"{'/ lightning [boot 95 %] (median CI)':<36}")
    for name in names:
        step = statistics.median(f.step_ms for f in results[name])
        vs_none = estimate(per_round(name, "none")) if name != "none" else ""
        vs_pl = estimate(per_round(name, "lightning")) if name not in ("none", "lightning") else ""
        print(f"{name:<12} {step:>16.2f}  {vs_none:<36} {vs_pl:<36}")
    print(f"goal: ours / lightning <= 1.02 (interior recorded steps; {rounds} rounds, fresh Trainer per fit)")
    print("-" * 108)
    print(f"{'configuration':<12} {'end of cycle ms':>16} {'warm-up step extra ms':>22} {'outside steps ms':>17} {'weights = none':>15}")
    for name in names:
        end = statistics.median(f.end_ms for f in results[name])
        warm = statistics.median(f.warm_ms for f in results[name])
        outside = statistics.median(f.outside_ms for f in results[name])
        print(f"{name:<12} {end:>16.1f} {warm:>22.1f} {outside:>17.1f} {'yes' if same[name] else 'NO':>15}")
    print("-" * 108)
    print("phases of an interior recorded step, ms (median over rounds of per-fit medians), and ours - lightning:")
    print(f"{'phase':<14}" + "".join(f"{n:>12}" for n in names) + f"{'ours-light.':>13}")
    for phase in PHASES:
        values = {n: statistics.median(f.phases[phase] for f in results[n]) for n in names}
        diff = [a.phases[phase] - b.phases[phase] for a, b in zip(results["ours"], results["lightning"], strict=True)]
        print(f"{phase:<14}" + "".join(f"{values[n]:>12.2f}" for n in names) + f"{statistics.median(diff):>+13.2f}")
    share = contention(stall, began)
    print("CPU contention during the run: " + ("unknown" if share is None else
          f"some task waited for a CPU {100 * share:.0f} % of the time (/proc/pressure/cpu)"))
    print(f"total wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
