"""What fxprof_lightning costs and how accurate its node times are, measured in one process.

    .venv/bin/python benchmarks/bench_overhead.py           # full run, about 3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_overhead.py --quick   # smoke run, a few seconds of measuring

All on CPU, with torch's thread count left as it is. A "step" is a training step: forward, a
cross-entropy loss and backward (autograd on, no ``torch.no_grad`` anywhere in timed steps).

1. Idle overhead. A real ``lightning.pytorch.Trainer`` trains a residual MLP (forward, backward,
   SGD step) with an ``FXProfilerCallback`` that stays in its wait phase (``skip_first`` huge).
   Within one fit, the callback is in ``trainer.callbacks`` on every other step (pairs with/without,
   without/with, ...): a callback last in the list swaps in a list with or without it once a step's
   hooks have all run. A timing callback, first in the list, stamps every ``on_train_batch_start``;
   a step's time is the period to the next stamp, so it holds everything the loop does (data,
   forward, backward, optimizer, every hook, Lightning's dispatch to the callback). Pairing adjacent
   steps is far more precise on a busy machine than alternating whole fits. For scale, an empty
   ``pl.Callback()`` is measured the same way (what Lightning charges for any one more callback),
   and the callback's own per-step hooks are timed when called directly.
2. Timing overhead. Step time with ``NodeTimer(annotate=False)`` (other options at the package's
   defaults, so with backward timing where the package has it) installed over step time of the
   module's own (eager) forward, for torchvision ResNet18 (batch 8, 3x64x64) and a residual MLP of
   199 FX nodes (66 x [Linear(64, 64), ReLU, add] + head, batch 32). Per-node overhead is
   (timed - eager) / number of timed nodes. The untimed traced GraphModule and, where it exists,
   ``NodeTimer(backward=False)`` are measured too, which splits the cost into running the traced
   graph's code, the forward clock probes, and backward timing. Where backward times come from
   profiler events (``backward_events.BackwardEvents``), the recorder runs during the timed steps and
   is started and stopped between them (untimed), as the callback does once per cycle.
   On the MLP, a floor runs in the same rounds: what timing every node forward and backward costs
   at the least without torch.profiler (issue 30 item 8: ours at most floor + 0.5 us per node). It
   consists of (a) forward: the traced graph's generated code with, at every boundary between timed
   nodes, one ``time.perf_counter_ns()`` and one autograd sequence number appended to two lists,
   modules called from a list rather than looked up by attribute (``FloorProbes``; ours reads two
   clocks per node, the floor one per boundary; the sequence numbers stay in, since without them
   no backward time can be given to an FX node), and
   (b) backward: a C++ ``at::addGlobalCallback`` for ``RecordScope::BACKWARD_FUNCTION`` alone
   that stores each autograd node's sequence number and two ``steady_clock`` timestamps into a
   preallocated vector; registering any such callback makes the autograd engine open a
   ``RecordFunction`` around every node it runs, which is torch's own price and the bulk of the
   floor. It is built once with ``torch.utils.cpp_extension.load_inline`` into
   ``FLOOR_BUILD_DIR`` (in the temp directory; about 40 s the first time), registered and removed
   between the timed steps; without a compiler the floor is reported unavailable and the rest
   runs. Printed: the floor per node over eager, and ours - floor paired per round, against 0.5 us.
2b. Under torch.profiler. The MLP again, each round of steps inside one ``torch.profiler.profile``
   (CPU), as the callback runs one per cycle: ``NodeTimer(annotate=False)`` and
   ``NodeTimer(annotate=True)`` over the profiled eager step, per node. Backward times would come
   from the profiler's events, so no backward recorder runs.
3. Baseline. The ``ProfilingInterpreter`` of the torch.fx tutorial "Building a Simple CPU
   Performance Profiler with FX" (an ``fx.Interpreter`` whose ``run_node`` wraps
   ``super().run_node`` with ``time.time()``), re-implemented below, on the same two models.
4. torch.profiler inflation (ResNet18). The sum of per-node median times measured by
   ``NodeTimer(annotate=True)`` inside ``torch.profiler.profile(activities=[CPU])`` over the same
   sum measured by ``NodeTimer(annotate=False)`` without a profiler.
5. Accuracy (ResNet18). Our per-node median forward times against two references:
   a. each ``call_module`` node's module timed alone with ``torch.utils.benchmark.Timer`` on the
      very input it receives in the forward (captured once with forward pre-hooks); also with
      8 MiB written right before each timed call, so that it meets cold caches as in a forward;
      and also with each output kept until the end of the round, so that every call writes
      fresh memory, as in a training forward whose activations autograd keeps;
   b. torch.profiler: the inclusive CPU time of the ``record_function`` range that
      ``annotate=True`` opens around each node, compared with our time of the same executions,
      and with our unprofiled time.
   Reported: the median of ours/reference over nodes and the worst ratio among the ten slowest.

Method against noise (the machine is shared): the variants of a comparison are interleaved step
by step, their order shuffled every round, so that load from other processes falls on all of them
alike. A result is the median over rounds of the paired per-round
ratio (or difference), shown with a distribution-free ~95 % confidence interval of that median;
the verdict is "inconclusive" when the interval straddles the goal. Each part stops adding rounds
after a time box (past a minimum), so a busy machine gives fewer rounds, not a run of an hour.
``--threads N`` sets torch's thread count (default: left as it is); on a shared 2-core machine
``--threads 1`` is far less sensitive to other processes.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import inspect
import logging
import math
import operator
import os
import pathlib
import platform
import random
import statistics
import sys
import tempfile
import time
import timeit
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torchvision
from run_info import contention, cpu_stall_us, median_ci, package_state, parse_args, quiet_stderr
from torch import fx, nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity
from torch.utils.data import DataLoader, TensorDataset

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.nodes import is_timed
from fxprof_lightning.timing import node_timing
from fxprof_lightning.timing.backward_events import BackwardEvents
from fxprof_lightning.timing.fx_timer import FxNodeTimer as NodeTimer  # (the node timer over a traced graph alone)

logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on import
from torch.utils import benchmark  # noqa: E402  (after the logger is quietened)


@dataclass(frozen=True)
class Rounds:
    """At least ``least`` and at most ``most`` rounds; past ``least``, none starts after ``seconds``.

    The time box keeps a run short when other processes slow the machine down, at the price of
    fewer rounds (each result says how many it got).
    """

    least: int
    most: int
    seconds: float

    def __iter__(self) -> Iterator[int]:
        deadline = time.perf_counter() + self.seconds
        for r in range(self.most):
            if r >= self.least and time.perf_counter() > deadline:
                return
            yield r


@dataclass(frozen=True)
class Budget:
    """How many repetitions each part makes."""

    idle: Rounds  # part 1: pairs of steps (one with the callback, one without) in one fit
    idle_skip: int  # first steps of the fit left out (warm-up)
    resnet: Rounds  # parts 2 and 3 on ResNet18: rounds of one step per variant
    mlp: Rounds  # the same on the (much faster) MLP
    mlp_profiled: Rounds  # part 2b: rounds of one profiled step per variant on the MLP
    warmup: int  # untimed steps per variant before measuring
    ref: Rounds  # parts 4 and 5: rounds of (plain steps, profiled steps, modules alone)
    ref_steps: int  # training steps per variant per round in parts 4 and 5
    ref_calls: int  # single timed calls per module per round for the benchmark.Timer reference


FULL = Budget(idle=Rounds(50, 1000, 12), idle_skip=10, resnet=Rounds(8, 120, 40), mlp=Rounds(20, 300, 20), mlp_profiled=Rounds(20, 150, 15),
              warmup=5, ref=Rounds(4, 30, 40), ref_steps=2, ref_calls=2)
QUICK = Budget(idle=Rounds(20, 20, 0), idle_skip=4, resnet=Rounds(4, 4, 0), mlp=Rounds(10, 10, 0), mlp_profiled=Rounds(4, 4, 0),
               warmup=2, ref=Rounds(2, 2, 0), ref_steps=1, ref_calls=2)


# ------------------------------------------------------------------ the package's API, as it is


def trace_module(model: nn.Module) -> fx.GraphModule:
    """The package's tracer where it has one, else ``torch.fx.symbolic_trace``."""
    trace = getattr(node_timing, "trace_module", None) or fx.symbolic_trace
    return trace(model)


