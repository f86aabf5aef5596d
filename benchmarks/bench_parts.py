"""What the user pays per step, itemised by part: recorded and idle steps of a Lightning fit and of a plain loop.

    .venv/bin/python benchmarks/bench_parts.py --threads 1          # full run, about 8-9 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_parts.py --threads 1 --quick  # smoke run (one round, about 2 minutes)

Workload: ``bench_overhead``'s MLP-199 (66 x [Linear(64, 64), ReLU, residual add] and a head: small layers, where the
fixed costs show), batch 32, SGD, CPU, the schedule of ``bench_trainer_nodes`` (``skip_first=10``, cycles of
``wait=4, warmup=1, active=5``, ``repeat=0``). Two faces, in one process:

* a real ``lightning.pytorch.Trainer`` fit, a timing callback first in the list stamping every
  ``on_train_batch_start`` (a step: the period to the next stamp, every hook in it);
* a plain loop (forward, loss, backward, SGD step, zero_grad, then the profiler's ``step()``), stamped at each
  step's start.

Variants, one fit (or loop) each per round, in an order shuffled every round: ``empty`` (an empty ``pl.Callback()``;
the loop: a call of an empty function), ``torch.profiler`` (a plain ``torch.profiler.profile`` with the same
schedule and a gzipped trace handler, stepped at each step's end: a callback's ``on_train_batch_end`` in the fit),
``ours`` (``FXProfilerCallback(module="model")`` / ``Profiler(model)``, defaults otherwise) and ``ours`` with one
option off at a time. Within one run, from its third cycle on: the idle step is the median of the first three wait
steps of each cycle, the recorded step the median of the three interior recorded steps. Paired by round:
``variant - empty`` is what the variant costs, ``ours - ours with X off`` what part X costs.

Parts without an option are timed directly, in the same process, on the live objects of a short run with the
defaults: Dynamo's guards asked before each timed call (``EntryGuards.fitting``), the call wrapper (a module's class
swapped for the step, ``forward_swap``: its forward against the module's own), the clock reads of a recorded step
(``stamps.append(perf_counter_ns())``, counted on the live timer), the step's phases (Lightning: ``PhaseClock`` per
profiler action, actions counted in the run; the loop: ``LoopClock`` around a forward and backward), the
follower at a recorded step's end (``Follow.skip``), the idle-step counter (``IdleSteps.step_ended``, its batches to
the follower amortised), and the regression watch's check at a cycle's close (``RegressionWatch.check``, counted in
the run) per step of the run. Beside them: ``bench_overhead``'s isolated figure for the same model (NodeTimer over
eager outside any Trainer, per node), its floor (one clock read and one sequence number per node boundary, one C++
callback per autograd node) and ``ours - floor``, measured in the same process.

Printed per face: a table of part, us per recorded step, us per node (rows of the live timer), us per idle step,
each a median over rounds with its distribution-free ~95 % interval; the sum of the parts against the measured
total (ours - empty), and what is left unexplained.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))

from bench_idle import Forwarding
from bench_overhead import ResidualMLP, Rounds, estimate, mlp_workload, shuffled, step_overhead
from bench_trainer_nodes import ACTIVE, BATCH, CYCLE, IDLE, RECORDED, SKIP, WAIT, WARMUP, Lit
from run_info import closing_lines, cpu_stall_us, package_state, parse_args, quiet_stderr

from fxprof_lightning import FXProfilerCallback, Profiler
from fxprof_lightning.analysis.watch import RegressionWatch
from fxprof_lightning.engine.loop_phases import LoopClock
from fxprof_lightning.engine.step_phases import PhaseClock
from fxprof_lightning.timing.forward_swap import put_forward, take_forward

# ours with one option off at a time: the part it switches off
OPTIONS: dict[str, dict[str, Any]] = {
    "torch_profiler=False": {"torch_profiler": False},
    "fx_timing=False": {"fx_timing": False},
    "backward_timing=False": {"backward_timing": False},
    "memory=False": {"memory": False},
    "node_ranges=False": {"node_ranges": False},
    "watch_step_time=False": {"watch_step_time": False},
    "pictures=False": {"pictures": False},
}
PART_OF = {"torch_profiler=False": "torch.profiler handling", "fx_timing=False": "FX timing (all of it)",
           "backward_timing=False": "  of which backward timing", "memory=False": "  of which saved bytes (memory)",
           "node_ranges=False": "  of which node ranges", "watch_step_time=False": "step-time watch",
           "pictures=False": "pictures"}
DISJOINT = ("torch_profiler=False", "fx_timing=False", "watch_step_time=False", "pictures=False")  # summed
VARIANTS = ["empty", "torch.profiler", "ours", *OPTIONS]


@dataclass(frozen=True)
class Budget:
    rounds: Rounds
    cycles: int  # per fit (the first two are left out)
    overhead_rounds: Rounds  # bench_overhead's isolated figure and floor
    calls: int  # direct timings: calls per repeat


QUICK = Budget(Rounds(1, 1, 0), 3, Rounds(6, 6, 0), 2000)
FULL = Budget(Rounds(6, 12, 360), 4, Rounds(20, 80, 20), 20000)  # (about a minute a round: 6 rounds for an interval)


# ------------------------------------------------------------------ the runs


def schedule_options() -> dict[str, int]:
    return {"skip_first": SKIP, "wait": WAIT, "warmup": WARMUP, "active": ACTIVE, "repeat": 0}


def torch_profiler(directory: str) -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(**schedule_options()),
                                  on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, use_gzip=True))


class TorchProfilerCallback(pl.Callback):
    """torch.profiler alone, stepped as ours is (at each step's end), with the same schedule."""

    def __init__(self, directory: str) -> None:
        self.profiler = torch_profiler(directory)

    def on_train_start(self, *args: object) -> None:
        self.profiler.start()

    def on_train_batch_end(self, *args: object) -> None:
        self.profiler.step()

    def on_train_end(self, *args: object) -> None:
        self.profiler.stop()


def split(periods: list[float]) -> tuple[float, float, float]:
    """(median idle step, median recorded step, median last recorded step less that) in us, from the third cycle on:
    the last holds the cycle's close (export, CSV, analysis, sinks)."""
    idle, recorded, last = [], [], []
    for step, us in enumerate(periods):
        if step >= SKIP + 2 * CYCLE:  # (the first cycle holds the capture, the second the first analysis)
            position = (step - SKIP) % CYCLE
            (idle if position in IDLE else recorded if position in RECORDED else last if position == CYCLE - 1
             else []).append(us)
    return statistics.median(idle), statistics.median(recorded), statistics.median(last) - statistics.median(recorded)


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH * steps, 64, generator=generator), torch.randint(0, 10, (BATCH * steps,), generator=generator)


