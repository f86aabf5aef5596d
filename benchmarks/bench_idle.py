"""What an idle profiler costs per training step, in a real Trainer fit and in a plain loop, on a ~1 ms and a ~100 ms step.

    .venv/bin/python benchmarks/bench_idle.py            # about 2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_idle.py --quick    # a smoke run (few steps: rough numbers)

Two models, CPU, torch.set_num_threads(1): an MLP (256-512-512-10, batch 32: a step of about 1 ms) and ResNet18
(torchvision, 10 classes, batch 16 of 3x64x64: about 100 ms), SGD. The profiler waits the whole run (``wait`` longer
than the run: every step is idle, as almost every step of a long run is).

* Trainer fit: the Trainer holds a stand-in that forwards every hook to the callback as Lightning calls it
  (``getattr`` on the instance, so the stand-ins the engine puts on the callback between cycles are what runs) and
  sums the ns spent in each per-step hook, less the cost of one timed forwarding measured on an empty callback the
  same way; a second fit with an empty ``pl.Callback()`` gives what any callback costs in the same place (caches
  as the model's step leaves them).
* Plain loop: ns inside ``prof.step()`` against a call of an empty function timed the same way, in a second loop.

Each is itemised by part: the batches that hand the idle steps to the follower (``IdleSteps._batch``: every 64 steps,
at a slow step, or when a request is flagged), the rest of the step's own note (a clock read and an append), and the
request thread off the step (``RequestBox.look``, us per second of the run). The run's first ``START`` steps (its
start: one full step, the first look for a request) are left out. Goal (issue 41): under 5 us per idle step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torchvision
from torch import nn

from fxprof_lightning import FXProfilerCallback, Profiler
from fxprof_lightning.engine.follow import RequestBox

START = 10  # the run's first steps, left out of the figures (its start: one full step, the first look for a request)
PER_STEP = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
            "on_before_zero_grad", "on_train_batch_end")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def resnet() -> nn.Module:
    return torchvision.models.resnet18(num_classes=10)


MODELS = {"~1 ms (MLP, batch 32)": (mlp, (32, 256)), "~100 ms (ResNet18, batch 16, 64x64)": (resnet, (16, 3, 64, 64))}


class LitResNet(pl.LightningModule):
    """ResNet18 (10 classes) for ``bench_recorded``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = resnet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Lit(LitResNet):
    def __init__(self, make: Callable[[], nn.Module]) -> None:
        pl.LightningModule.__init__(self)
        self.model = make()


class Forwarding(pl.Callback):
    """Hands every hook Lightning calls to ``inner`` (looked up on the instance at each call, as Lightning does),
    timing the per-step ones."""

    def __init__(self, inner: pl.Callback) -> None:
        self.inner = inner
        self.ns = dict.fromkeys(PER_STEP, 0)
        self.steps = 0  # the steps that ended (timed from step ``START`` on)
        self.parts: Parts | None = None

    @property
    def state_key(self) -> str:
        return self.inner.state_key