def kept(timer: NodeTimer) -> Any:
    """What holds the rows and their samples (``nodes``, ``fwd``, ``anchors``...): ``timer.samples``, or the timer
    itself in older versions."""
    samples = getattr(timer, "samples", None)
    return samples if hasattr(samples, "fwd") else timer


def forward_samples(timer: NodeTimer) -> list[list[int]]:
    """Forward durations (ns) per node: ``timer.samples.fwd``; ``timer.fwd``, or ``timer.samples`` in older versions."""
    return kept(timer).fwd if hasattr(kept(timer), "fwd") else timer.samples


def has_backward_option() -> bool:
    return "backward" in inspect.signature(NodeTimer).parameters


def has_trace_ranges() -> bool:
    """Whether node ranges can be written into the trace afterwards (``NodeTimer(trace_ranges=True)``)."""
    return "trace_ranges" in inspect.signature(NodeTimer).parameters


# ------------------------------------------------------------------ models and steps


class ResidualMLP(nn.Module):
    """``blocks`` x [Linear, ReLU, residual add] and a head: 3 * blocks + 1 FX nodes of small layers.

    The layers are called straight from ``forward`` (no block modules), so eager and traced
    forwards make the same module calls.
    """

    def __init__(self, blocks: int = 66, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, act in zip(self.linears, self.acts, strict=True):
            x = x + act(linear(x))
        return self.head(x)


@dataclass
class Workload:
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor


def resnet18_workload() -> Workload:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return Workload("ResNet18", model, torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,)))


def mlp_workload() -> Workload:
    torch.manual_seed(0)
    return Workload("MLP-199", ResidualMLP(), torch.randn(32, 64), torch.randint(0, 10, (32,)))


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], work: Workload) -> int:
    """One forward + loss + backward through ``forward``; its wall time in ns (zero_grad untimed)."""
    work.model.zero_grad(set_to_none=True)
    start = time.perf_counter_ns()
    F.cross_entropy(forward(work.x), work.y).backward()
    return time.perf_counter_ns() - start


# ------------------------------------------------------------------ statistics


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired(a: list[float], b: list[float], how: Callable[[float, float], float]) -> list[float]:
    return [how(x, y) for x, y in zip(a, b, strict=True)]


def estimate(values: list[float], digits: int = 3, unit: str = "") -> str:
    """'median [ci low-ci high]' of per-round values."""
    low, high = median_ci(values)
    return f"{median(values):.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]{unit}"


def judge(values: list[float], goal: float) -> str:
    """'ok' when the median's confidence interval is at or under the goal, 'MISSED' when it is
    above, 'inconclusive' when it straddles the goal (the machine was too noisy to tell)."""
    low, high = median_ci(values)
    if high <= goal:
        return "ok"
    if low > goal:
        return "MISSED"
    return "inconclusive"


# ------------------------------------------------------------------ part 1: idle overhead in a Trainer


class LitClassifier(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(pl.Callback):
    """First in the callback list: stamps every ``on_train_batch_start``, so a period spans a whole step."""

    def __init__(self) -> None:
        self.stamps: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.stamps.append(time.perf_counter_ns())


def extra_present(step: int) -> bool:
    """Steps with the extra callback: with, without, without, with, ... (pairs AB, BA, AB, ...)."""
    return step % 4 in (0, 3)


class Alternator(pl.Callback):
    """Last in the callback list: once all of a step's hooks have run, swaps ``trainer.callbacks``
    for a list with or without the extra callback for the next step (the list in use is never
    mutated), and stops the fit when the time box is spent."""

    def __init__(self, extra: pl.Callback, pairs: Rounds) -> None:
        self.extra, self.pairs = extra, pairs
        self.present: list[bool] = []  # per step: was the extra callback in the list
        self._with: list[pl.Callback] = []
        self._without: list[pl.Callback] = []
        self._deadline = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._with = list(trainer.callbacks)
        self._without = [c for c in self._with if c is not self.extra]
        self._deadline = time.perf_counter() + self.pairs.seconds

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.present.append(any(c is self.extra for c in trainer.callbacks))
        pairs = len(self.present) // 2
        if pairs >= self.pairs.least and time.perf_counter() > self._deadline:
            trainer.should_stop = True
        ending = trainer.should_stop or len(self.present) >= trainer.max_steps
        trainer.callbacks = self._with if ending or extra_present(len(self.present)) else self._without


def fit_alternating(extra: pl.Callback, pairs: Rounds, root: str) -> tuple[list[int], list[bool], pl.Trainer, LitClassifier]:
    """One fit of the MLP whose steps alternate with and without the ``extra`` callback.

    Returns the step periods (ns), whether each step had the callback, the Trainer and the module.
    """
    torch.manual_seed(0)
    lit = LitClassifier(ResidualMLP())
    steps = 2 * pairs.most + 2
    loader = DataLoader(TensorDataset(torch.randn(steps * 32, 64), torch.randint(0, 10, (steps * 32,))), batch_size=32)
    clock = StepClock()
    alternator = Alternator(extra, pairs)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[clock, extra, alternator],
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, loader)
    periods = [b - a for a, b in zip(clock.stamps[:-1], clock.stamps[1:], strict=True)]
    return periods, alternator.present[: len(periods)], trainer, lit