@dataclass
class Run:
    periods: list[float]  # us per step
    driver: Any = None  # the callback / Profiler (the parts run reads its live objects)
    model: nn.Module | None = None
    hook_ns: list[int] = field(default_factory=list)  # per step: ns inside our per-step hooks / step() (parts run)
    actions: list[int] = field(default_factory=list)  # per step: Lightning profiler actions (parts run)


class Laps(pl.Callback):
    """First in the list: stamps every ``on_train_batch_start`` and notes what the ``Forwarding`` behind it spent in
    our hooks so far and how many actions the Trainer's profiler was told of."""

    def __init__(self, forwarding: Forwarding | None) -> None:
        self.ns: list[int] = []
        self.hooks: list[int] = []
        self.actions: list[int] = []
        self.forwarding, self.count = forwarding, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = trainer.profiler.start  # (PhaseClock keeps this one and puts it back)

        def counting(action: str) -> None:
            self.count += 1
            start(action)

        trainer.profiler.start = counting

    def on_train_batch_start(self, *args: object) -> None:
        self.ns.append(time.perf_counter_ns())
        if self.forwarding is not None:
            self.hooks.append(sum(self.forwarding.ns.values()))
        self.actions.append(self.count)

    def on_train_end(self, *args: object) -> None:  # (the last step's end: the last cycle closes in it)
        self.on_train_batch_start()