def _forward(name: str) -> Callable[..., Any]:
    if name in PER_STEP:
        def call(self: Forwarding, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return getattr(self.inner, name)(*args, **kwargs)
            finally:
                if self.steps >= START:
                    self.ns[name] += time.perf_counter_ns() - start
                if name == "on_train_batch_end":
                    self.steps += 1
                    if self.parts is not None:
                        self.parts.counting = self.steps >= START
    else:
        def call(self: Forwarding, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, name)(*args, **kwargs)
    return call


for _name in [n for n in vars(pl.Callback) if n.startswith("on_") or n in ("setup", "teardown", "state_dict", "load_state_dict")]:
    setattr(Forwarding, _name, _forward(_name))


def forwarding_ns(calls: int = 100_000) -> float:
    """ns one timed forwarding adds to a hook (an empty callback's ``on_before_backward``, median of 5)."""
    empty, forwarding = pl.Callback(), Forwarding(pl.Callback())
    samples = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(calls):
            empty.on_before_backward(None, None, None)
        bare = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for _ in range(calls):
            forwarding.on_before_backward(None, None, None)
        samples.append((time.perf_counter_ns() - start - bare) / calls)
    return statistics.median(samples)


class Parts:
    """ns inside the idle path's parts: ``IdleSteps._batch`` (wrapped on the instance) and the request thread's
    ``RequestBox.look`` (wrapped on the class while a run lasts)."""

    def __init__(self) -> None:
        self.batch_ns = self.batches = self.look_ns = self.looks = 0
        self.counting = False  # (the batches are counted from step ``START`` on)
        self._look = getattr(RequestBox, "look", None)  # (None: the request is looked for on the step, git 779e782)
        parts = self

        def look(box: RequestBox) -> None:
            start = time.perf_counter_ns()
            parts._look(box)
            parts.look_ns += time.perf_counter_ns() - start
            parts.looks += 1

        if self._look is not None:
            RequestBox.look = look

    def watch(self, engine: Any) -> None:
        """Time ``engine``'s ``IdleSteps._batch`` (the stretch calls ``self._batch()``: the instance's goes first)."""
        idle = getattr(engine, "idle", None)
        if idle is None:  # (before the idle steps were the engine's)
            return
        batch = idle._batch

        def timed() -> None:
            start = time.perf_counter_ns()
            batch()
            if self.counting:
                self.batch_ns += time.perf_counter_ns() - start
                self.batches += 1

        idle._batch = timed

    def close(self) -> None:
        if self._look is not None:
            RequestBox.look = self._look


def fit(callback: pl.Callback, make: Callable[[], nn.Module], shape: tuple[int, ...], steps: int,
        parts: Parts | None = None) -> tuple[dict[str, int], float]:
    """One fit of ``steps`` steps with ``callback`` behind a ``Forwarding``: ns per per-step hook (from step ``START``
    on), ms per step."""
    torch.manual_seed(0)
    timed = Forwarding(callback)
    timed.parts = parts
    data = torch.utils.data.TensorDataset(torch.randn(steps * shape[0], *shape[1:]), torch.randint(0, 10, (steps * shape[0],)))
    trainer = pl.Trainer(max_steps=steps, callbacks=[timed], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    started = time.perf_counter()
    trainer.fit(Lit(make), torch.utils.data.DataLoader(data, batch_size=shape[0]))
    return timed.ns, (time.perf_counter() - started) * 1e3 / steps


def loop(step: Callable[[], None], make: Callable[[], nn.Module], shape: tuple[int, ...], steps: int,
         profiler: Profiler | None = None, parts: Parts | None = None) -> tuple[int, float]:
    """A plain loop of ``steps`` steps calling ``step`` after each (with ``profiler``: ``profiler.step()``, looked up
    at every call as a loop does, so that the idle steps' stand-in runs): ns inside it in all, ms per step."""
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    if profiler is not None:
        profiler.module = model
        profiler.start()
    inside = 0
    started = time.perf_counter()
    for index in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        before = time.perf_counter_ns()
        if profiler is not None:
            profiler.step()
        else:
            step()
        if index >= START:
            inside += time.perf_counter_ns() - before
        if parts is not None:
            parts.counting = index + 1 >= START
    per_step = (time.perf_counter() - started) * 1e3 / steps
    if profiler is not None:
        profiler.stop()
    return inside, per_step


def nothing() -> None:
    pass


def parts_lines(parts: Parts, steps: int, seconds: float) -> list[str]:
    batch = parts.batch_ns / (steps - START) / 1e3
    thread = parts.look_ns / 1e3 / max(seconds, 1e-9)
    return [f"    of which batches to the follower ({parts.batches} in {steps - START} steps)   {batch:6.2f} us/step",
            f"    off the step: the request thread ({parts.looks} looks)       {thread:6.2f} us per second of the run"]


def trainer_part(name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], steps: int, overhead: float) -> None:
    parts = Parts()
    with tempfile.TemporaryDirectory() as out:
        ours = FXProfilerCallback(wait=10 * steps, warmup=1, active=1, pictures=False, dirpath=out)
        parts.watch(ours.profiler)
        started = time.perf_counter()
        result, ms = fit(ours, make, shape, steps, parts)
        seconds = time.perf_counter() - started
    parts.close()
    empty, empty_ms = fit(pl.Callback(), make, shape, steps)
    print(f"\nTrainer fit, {name}: {steps} idle steps, {ms:.2f} ms a step (empty callback: {empty_ms:.2f})")
    print(f"  {'hook':28s} {'idle callback':>14s} {'empty callback':>15s} {'added':>8s}   (us per step; forwarding "
          f"{overhead:.0f} ns per call subtracted)")
    added_total = 0.0
    for hook in PER_STEP:
        a, b = (max(res[hook] / (steps - START) - overhead, 0.0) / 1e3 for res in (result, empty))
        added_total += a - b
        print(f"  {hook:28s} {a:14.2f} {b:15.2f} {a - b:8.2f}")
    print(f"  {'all hooks, added':28s} {added_total:39.2f} us/step (goal < 5)")
    print("\n".join(parts_lines(parts, steps, seconds)))


def loop_part(name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], steps: int) -> None:
    parts = Parts()
    with tempfile.TemporaryDirectory() as out:
        prof = Profiler(nn.Identity(), wait=10 * steps, warmup=1, active=1, pictures=False, dirpath=out)
        parts.watch(prof)
        started = time.perf_counter()
        ours, ms = loop(prof.step, make, shape, steps, prof, parts)
        seconds = time.perf_counter() - started
    parts.close()
    bare, bare_ms = loop(nothing, make, shape, steps)
    added = (ours - bare) / (steps - START) / 1e3
    print(f"\nPlain loop, {name}: {steps} idle steps, {ms:.2f} ms a step (without the profiler: {bare_ms:.2f})")
    print(f"  inside prof.step() / an empty function: {ours / (steps - START) / 1e3:.2f} / {bare / (steps - START) / 1e3:.2f} us per step, "
          f"added {added:.2f} us/step (goal < 5)")
    print("\n".join(parts_lines(parts, steps, seconds)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = dict(zip(MODELS, (60, 20) if args.quick else (3000, 200), strict=True))
    print(f"torch {torch.__version__}, lightning {pl.__version__}, CPU, 1 thread ({threading.active_count()} threads "
          f"before the runs); the profiler waits the whole run: every step is idle; us per step from step {START} on")
    overhead = forwarding_ns()
    for name, (make, shape) in MODELS.items():
        trainer_part(name, make, shape, counts[name], overhead)
        loop_part(name, make, shape, counts[name])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