def hook_cost_ns(trainer: pl.Trainer, lit: LitClassifier, profiler: FXProfilerCallback, calls: int = 20000) -> float:
    """ns per step spent in the idle callback's own per-step hooks (Lightning's dispatch excluded)."""
    loss, optimizer = torch.zeros(()), trainer.optimizers[0]
    per_step = {  # the hooks Lightning calls once per training step, with their arguments
        "on_train_batch_start": (None, 0),
        "on_before_backward": (loss,),
        "on_after_backward": (),
        "on_before_optimizer_step": (optimizer,),
        "on_before_zero_grad": (optimizer,),
        "on_train_batch_end": (None, None, 0),
    }
    hooks = [(getattr(profiler, name), args) for name, args in per_step.items()
             if getattr(type(profiler), name) is not getattr(pl.Callback, name)]  # only those it overrides
    start = time.perf_counter_ns()
    for _ in range(calls):
        for hook, args in hooks:
            hook(trainer, lit, *args)
    return (time.perf_counter_ns() - start) / calls


@dataclass
class IdleResult:
    ratios: list[float]  # per pair of adjacent steps: with / without the idle FXProfilerCallback
    empty_ratios: list[float]  # the same with an empty pl.Callback(): what any callback costs
    without_ms: float
    with_ms: float
    hook_ns: float