def fit(variant: str, cycles: int, directory: str, parts: bool = False) -> Run:
    """One Trainer fit of ``variant``."""
    torch.manual_seed(0)
    steps = SKIP + cycles * CYCLE
    x, y = data(steps)
    if variant == "empty":
        extra: pl.Callback = pl.Callback()
    elif variant == "torch.profiler":
        extra = TorchProfilerCallback(directory)
    else:
        extra = FXProfilerCallback(module="model", dirpath=directory, **schedule_options(),
                                   **OPTIONS.get(variant, {}))
    forwarding = Forwarding(extra) if parts else None
    laps = Laps(forwarding)
    lit = Lit()
    with quiet_stderr(), contextlib.redirect_stdout(io.StringIO()):  # (the cycles' console lines, kineto's)
        trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[laps, forwarding or extra], accelerator="cpu")
        trainer.fit(lit, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    periods = [(b - a) / 1e3 for a, b in zip(laps.ns, laps.ns[1:])]
    hooks = [b - a for a, b in zip(laps.hooks, laps.hooks[1:])]
    actions = [b - a for a, b in zip(laps.actions, laps.actions[1:])]
    return Run(periods, extra, lit.model, hooks, actions)


def nothing() -> None:
    pass


def loop(variant: str, cycles: int, directory: str, parts: bool = False) -> Run:
    """One plain loop of ``variant``; with ``parts``, the ns inside ``step()`` per step."""
    torch.manual_seed(0)
    steps = SKIP + cycles * CYCLE
    xs, ys = data(steps)
    model = ResidualMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if variant == "empty":
        driver: Any = contextlib.nullcontext(type("Nothing", (), {"step": staticmethod(nothing)})())
    elif variant == "torch.profiler":
        driver = torch_profiler(directory)
    else:
        driver = Profiler(model, dirpath=directory, **schedule_options(), **OPTIONS.get(variant, {}))
    starts, inside = [], []
    with quiet_stderr(), contextlib.redirect_stdout(io.StringIO()), driver as prof:
        for k in range(steps):
            starts.append(time.perf_counter_ns())
            x, y = xs[k * BATCH:(k + 1) * BATCH], ys[k * BATCH:(k + 1) * BATCH]
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            before = time.perf_counter_ns()
            prof.step()  # (looked up at every call: the idle steps' stand-in is on the instance)
            if parts:
                inside.append(time.perf_counter_ns() - before)
        starts.append(time.perf_counter_ns())
    periods = [(b - a) / 1e3 for a, b in itertools.pairwise(starts)]
    return Run(periods, driver, model, inside)


FACES: dict[str, Callable[..., Run]] = {"Lightning fit": fit, "plain loop": loop}


# ------------------------------------------------------------------ parts timed directly


def per_call_ns(call: Callable[[], Any], calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean ns of ``call()`` in a loop of ``calls``, less the loop's own."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            nothing()
        bare = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter_ns() - start - bare) / calls)
    return statistics.median(samples)


def paired_ns(with_: Callable[[], Any], without: Callable[[], Any], calls: int, repeats: int = 15) -> float:
    """Median over ``repeats`` of mean ns per call of ``with_`` less ``without``, alternated."""
    diffs = []
    for r in range(repeats):
        means = {}
        for name, call in shuffled([("with", with_), ("without", without)], r):
            start = time.perf_counter_ns()
            for _ in range(calls):
                call()
            means[name] = (time.perf_counter_ns() - start) / calls
        diffs.append(means["with"] - means["without"])
    return statistics.median(diffs)