def paired_steps(periods: list[int], present: list[bool], skip: int) -> tuple[list[float], list[int], list[int]]:
    """Per pair of adjacent steps (one with, one without): the ratio, and the two periods."""
    ratios, with_, without = [], [], []
    for k in range(2 * (skip // 2), len(periods) - 1, 2):
        pair = {present[k]: periods[k], present[k + 1]: periods[k + 1]}
        if len(pair) == 2:
            ratios.append(pair[True] / pair[False])
            with_.append(pair[True])
            without.append(pair[False])
    return ratios, with_, without


def idle_overhead(budget: Budget) -> IdleResult:
    """Step periods with / without the idle callback, paired step by step inside one fit; then the
    same with an empty callback, for Lightning's own cost of one more callback."""
    with tempfile.TemporaryDirectory() as root:
        profiler = FXProfilerCallback(skip_first=10**9, module="net", dirpath=root)
        periods, present, trainer, lit = fit_alternating(profiler, budget.idle, root)
        ratios, with_, without = paired_steps(periods, present, budget.idle_skip)
        hook_ns = hook_cost_ns(trainer, lit, profiler)
        periods, present, _, _ = fit_alternating(pl.Callback(), budget.idle, root)
        empty_ratios, _, _ = paired_steps(periods, present, budget.idle_skip)
    return IdleResult(ratios, empty_ratios, median(without) / 1e6, median(with_) / 1e6, hook_ns)


# ------------------------------------------------------------------ parts 2 and 3: step overhead


class ProfilingInterpreter(fx.Interpreter):
    """The torch.fx tutorial's profiler: ``time.time()`` around every ``run_node``, into a dict of lists."""

    def __init__(self, mod: nn.Module) -> None:
        gm = fx.symbolic_trace(mod)
        super().__init__(gm)
        self.total_runtime_sec: list[float] = []
        self.runtimes_sec: dict[fx.Node, list[float]] = {}

    def run(self, *args: Any) -> Any:
        t_start = time.time()
        return_val = super().run(*args)
        t_end = time.time()
        self.total_runtime_sec.append(t_end - t_start)
        return return_val

    def run_node(self, n: fx.Node) -> Any:
        t_start = time.time()
        return_val = super().run_node(n)
        t_end = time.time()
        self.runtimes_sec.setdefault(n, [])
        self.runtimes_sec[n].append(t_end - t_start)
        return return_val


def _nothing() -> None:
    pass


@dataclass
class Variant:
    """One way of running the forward: ``enter``/``exit`` run untimed around each step."""

    name: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    enter: Callable[[], None] = _nothing
    exit: Callable[[], None] = _nothing
    after_ns: list[int] = field(default_factory=list)  # per step: the timer's work after it (making samples), untimed
    backward_nodes: list[int] = field(default_factory=list)  # per step, the floor: autograd nodes its callback timed


def swap_forward(name: str, module: nn.Module, forward: Callable) -> Variant:
    """A variant that runs ``module(...)`` with another forward, swapped in as NodeTimer.install does."""

    def enter() -> None:
        module.forward = forward

    def exit_() -> None:
        del module.forward

    return Variant(name, module, enter, exit_)


def timer_variant(name: str, model: nn.Module, timer: NodeTimer) -> Variant:
    """Steps with ``timer`` installed, as the callback does it; samples are dropped before each step.

    Where the timer takes backward times from profiler events (``BackwardEvents``), they are recorded
    over the step too (not for ``backward=False``: before 2026-11-23 they were, which put their cost on that variant), started and stopped outside the timed part, as the callback does once a cycle.
    Where the generated code only logs clock reads, they become samples when ``timer.fwd`` is first read:
    the callback reads it once, after the cycle; here it is read after each step, outside the timed part,
    and its time is kept in ``after_ns``.
    """
    times_backward_from_events = getattr(timer, "uses_backward_events", True)
    events = BackwardEvents() if times_backward_from_events else None

    def enter() -> None:
        timer.reset()
        if events is not None:
            events.start()
        timer.install(model)

    def exit_() -> None:
        timer.uninstall(model)
        start = time.perf_counter_ns()
        forward_samples(timer)  # (makes the samples)
        variant.after_ns.append(time.perf_counter_ns() - start)
        if events is not None:
            timer.add_backward(events.stop())

    variant = Variant(name, model, enter, exit_)
    return variant


def events_variant(model: nn.Module) -> Variant:
    """Eager steps with the backward recorder running: what timing backward from profiler events costs alone."""
    events = BackwardEvents()
    return Variant("eager + BackwardEvents", model, events.start, events.stop)


# The floor of per-node timing without torch.profiler (issue 30 item 8): what torch itself charges to time every
# autograd node in backward, plus the cheapest forward probe per node. A global RecordFunction callback for the
# backward scope alone makes the autograd engine open a RecordFunction around every node it runs (with the node's
# name built as a string, torch/csrc/autograd/node.h); kineto's callbacks (``BackwardEvents``) do more per event.
_FLOOR_CPP = r"""
#include <ATen/record_function.h>
#include <atomic>
#include <chrono>
#include <vector>

namespace {
struct Record { int64_t sequence_nr, start_ns, end_ns; };
std::vector<Record> records;  // preallocated by start(); what does not fit is counted, not kept
std::atomic<size_t> used{0};
at::CallbackHandle handle = 0;
thread_local std::vector<size_t> open;  // the records of the nodes running on this thread, innermost last

int64_t now_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  size_t i = used.fetch_add(1, std::memory_order_relaxed);
  if (i < records.size()) records[i] = Record{fn.seqNr(), now_ns(), 0};
  open.push_back(i);
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) {
  int64_t t = now_ns();
  size_t i = open.back();
  open.pop_back();
  if (i < records.size()) records[i].end_ns = t;
}
}  // namespace

void start(int64_t capacity) {
  TORCH_CHECK(handle == 0, "the floor's callback is already registered");
  if (records.size() < static_cast<size_t>(capacity)) records.resize(capacity);
  used = 0;
  handle = at::addGlobalCallback(
      at::RecordFunctionCallback(on_start, on_end).scopes({at::RecordScope::BACKWARD_FUNCTION}));
}

int64_t stop() {  // the number of autograd nodes recorded since start()
  if (handle != 0) at::removeCallback(handle);
  handle = 0;
  return static_cast<int64_t>(used.load());
}
"""

# One build per Python environment and torch (a build is tied to the headers and libraries it was made with).
FLOOR_BUILD_DIR = (pathlib.Path(tempfile.gettempdir()) / "fxprof_lightning_bench"
                   / f"backward_floor-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]}-torch{torch.__version__}")


def floor_extension() -> tuple[Any, str]:
    """The floor's C++ callback, built once with ``load_inline`` (cached in ``FLOOR_BUILD_DIR``), or None and why not."""
    try:
        from torch.utils.cpp_extension import load_inline

        FLOOR_BUILD_DIR.mkdir(parents=True, exist_ok=True)
        with quiet_stderr():
            return load_inline("fxprof_bench_backward_floor", cpp_sources=[_FLOOR_CPP], functions=["start", "stop"],
                               build_directory=str(FLOOR_BUILD_DIR)), ""
    except Exception as error:  # no compiler, no ninja, no Python headers: the benchmark goes on without the floor
        first_line = next(iter(str(error).strip().splitlines()), "")
        return None, f"{type(error).__name__}: {first_line[:200]}"


class FloorProbes:
    """The floor's forward: the traced graph with, at every boundary between timed nodes, one clock read and one
    autograd sequence-number read appended to two lists; the least a per-node timer of forward and backward must
    note (the sequence numbers say which FX node made each autograd node the backward callback times). Modules are
    called from a list handed to the call, not looked up through ``self.linears`` etc., as ours does (``_callee``
    in the package's code generator): those lookups cost about as much as the probes and are no part of timing."""

    def __init__(self, traced: fx.GraphModule) -> None:
        self.stamps: list[int] = []
        self.sequence_nrs: list[int] = []
        self.modules: list[nn.Module] = []
        graph = fx.Graph()
        graph.set_codegen(copy.deepcopy(traced.graph._codegen))
        copies: dict[fx.Node, fx.Node] = {}
        logs: Any = None
        for node in traced.graph.nodes:
            if node.op != "placeholder" and logs is None:
                logs = graph.call_function(self.begin)
                stamps, sequence_nrs, autograd, modules = (graph.call_function(operator.getitem, (logs, i)) for i in range(4))
                self._probe(graph, stamps, sequence_nrs, autograd)
            if node.op == "call_module":
                self.modules.append(traced.get_submodule(node.target))
                callee = graph.call_function(operator.getitem, (modules, len(self.modules) - 1))
                args, kwargs = fx.map_arg((node.args, node.kwargs), copies.__getitem__)
                copies[node] = graph.call_method("__call__", (callee, *args), kwargs)
            else:
                copies[node] = graph.node_copy(node, copies.__getitem__)
            if is_timed(node):
                self._probe(graph, stamps, sequence_nrs, autograd)
        self.module = fx.GraphModule(traced, graph, class_name=f"{type(traced).__name__}Floor")

    @staticmethod
    def _probe(graph: fx.Graph, stamps: fx.Node, sequence_nrs: fx.Node, autograd: fx.Node) -> None:
        graph.call_method("append", (stamps, graph.call_function(time.perf_counter_ns)))
        graph.call_method("append", (sequence_nrs, graph.call_method("_get_sequence_nr", (autograd,))))

    def begin(self) -> tuple[list[int], list[int], Any, list[nn.Module]]:
        return self.stamps, self.sequence_nrs, torch._C._autograd, self.modules

    def clear(self) -> None:
        self.stamps.clear()
        self.sequence_nrs.clear()


def floor_variant(model: nn.Module, extension: Any) -> Variant:
    """Steps through ``FloorProbes`` with the floor's backward callback registered, both put in place and taken
    away between the timed steps (as ``timer_variant`` does with the timer and its recorder)."""
    probes = FloorProbes(trace_module(model))

    def enter() -> None:
        probes.clear()
        extension.start(1 << 16)
        model.forward = probes.module.forward

    def exit_() -> None:
        del model.forward
        variant.backward_nodes.append(extension.stop())

    variant = Variant("floor", model, enter, exit_)
    return variant


def step_variants(work: Workload, floor: Any = None) -> tuple[list[Variant], int]:
    """eager, NodeTimer (package defaults, annotate=False), untimed GraphModule, the tutorial's
    interpreter, NodeTimer(backward=False) where the package has that option, and the floor where its
    C++ extension (``floor``) is given; the node count."""
    model = work.model
    timer = NodeTimer(trace_module(model), annotate=False)
    variants = [
        Variant("eager", model),
        timer_variant("NodeTimer", model, timer),
        swap_forward("untimed GraphModule", model, trace_module(model).forward),
        Variant("ProfilingInterpreter", ProfilingInterpreter(model).run),
    ]
    if has_backward_option():
        forward_only = NodeTimer(trace_module(model), annotate=False, backward=False)
        variants.append(timer_variant("NodeTimer backward=False", model, forward_only))
    variants.append(events_variant(model))
    if floor is not None:
        variants.append(floor_variant(model, floor))
    return variants, len(kept(timer).nodes)


def shuffled(items: list[Any], seed: int) -> list[Any]:
    order = list(items)
    random.Random(seed).shuffle(order)
    return order


def run_interleaved(variants: list[Variant], work: Workload, rounds: Rounds, warmup: int) -> dict[str, list[int]]:
    """Step times (ns) per variant; one step of each per round, in an order shuffled every round
    (a fixed rotation would always run each variant right after the same other one, whose
    garbage or cache footprint it would then pay for)."""
    for variant in variants:
        for _ in range(warmup):
            variant.enter()
            train_step(variant.forward, work)
            variant.exit()
    times: dict[str, list[int]] = {v.name: [] for v in variants}
    for r in rounds:
        for variant in shuffled(variants, r):
            variant.enter()
            times[variant.name].append(train_step(variant.forward, work))
            variant.exit()
    return times


@dataclass
class StepResult:
    name: str
    nodes: int
    eager_ms: float
    ratios: dict[str, list[float]]  # variant -> per-round ratio to eager
    per_node_us: dict[str, list[float]]  # variant -> per-round (variant - eager) / nodes
    probe_us: list[float]  # per-round (NodeTimer - untimed GraphModule) / nodes
    samples_us: list[float]  # per step: NodeTimer's work making samples after it (untimed), / nodes
    floor_gap_us: list[float] = field(default_factory=list)  # per-round (NodeTimer - floor) / nodes
    floor_backward_nodes: list[int] = field(default_factory=list)  # per step: autograd nodes the floor timed
    floor_missing: str = ""  # why there is no floor (its C++ extension did not build), when it was asked for


def step_overhead(work: Workload, rounds: Rounds, warmup: int, floor: bool = False) -> StepResult:
    """Our variants interleaved with eager steps (and with the floor, if asked and its extension
    builds); the tutorial's interpreter in a run of its own with eager steps (its garbage would
    otherwise land on whichever variant runs after it)."""
    extension, missing = floor_extension() if floor else (None, "")
    variants, nodes = step_variants(work, extension)
    eager, interpreter = variants[0], next(v for v in variants if v.name == "ProfilingInterpreter")
    times = run_interleaved([v for v in variants if v is not interpreter], work, rounds, warmup)
    baseline = run_interleaved([eager, interpreter], work, rounds, warmup)
    ratios, per_node = {}, {}
    for run in (times, baseline):  # each variant against the eager steps of its own run
        for name, t in run.items():
            if name != "eager":
                ratios[name] = paired(t, run["eager"], lambda a, b: a / b)
                per_node[name] = paired(t, run["eager"], lambda a, b: (a - b) / 1e3 / nodes)
    probe = paired(times["NodeTimer"], times["untimed GraphModule"], lambda a, b: (a - b) / 1e3 / nodes)
    after = [ns / 1e3 / nodes for ns in next(v for v in variants if v.name == "NodeTimer").after_ns]
    result = StepResult(work.name, nodes, median(times["eager"]) / 1e6, ratios, per_node, probe, after, floor_missing=missing)
    if "floor" in times:
        result.floor_gap_us = paired(times["NodeTimer"], times["floor"], lambda a, b: (a - b) / 1e3 / nodes)
        result.floor_backward_nodes = next(v for v in variants if v.name == "floor").backward_nodes
    return result


def profiled_overhead(work: Workload, rounds: Rounds, warmup: int) -> dict[str, list[float]]:
    """Per-node cost of FX timing where torch.profiler records the same steps (the callback's default).

    Each round runs one step of each variant inside one ``torch.profiler.profile`` (CPU), as the
    callback runs one profiler per cycle: the eager forward, ``NodeTimer(annotate=False)`` and
    ``NodeTimer(annotate=True)`` (a ``record_function`` range per node: the callback's setting when
    it writes traces in versions before ``trace_ranges``) and, where the package has it,
    ``NodeTimer(trace_ranges=True)`` (the callback's setting now: node starts kept, one anchor range per
    forward call, the ranges written into the exported trace afterwards). Backward times come from the
    profiler's own events, so no backward recorder runs. Returns per-round (variant - eager) / nodes in
    microseconds, and under "write ms" the time ``add_node_ranges`` takes, once, on one profiled step's trace.
    """
    traced = trace_module(work.model)
    timers = {"annotate=False": NodeTimer(traced, annotate=False), "annotate=True": NodeTimer(traced, annotate=True)}
    if has_trace_ranges():
        timers["trace_ranges=True"] = NodeTimer(traced, trace_ranges=True)
    # (timer_variant's backward recorder declines to start: the profiler is running.)
    variants = [Variant("eager", work.model)] + [timer_variant(name, work.model, t) for name, t in timers.items()]
    nodes = len(kept(timers["annotate=False"]).nodes)

    def one_round(r: int) -> dict[str, int]:
        times = {}
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]):
            for variant in shuffled(variants, r):
                variant.enter()
                times[variant.name] = train_step(variant.forward, work)
                variant.exit()
        return times

    with quiet_stderr():
        for r in range(warmup):
            one_round(r)
        measured = [one_round(r) for r in rounds]
        per_node = {name: [(t[name] - t["eager"]) / 1e3 / nodes for t in measured] for name in timers}
        if has_trace_ranges():
            per_node["write ms"] = [write_ranges_ms(work, timers["trace_ranges=True"])]
    return per_node


def write_ranges_ms(work: Workload, timer: NodeTimer) -> float:
    """Milliseconds ``add_node_ranges`` takes to write one profiled step's node ranges (forward and backward)
    into its exported trace."""
    from fxprof_lightning.timing.torch_trace import add_node_ranges

    timer.reset()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        timer.install(work.model)
        train_step(work.model, work)
        timer.uninstall(work.model)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "step.pt.trace.json.gz")
        prof.export_chrome_trace(path)
        began = time.perf_counter()
        samples = kept(timer)
        add_node_ranges(pathlib.Path(path), list(samples.anchors), samples.range_spans(), samples.backward_calls())
        return (time.perf_counter() - began) * 1e3


# ------------------------------------------------------------------ parts 4 and 5: profiler and accuracy


def capture_module_inputs(model: nn.Module, traced: fx.GraphModule, x: torch.Tensor) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """For every call_module node: its module and a copy of the input it gets in a training forward.

    Forward pre-hooks record each module's inputs in call order; the k-th call of a module that
    the graph calls several times (ResNet's shared ReLUs) belongs to its k-th node. The copy keeps
    requires_grad and, when it requires grad, is made a non-leaf so an in-place ReLU may run on it.
    """
    modules = dict(model.named_modules())
    targets = [node for node in traced.graph.nodes if node.op == "call_module"]
    calls: dict[str, list[torch.Tensor]] = defaultdict(list)
    handles = []
    for path in {str(node.target) for node in targets}:
        def hook(module: nn.Module, args: tuple, path: str = path) -> None:
            calls[path].append(args[0].detach().clone().requires_grad_(args[0].requires_grad))
        handles.append(modules[path].register_forward_pre_hook(hook))
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    seen: dict[str, int] = defaultdict(int)
    inputs = {}
    for node in targets:
        path = str(node.target)
        tensor = calls[path][seen[path]]
        seen[path] += 1
        inputs[node.name] = (modules[path], tensor.clone() if tensor.requires_grad else tensor)
    return inputs