class Noop(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def wrapper_ns(calls: int) -> float:
    """What the class swap adds to a module call: the swapped forward (``forward_swap``) against the module's own."""
    own, swapped, x = Noop(), Noop(), torch.zeros(1)
    saved = put_forward(swapped, Noop.forward.__get__(swapped))
    try:
        return paired_ns(lambda: swapped(x), lambda: own(x), calls)
    finally:
        take_forward(swapped, saved)


def clock_ns(calls: int) -> float:
    """One clock read as the generated code makes it: ``stamps.append(perf_counter_ns())``."""
    stamps: list[int] = []
    read = time.perf_counter_ns

    def once() -> None:
        stamps.append(read())
        if len(stamps) > 4096:
            stamps.clear()

    def bare() -> None:
        if len(stamps) > 4096:
            stamps.clear()

    return paired_ns(once, bare, calls)


def phase_clock_ns(calls: int) -> float:
    """What ``PhaseClock`` adds to one action told to Lightning's profiler (a start and its stop)."""
    from lightning.pytorch.profilers import PassThroughProfiler

    plain, clocked = PassThroughProfiler(), PassThroughProfiler()
    clock = PhaseClock(clocked)
    action = "[Strategy]SingleDeviceStrategy.training_step"
    try:
        return paired_ns(lambda: (clocked.start(action), clocked.stop(action)),
                         lambda: (plain.start(action), plain.stop(action)), calls)
    finally:
        clock.close()


def loop_clock_ns(calls: int) -> float:
    """What ``LoopClock`` adds to a step: its hooks around a small module's forward and backward, and a lap."""
    torch.manual_seed(0)
    plain, clocked = nn.Linear(4, 4), nn.Linear(4, 4)
    clock = LoopClock(clocked)
    x = torch.randn(2, 4)

    def step(module: nn.Module, lap: bool) -> None:
        module(x).sum().backward()
        if lap:
            clock.lap()

    try:
        return paired_ns(lambda: step(clocked, True), lambda: step(plain, False), max(calls // 10, 50))
    finally:
        clock.close()


@dataclass
class Live:
    """What the parts run measured on its live objects (ns)."""

    rows: int
    one_frame: bool | None
    guards: float | None  # ns per timed call
    guard_path: str
    clock_reads: int | None  # per recorded step
    follower_skip: float
    idle_counter: float
    watch_ns_per_cycle: float
    cycle_steps: int
    hooks_recorded: float | None = None  # ns in our hooks / step() per recorded step
    hooks_idle: float | None = None
    actions: float | None = None  # Lightning profiler actions per recorded step


@contextlib.contextmanager
def installed(timer: Any, model: nn.Module) -> Iterator[None]:
    """The live timer on the model as in a recorded step (the guards are asked in that state), taken off after."""
    model.train()
    timer.install(model)
    try:
        with torch.enable_grad():
            yield
    finally:
        timer.uninstall(model)
        timer.reset()
        model.zero_grad(set_to_none=True)


def guards_ns(timer: Any, model: nn.Module, calls: int) -> tuple[float | None, str]:
    """Dynamo's guard check before a timed call, as the timer asks it (``EntryGuards.fitting``; else ``check``)."""
    entry = getattr(timer, "_entry", None)
    if entry is None:
        return None, "no EntryGuards (guards asked by Dynamo's frame evaluation alone)"
    x = torch.randn(BATCH, 64)
    with installed(timer, model):
        run = entry.fitting((x,), {})[1]
        if run is not None:
            return per_call_ns(lambda: entry.fitting((x,), {}), calls), "EntryGuards.fitting (one frame: asked once)"
        missed = entry.check((x,), {})[1]
        return (per_call_ns(lambda: entry.check((x,), {}), calls),
                f"EntryGuards.check, then Dynamo's own (no capture fits: {missed or 'cannot tell'})")


def clock_reads(timer: Any, model: nn.Module) -> int | None:
    """The clock reads of one timed call of the live timer (its stamps, and the call's own three)."""
    samples = getattr(timer, "samples", None)
    if samples is None or not hasattr(samples, "fold"):
        return None

    def logged() -> int:  # (the node samples so far: the stamps the generated code logged, two a node, folded)
        samples.fold()
        return sum(len(durations) for durations in samples.durations)

    with installed(timer, model):
        before = logged()
        F.cross_entropy(model(torch.randn(BATCH, 64)), torch.randint(0, 10, (BATCH,))).backward()
        stamps = 2 * (logged() - before)
    anchors = 8 * bool(getattr(timer, "_trace_ranges", False))  # (node ranges: 4 reads at each end of a call)
    return stamps + 3 + anchors


def idle_counter_ns(engine: Any, calls: int) -> float:
    """``IdleSteps.step_ended`` on the live engine, in one long stretch (its batches to the follower included)."""
    idle, follow = engine.idle, engine.follow
    idle.begin(10**9, engine._train, follow, lambda trigger, step: None)
    try:
        return per_call_ns(idle.step_ended, calls)
    finally:
        idle.wake()


class WatchTimer:
    """``RegressionWatch.check`` wrapped on the class while a run lasts: ns and calls."""

    def __init__(self) -> None:
        self.ns = self.calls = 0
        self._check = RegressionWatch.check
        timer = self

        def check(watch: RegressionWatch, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return timer._check(watch, *args, **kwargs)
            finally:
                timer.ns += time.perf_counter_ns() - start
                timer.calls += 1

        RegressionWatch.check = check

    def close(self) -> None:
        RegressionWatch.check = self._check


def recorded_idle(values: list[int]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    idle, recorded, _ = split([float(v) for v in values])
    return recorded, idle


def parts_run(face: str, cycles: int, calls: int) -> Live:
    """A run with the defaults, its parts then timed on its live objects."""
    watch = WatchTimer()
    try:
        with tempfile.TemporaryDirectory() as directory:
            run = FACES[face]("ours", cycles, directory, parts=True)
    finally:
        watch.close()
    driver = run.driver
    engine = driver.profiler if isinstance(driver, FXProfilerCallback) else driver
    chosen = engine.timers.chosen.get(True)
    timer = chosen[0] if chosen is not None else None
    rows = len(engine.cycles[-1].nodes) if engine.cycles else 0
    guards, path = guards_ns(timer, run.model, calls) if timer is not None else (None, "no timer")
    reads = clock_reads(timer, run.model) if timer is not None else None
    live = Live(rows, getattr(timer, "_one_frame", None), guards, path, reads,
                per_call_ns(engine.follow.skip, calls), idle_counter_ns(engine, calls),
                watch.ns / max(watch.calls, 1), CYCLE)
    live.hooks_recorded, live.hooks_idle = recorded_idle(run.hook_ns)
    if run.actions:
        live.actions = recorded_idle(run.actions)[0]
    return live


# ------------------------------------------------------------------ the tables


def us(values: list[float], digits: int = 2) -> str:
    return estimate(values, digits) if values else "-"


def table(face: str, runs: dict[str, list[tuple[float, float, float]]], live: Live, direct: dict[str, float]) -> None:
    """Part, us per recorded step, us per node, us per idle step (median over rounds [~95 % interval])."""
    rows = max(live.rows, 1)

    def diff(a: str, b: str, which: int) -> list[float]:
        return [x[which] - y[which] for x, y in zip(runs[a], runs[b], strict=True)]

    width = 42
    print(f"\n{face}: MLP-199, {live.rows} rows; us per step, median over {len(runs['ours'])} round(s) "
          "[distribution-free ~95 % interval]")
    print(f"  {'step':<{width}} {'recorded':>22} {'idle':>22} {'cycle close, extra':>22}")
    for name in VARIANTS:
        rec, idle, close = (statistics.median(run[k] for run in runs[name]) for k in (1, 0, 2))
        print(f"  {name:<{width}} {rec:>22.1f} {idle:>22.1f} {close:>22.1f}")
    print(f"\n  {'part':<{width}} {'us / recorded step':>22} {'us / node':>22} {'us / idle step':>22}")

    def line(part: str, recorded: list[float] | float | None, idle: list[float] | float | None) -> None:
        def cell(v: list[float] | float | None, scale: float = 1.0) -> str:
            if v is None:
                return "-"
            if isinstance(v, list):
                return us([x / scale for x in v])
            return f"{v / scale:.2f}"
        print(f"  {part:<{width}} {cell(recorded):>22} {cell(recorded, rows):>22} {cell(idle):>22}")

    total = (diff("ours", "empty", 1), diff("ours", "empty", 0))
    line("ours - empty (measured total)", *total)
    line("torch.profiler alone - empty", diff("torch.profiler", "empty", 1), diff("torch.profiler", "empty", 0))
    line("ours - torch.profiler alone", diff("ours", "torch.profiler", 1), diff("ours", "torch.profiler", 0))
    line("recorded - idle (ours) - (recorded - idle (empty))",
         [a - b for a, b in zip(total[0], total[1], strict=True)], None)
    print(f"  {'-- from the options (ours - ours with it off)':<{width}}")
    parts_rec: list[list[float]] = []
    parts_idle: list[list[float]] = []
    for option, part in PART_OF.items():
        rec, idle = diff("ours", option, 1), diff("ours", option, 0)
        line(part, rec, idle)
        if option in DISJOINT:
            parts_rec.append(rec)
            parts_idle.append(idle)
    print(f"  {'-- timed directly (live objects of a run with the defaults)':<{width}}")
    for part, (rec_ns, idle_ns, inside) in direct.items():
        line(part, None if rec_ns is None else rec_ns / 1e3, None if idle_ns is None else idle_ns / 1e3)
        if not inside:
            parts_rec.append([(rec_ns or 0.0) / 1e3] * len(total[0]))
            parts_idle.append([(idle_ns or 0.0) / 1e3] * len(total[0]))
    summed_rec = [sum(values) for values in zip(*parts_rec, strict=True)]
    summed_idle = [sum(values) for values in zip(*parts_idle, strict=True)]
    summed = ", ".join(option.split("=")[0] for option in DISJOINT)
    print(f"  -- sum of the parts: the options {summed} and the direct parts outside FX timing")
    line("sum of the parts", summed_rec, summed_idle)
    line("measured total (ours - empty)", *total)
    line("unexplained (total - sum)", [t - s for t, s in zip(total[0], summed_rec, strict=True)],
         [t - s for t, s in zip(total[1], summed_idle, strict=True)])
    print(f"  guards: {live.guard_path}; the capture one frame: {live.one_frame}")
    watch_per_step = live.watch_ns_per_cycle / live.cycle_steps / 1e3
    close = diff("ours", "empty", 2)
    print(f"  at a cycle's close, per step of the run ({live.cycle_steps} steps a cycle; not in the steps above):")
    print(f"    the close step's extra, ours - empty: {us([c / live.cycle_steps for c in close])} us; of which the "
          f"regression watch's check {watch_per_step:.2f} us ({live.watch_ns_per_cycle / 1e3:.0f} us a cycle)")
    if live.hooks_recorded is not None:
        where = "our per-step hooks" if face == "Lightning fit" else "prof.step()"
        print(f"  inside {where} (the parts run, one run; holds the phases' lap, the timer's install, the trace's step): "
              f"{live.hooks_recorded / 1e3:.1f} us a recorded step, {live.hooks_idle / 1e3:.2f} us an idle step")


def direct_parts(face: str, live: Live, calls: int) -> dict[str, tuple[float | None, float | None, bool]]:
    """part -> (ns per recorded step, ns per idle step, inside FX timing: counted in ``fx_timing=False`` already)."""
    parts: dict[str, tuple[float | None, float | None, bool]] = {}
    parts["guards (1 call; see below)"] = (live.guards, None, True)
    parts["call wrapper (class swap, 1 call)"] = (wrapper_ns(calls), None, True)
    if live.clock_reads is not None:
        parts[f"clocks ({live.clock_reads} reads)"] = (live.clock_reads * clock_ns(calls), None, True)
    if face == "Lightning fit" and live.actions:
        parts[f"step phases (PhaseClock, {live.actions:.0f} actions)"] = (live.actions * phase_clock_ns(calls), None, False)
    elif face == "plain loop":
        parts["loop clock (LoopClock hooks, lap)"] = (loop_clock_ns(calls), None, False)
    parts["follower (Follow.skip at the step's end)"] = (live.follower_skip, None, False)
    parts["idle-step counter (IdleSteps.step_ended)"] = (None, live.idle_counter, False)
    return parts


def main() -> None:
    args = parse_args(__doc__)
    budget = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    stall, began = cpu_stall_us(), time.perf_counter()
    print(f"{package_state()}, torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} "
          f"thread(s), CPU; schedule skip_first={SKIP}, wait={WAIT}, warmup={WARMUP}, active={ACTIVE}; "
          f"{budget.cycles} cycles a run", flush=True)
    with tempfile.TemporaryDirectory() as directory:  # warm-up runs, thrown away (imports, Dynamo's first use)
        for face in FACES.values():
            for variant in ("ours", "torch.profiler"):
                face(variant, 3, directory)
    runs: dict[str, dict[str, list[tuple[float, float, float]]]] = {face: {v: [] for v in VARIANTS} for face in FACES}
    for r in budget.rounds:
        for face in shuffled(list(FACES), r):
            for variant in shuffled(VARIANTS, r * 7 + len(face)):
                with tempfile.TemporaryDirectory() as directory:
                    runs[face][variant].append(split(FACES[face](variant, budget.cycles, directory).periods))
        print(f"round {r + 1}: " + "; ".join(f"{face}: ours {runs[face]['ours'][-1][1]:.0f} / "
                                             f"{runs[face]['ours'][-1][0]:.0f} us, empty "
                                             f"{runs[face]['empty'][-1][1]:.0f} / {runs[face]['empty'][-1][0]:.0f} us"
                                             for face in FACES) + " (recorded / idle)", flush=True)
    for face in FACES:
        live = parts_run(face, 4, budget.calls)
        table(face, runs[face], live, direct_parts(face, live, budget.calls))
    isolated = step_overhead(mlp_workload(), budget.overhead_rounds, warmup=3, floor=True)
    print(f"\nbench_overhead's isolated figure, MLP-199 outside any Trainer ({isolated.nodes} nodes, "
          f"{len(isolated.per_node_us['NodeTimer'])} rounds, us per node):")
    print(f"  NodeTimer over eager (forward + backward)  {estimate(isolated.per_node_us['NodeTimer'], 2, ' us')}")
    print(f"  instrumentation alone (over the untimed graph) {estimate(isolated.probe_us, 2, ' us')}")
    if isolated.floor_gap_us:
        print(f"  floor (one RecordFunction-like C++ callback per autograd node, one clock read per boundary) "
              f"{estimate(isolated.per_node_us['floor'], 2, ' us')}")
        print(f"  ours - floor (paired)                      {estimate(isolated.floor_gap_us, 2, ' us')}")
    else:
        print(f"  no floor: {isolated.floor_missing}")
    print("", *closing_lines(stall, began), sep="\n")


if __name__ == "__main__":
    main()