# Written before each "caches flushed" reference call: more than the L2 cache of current CPUs.
FLUSH_BYTES = 8 * 2**20


def module_timers(inputs: dict[str, tuple[nn.Module, torch.Tensor]], flush: bool,
                  kept: list[Any] | None = None) -> dict[str, benchmark.Timer]:
    """A ``benchmark.Timer`` per node, with the steps' thread count (Timer defaults to 1) and a plain
    clock: the default one asks ``torch.accelerator.is_available()`` at every read, which costs
    ~40 us once Lightning is imported in a CUDA build of torch without a GPU.

    With ``flush``, the setup (run by ``timeit(1)`` right before the timed call) writes
    ``FLUSH_BYTES``, so the call finds cold caches, more like inside a forward than a tight loop.
    With ``kept``, each output is appended to it (the caller empties it once per round), so every
    call writes fresh memory, as in a training forward, where autograd keeps the activations.
    """
    threads = torch.get_num_threads()
    setup = "flush.add_(1)" if flush else "pass"
    buffer = torch.zeros(FLUSH_BYTES // 4)
    stmt = "kept.append(m(x))" if kept is not None else "m(x)"
    return {
        name: benchmark.Timer(stmt, setup=setup, globals={"m": m, "x": x, "flush": buffer, "kept": kept},
                              num_threads=threads, timer=timeit.default_timer)
        for name, (m, x) in inputs.items()
    }


@dataclass
class ReferenceData:
    """Per-node samples in microseconds, all from interleaved rounds on one ResNet18."""

    names: list[str]
    ref_steps: int
    rounds: int = 0
    ours: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # annotate=False, no profiler
    ours_profiled: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # annotate=True, profiled
    ranges: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # record_function ranges
    module_alone: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # benchmark.Timer
    module_cold: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # the same, caches flushed
    module_fresh: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # flushed, outputs kept


def timed_steps(work: Workload, timer: NodeTimer, steps: int, into: dict[str, list[float]]) -> None:
    timer.reset()
    timer.install(work.model)
    try:
        for _ in range(steps):
            train_step(work.model, work)
    finally:
        timer.uninstall(work.model)
    for info, samples in zip(kept(timer).nodes, forward_samples(timer), strict=True):
        into[info.name] += [ns / 1e3 for ns in samples]


def profiled_steps(work: Workload, timer: NodeTimer, steps: int, data: ReferenceData) -> None:
    with quiet_stderr(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_steps(work, timer, steps, data.ours_profiled)
    names = set(data.names)
    for event in prof.events():
        if event.is_user_annotation and event.name in names:
            data.ranges[event.name].append(event.cpu_time_total)


def reference_rounds(work: Workload, budget: Budget) -> ReferenceData:
    traced = trace_module(work.model)
    plain = NodeTimer(traced, annotate=False)
    # The range of annotate=True also encloses NodeTimer's bookkeeping after the node (with backward
    # timing: noting the autograd sequence range it made); leave that out so the range measures the node.
    annotated = NodeTimer(traced, annotate=True, **({"backward": False} if has_backward_option() else {}))
    inputs = capture_module_inputs(work.model, traced, work.x)
    kept: list[Any] = []
    warm, cold = module_timers(inputs, flush=False), module_timers(inputs, flush=True)
    fresh = module_timers(inputs, flush=True, kept=kept)
    data = ReferenceData([info.name for info in getattr(plain, "samples", plain).nodes], budget.ref_steps)

    def ours() -> None:
        timed_steps(work, plain, budget.ref_steps, data.ours)

    def profiled() -> None:
        profiled_steps(work, annotated, budget.ref_steps, data)

    def alone() -> None:  # single calls, so that a burst of load spoils one sample, not a mean
        for name in inputs:
            for _ in range(budget.ref_calls):
                data.module_alone[name].append(warm[name].timeit(1).median * 1e6)
                data.module_cold[name].append(cold[name].timeit(1).median * 1e6)
                data.module_fresh[name].append(fresh[name].timeit(1).median * 1e6)
        kept.clear()

    parts = [ours, profiled, alone]
    for part in parts:  # warm-up, thrown away
        part()
    data = ReferenceData(data.names, budget.ref_steps)
    for r in budget.ref:
        data.rounds += 1
        for part in shuffled(parts, r):
            part()
    return data


def node_medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: median(values) for name, values in samples.items() if values}


def node_lows(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per-node 10th percentile: closer to the unloaded time when other processes steal cores."""
    return {name: statistics.quantiles(values, n=10, method="inclusive")[0] for name, values in samples.items() if len(values) > 1}


@dataclass
class Agreement:
    median_ratio: float
    worst_ratio: float
    worst_node: str
    nodes: int


def agreement(ours: dict[str, float], reference: dict[str, float]) -> Agreement:
    """Median of ours/reference over shared nodes; the worst (farthest from 1) among our ten slowest."""
    shared = [name for name in ours if name in reference and reference[name] > 0]
    ratios = {name: ours[name] / reference[name] for name in shared}
    slowest = sorted(shared, key=ours.__getitem__, reverse=True)[:10]
    worst = max(slowest, key=lambda name: abs(math.log(ratios[name])))
    return Agreement(median(list(ratios.values())), ratios[worst], worst, len(shared))


# ------------------------------------------------------------------ report


def contention_note(stall_start: int | None, wall_start: float) -> str:
    """How much of the run's wall time some task (ours or not) waited for a CPU: the noise level."""
    share = contention(stall_start, wall_start)
    if share is None:
        return "CPU contention during the run: unknown (no /proc/pressure/cpu)"
    return (f"CPU contention during the run: some task waited for a CPU {100 * share:.0f} % of the time "
            "(/proc/pressure/cpu; near 0 on an idle machine, results above ~30 % are noisy)")


def header(quick: bool) -> str:
    load = " ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return "\n".join([
        f"fxprof_lightning overhead benchmark ({'quick' if quick else 'full'} run)",
        f"date      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine   {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load avg {load}",
        f"versions  python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}, lightning {lightning.__version__}",
        f"package   {package_state()}",
        "method    variants interleaved step by step, order shuffled each round;",
        "          result = median over rounds of the paired ratio (or difference) [its ~95 % confidence interval];",
        "          inconclusive = the interval straddles the goal; times are medians",
    ])


class Table:
    """Rows of: part, measurement, result, goal, verdict; notes under the row they explain."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def row(self, part: str, what: str, result: str, goal: str = "", verdict: str = "") -> None:
        self.lines.append(f"{part:<2} {what:<52} {result:<30} {goal:<8} {verdict}")

    def note(self, text: str) -> None:
        self.lines.append(f"{'':<5}{text}")

    def render(self) -> str:
        rule = "-" * 108
        top = f"{'#':<2} {'measurement':<52} {'result [95 % CI]':<30} {'goal':<8} verdict"
        return "\n".join([rule, top, rule, *self.lines, rule])


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report_idle(table: Table, idle: IdleResult) -> None:
    table.row("1", "idle: Trainer step, callback waiting / no callback", estimate(idle.ratios), "<= 1.01",
              judge(idle.ratios, 1.01))
    table.note(f"MLP-199 LightningModule, one fit, {len(idle.ratios)} pairs of adjacent steps with/without the callback "
               f"in trainer.callbacks; step {idle.without_ms:.2f} ms without, {idle.with_ms:.2f} ms with")
    table.note(f"the callback's own per-step hooks, called directly: {idle.hook_ns / 1e3:.2f} us/step "
               f"({idle.hook_ns / 1e4 / idle.without_ms:.3f} % of a step)")
    table.note(f"an empty pl.Callback() measured the same way (Lightning's dispatch to one more callback): "
               f"{estimate(idle.empty_ratios)}, {len(idle.empty_ratios)} pairs")


def report_steps(table: Table, result: StepResult, goal: float | None) -> None:
    name, ratios, per_node = result.name, result.ratios, result.per_node_us
    table.row("2", f"{name}: step with FX timing / eager", estimate(ratios["NodeTimer"]),
              f"<= {goal:.2f}" if goal else "", judge(ratios["NodeTimer"], goal) if goal else "info")
    table.row("2", f"{name}: overhead per timed node ({result.nodes} nodes)", estimate(per_node["NodeTimer"], 2, " us"),
              "<= 1 us", judge(per_node["NodeTimer"], 1.0))
    table.note(f"{len(ratios['NodeTimer'])} rounds; eager step {result.eager_ms:.2f} ms; untimed GraphModule / eager "
               f"{estimate(ratios['untimed GraphModule'])}")
    table.note(f"instrumentation alone (NodeTimer - untimed GraphModule): {estimate(result.probe_us, 2, ' us/node')}")
    if "NodeTimer backward=False" in ratios:
        table.note(f"NodeTimer(backward=False) / eager {estimate(ratios['NodeTimer backward=False'])}, "
                   f"{estimate(per_node['NodeTimer backward=False'], 2, ' us/node')}")
    if any(result.samples_us):
        table.note(f"making samples of the logged clock reads, after the steps (the callback: once per cycle, after it): "
                   f"{median(result.samples_us):.2f} us/node per step")
    if "eager + BackwardEvents" in ratios:
        table.note(f"eager with the backward recorder alone (profiler callbacks on every autograd node, torch's C++): "
                   f"{estimate(per_node['eager + BackwardEvents'], 2, ' us/node')}")
    if result.floor_missing:
        table.note(f"floor unavailable (its C++ callback did not build: {result.floor_missing})")
    if result.floor_gap_us:
        table.row("2", f"{name}: floor per node (see below)", estimate(per_node["floor"], 2, " us"),
                  "", "info")
        table.row("2", f"{name}: ours - floor per node (paired)", estimate(result.floor_gap_us, 2, " us"),
                  "<= 0.5 us", judge(result.floor_gap_us, 0.5))
        table.note(f"floor: traced graph (modules called from a list) + one perf_counter_ns and one autograd sequence "
                   f"number per node boundary (forward), a minimal at::addGlobalCallback for the backward scope storing sequence number and two "
                   f"timestamps ({median(result.floor_backward_nodes):.0f} autograd nodes a step); same rounds as ours")


def report_profiled(table: Table, per_node: dict[str, list[float]]) -> None:
    table.row("2b", "MLP-199 under torch.profiler: per-node cost, annotate=False", estimate(per_node["annotate=False"], 2, " us"),
              "< 2 us", judge(per_node["annotate=False"], 2.0))
    table.row("2b", "MLP-199 under torch.profiler: per-node cost, annotate=True", estimate(per_node["annotate=True"], 2, " us"),
              "", "info")
    if "trace_ranges=True" in per_node:
        table.row("2b", "MLP-199 under torch.profiler: per-node cost, trace_ranges=True (the default)",
                  estimate(per_node["trace_ranges=True"], 2, " us"), "<= 2 us", judge(per_node["trace_ranges=True"], 2.0))
    if "trace_ranges=True" in per_node:
        ranges_cost = [a - b for a, b in zip(per_node["trace_ranges=True"], per_node["annotate=False"], strict=True)]
        table.note(f"what the ranges cost, paired in each round: trace_ranges=True - annotate=False "
                   f"{estimate(ranges_cost, 2, ' us/node')}")
    table.note(f"{len(per_node['annotate=False'])} rounds, each in one profiler (CPU): FX timing over the profiled eager "
               "step; backward times come from the profiler's events; annotate=True adds a record_function range per node"
               + ("; trace_ranges=True keeps node starts and writes the ranges into the exported trace afterwards "
                  f"(that write took {per_node['write ms'][0]:.0f} ms for one step's trace, once per cycle)"
                  if "write ms" in per_node else ""))


def cheaper_text(theirs: float, ours: float) -> str:
    if ours <= 0.05 or theirs <= 0.05:
        return "too close to 0 to compare (noise)"
    if theirs >= ours:
        return f"ours is {theirs / ours:.1f}x cheaper"
    return f"ours is {ours / theirs:.1f}x MORE expensive"


def report_baseline(table: Table, result: StepResult, goal: bool) -> None:
    """The tutorial's interpreter times forward nodes only: compared with ours timing the same (backward=False),
    then with ours timing backward too. ``goal``: judge the ratio against 10x (where per-node costs are
    resolvable: many small nodes, not ResNet18's 69 nodes in a 100+ ms step)."""
    theirs, ours = median(result.per_node_us["ProfilingInterpreter"]), median(result.per_node_us["NodeTimer"])
    table.row("3", f"{result.name}: tutorial ProfilingInterpreter / eager", estimate(result.ratios["ProfilingInterpreter"]),
              "", "info")
    if "NodeTimer backward=False" in result.per_node_us:
        forward_only = median(result.per_node_us["NodeTimer backward=False"])
        measurable = forward_only > 0.05
        table.row("3", f"{result.name}: interpreter / ours per node, forward timing",
                  f"{theirs / forward_only:.1f}x" if measurable else "ours too close to 0 (noise)", ">= 10x" if goal else "",
                  "info" if not goal else verdict(theirs / forward_only >= 10) if measurable else "inconclusive")
        table.note(f"interpreter {estimate(result.per_node_us['ProfilingInterpreter'], 2, ' us')} per node, ours with "
                   f"backward=False {forward_only:.2f} us: {cheaper_text(theirs, forward_only)}")
    table.note(f"ours with backward timing too (which the interpreter lacks): {ours:.2f} us per node: {cheaper_text(theirs, ours)}")


def report_profiler(table: Table, data: ReferenceData) -> None:
    profiled = sum(node_medians(data.ours_profiled).values())
    plain = sum(node_medians(data.ours).values())
    ratio = profiled / plain
    table.row("4", "ResNet18: node times under torch.profiler / without", f"{ratio:.3f}", "<= 1.10",
              "MATERIAL inflation" if ratio > 1.10 else "immaterial")
    annotated = "annotate=True, backward=False" if has_backward_option() else "annotate=True"
    table.note(f"{data.rounds} rounds of {data.ref_steps} step(s) each; sum of per-node medians {profiled / 1e3:.2f} ms "
               f"({annotated}, profiled) vs {plain / 1e3:.2f} ms (annotate=False, no profiler)")


def report_accuracy(table: Table, data: ReferenceData) -> None:
    comparisons = [
        ("module alone (benchmark.Timer)", data.ours, data.module_alone),
        ("module alone, caches flushed", data.ours, data.module_cold),
        ("module alone, flushed, outputs kept", data.ours, data.module_fresh),
        ("profiler range, same executions", data.ours_profiled, data.ranges),
        ("profiler range, ours unprofiled", data.ours, data.ranges),
    ]
    for label, mine, reference in comparisons:
        a = agreement(node_medians(mine), node_medians(reference))
        low = agreement(node_lows(mine), node_lows(reference))
        within = abs(a.median_ratio - 1) <= 0.15
        table.row("5", f"ResNet18 ours / {label}", f"median {a.median_ratio:.3f}", "+-15 %", verdict(within))
        table.note(f"{a.nodes} nodes; worst of the 10 slowest: {a.worst_ratio:.3f} ({a.worst_node}); "
                   f"on 10th percentiles: median {low.median_ratio:.3f}, worst {low.worst_ratio:.3f} ({low.worst_node})")


# ------------------------------------------------------------------ main


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*the Trainer has no logger.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    budget = QUICK if args.quick else FULL
    quiet_lightning()
    began, stall = time.perf_counter(), cpu_stall_us()
    print(header(args.quick), flush=True)

    table = Table()
    report_idle(table, idle_overhead(budget))
    resnet, mlp = resnet18_workload(), mlp_workload()
    steps = {
        resnet.name: step_overhead(resnet, budget.resnet, budget.warmup),
        mlp.name: step_overhead(mlp, budget.mlp, budget.warmup, floor=True),
    }
    report_steps(table, steps["ResNet18"], goal=1.10)
    report_steps(table, steps["MLP-199"], goal=None)
    report_profiled(table, profiled_overhead(mlp, budget.mlp_profiled, budget.warmup))
    for result in steps.values():
        report_baseline(table, result, goal=result is steps[mlp.name])
    data = reference_rounds(resnet, budget)
    report_profiler(table, data)
    report_accuracy(table, data)

    print(table.render())
    print(contention_note(stall, began))
    print(f"total wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
