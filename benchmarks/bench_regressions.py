"""How often the per-layer regression check flags a steady run, and how soon it flags a real slowdown.

    .venv/bin/python benchmarks/bench_regressions.py              # full run, about 1-3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_regressions.py --quick      # smoke run, a few seconds
    .venv/bin/python benchmarks/bench_regressions.py --threads 1  # torch.set_num_threads(1) first

Every run is the real ``Profiler`` over a plain CPU training loop (forward, ``loss.backward()``,
SGD step, ``prof.step()``) with ``wait=0, warmup=1, active=3`` (3 recorded steps per cycle, the
package's default), ``torch_profiler=False`` and no sinks; node tables come from ``prof.cycles``.

1. Steady runs: an MLP (8 x [Linear(512, 512), LayerNorm, ReLU] + head, batch 128) and a small
   CNN (4 conv/BatchNorm/ReLU blocks + pooling + head, batch 32, 3x32x32), many cycles each,
   nothing changed. Every cycle is checked against the cycles before it as the engine does
   (``find_regressions`` on the last 5); every flag is a false flag. Rate = flagged (node,
   direction, cycle) / checked. Shown for k = 2, 3, 4, 6 and for the parts of the noise model added
   one by one (see ``fxprof_lightning.analysis.regressions``), every cycle checked and, as the
   engine checks, only the cycles that ``trust.distortion`` calls sound (a cycle whose steps
   spread over 50 % of their median, or whose median step jumps 2x, is neither checked nor baseline).
2. A slowdown: the MLP again; from the middle cycle on, one Linear computes 30 % more rows (the
   instance's ``forward`` concatenates 30 % of its input rows to it and drops their outputs: real
   extra matmul work in forward and backward, no sleep). Reported: the measured ratio of that
   layer (median of its slowed cycles over the earlier ones), the first cycle in which it is
   flagged (forward/backward; '-' when never) and how many other (node, direction, cycle) flags
   the run raised. Six such runs of 30 cycles, slowed from cycle 15.

The last lines print the CPU contention during the run (``/proc/pressure/cpu``) and a one-line
summary with the package's defaults. On a shared 2-core machine with torch's 2 threads, other
processes make single steps 10-40x slower in bursts; ``--threads 1`` is much less sensitive.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from run_info import contention, cpu_stall_us, package_state, parse_args, quiet_stderr
from torch import nn
from torch.nn import functional as F

from fxprof_lightning import Profiler
from fxprof_lightning.analysis.regressions import (
    DEFAULT_K,
    DEFAULT_MIN_MS,
    DEFAULT_MIN_RELATIVE,
    DEFAULT_MIN_SHARE,
    MIN_BASELINE,
    SAME_LEVEL,
    compare,
    find_regressions,
)
from fxprof_lightning.analysis.trust import distortion
from fxprof_lightning.analysis.watch import RegressionWatch
from fxprof_lightning.report import NodeStats

KS = (2.0, 3.0, 4.0, 6.0)
VARIANTS = {  # name -> compare() keyword arguments, each adding one part of the noise model to the one above
    "k x noise and floors": {"min_share": 0.0, "check_fastest": False, "discount_shared": False},
    "+ cost >= 0.5% of nodes": {"check_fastest": False, "discount_shared": False},
    "+ fastest call moved": {"discount_shared": False},
    "+ shared discount (all)": {},
}
SLOWER_ROWS = 0.3


@dataclass(frozen=True)
class Budget:
    steady_cycles: int
    slow_cycles: int
    slow_runs: int


FULL = Budget(steady_cycles=48, slow_cycles=30, slow_runs=6)
QUICK = Budget(steady_cycles=8, slow_cycles=8, slow_runs=1)


@dataclass
class Run:
    """What a profiled run left: one node table and the recorded step times per cycle."""

    name: str
    tables: list[list[NodeStats]] = field(default_factory=list)
    step_ms: list[list[float]] = field(default_factory=list)
    slowed_from: int | None = None  # first cycle of the slowdown
    slowed_node: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------ workloads


def mlp(width: int = 512, blocks: int = 8) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def cnn() -> nn.Sequential:
    def block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(*block(3, 32, 1), *block(32, 32, 1), *block(32, 64, 2), *block(64, 64, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def more_rows(layer: nn.Linear, share: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for ``layer`` that also computes ``share`` more rows of its input and drops them."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return F.linear(torch.cat([x, x[: round(share * rows)]]), layer.weight, layer.bias)[:rows]

    return forward


def profile(name: str, model: nn.Module, x: torch.Tensor, cycles: int, slow_layer: nn.Linear | None = None,
            slow_from: int | None = None) -> Run:
    """Train ``model`` on ``x`` for ``cycles`` profiling cycles (4 steps each); slow the layer down from a cycle on."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as out, quiet_stderr(), Profiler(
        model, wait=0, warmup=1, active=3, repeat=cycles, dirpath=out, torch_profiler=False, sinks=[]
    ) as prof:
        for step in range(4 * cycles):
            if slow_layer is not None and step == 4 * slow_from:
                slow_layer.forward = more_rows(slow_layer, SLOWER_ROWS)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    run = Run(name, [c.nodes for c in prof.cycles], [c.step_ms for c in prof.cycles], slow_from,
              seconds=time.perf_counter() - began)
    if slow_layer is not None:
        run.slowed_node = next(n.name for n in run.tables[0]
                               if n.module_path and model.get_submodule(n.module_path) is slow_layer)
    return run


# ------------------------------------------------------------------ checks


@dataclass
class Tally:
    checked: int = 0  # (node, direction) pairs
    cycles: int = 0  # cycles checked
    flags: list[tuple[int, str, str]] = field(default_factory=list)  # (cycle, node, direction)


def sound_cycles(run: Run) -> int:
    medians, sound = [], 0
    for steps in run.step_ms:
        if distortion(steps, medians) is None:
            sound += 1
            medians.append(statistics.median(steps))
    return sound


def check_run(run: Run, k: float, options: dict) -> Tally:
    """Check every cycle against the earlier ones as the engine does: the last 5 sound cycles, once there are 3
    (a cycle that ``trust.distortion`` calls distorted by load is neither checked nor part of a baseline)."""
    tally, baseline, medians = Tally(), [], []
    for index, (nodes, steps) in enumerate(zip(run.tables, run.step_ms)):
        if distortion(steps, medians) is not None:
            continue
        if len(baseline) >= MIN_BASELINE:
            tally.checked += len(compare(baseline[-5:], nodes, k=k, **options))
            tally.cycles += 1
            tally.flags += [(index, r.node, r.direction) for r in find_regressions(baseline, nodes, k=k, **options)]
        baseline.append(nodes)
        if steps:
            medians.append(statistics.median(steps))
    return tally


def watch_run(run: Run, same_level: float = SAME_LEVEL) -> Tally:
    """What the engine reports: ``RegressionWatch`` (load by its signature, flags confirmed by the next cycle at the
    same level: ``same_level`` 0 confirms at any level)."""
    tally, watch = Tally(), RegressionWatch(same_level=same_level)
    for index, (nodes, steps) in enumerate(zip(run.tables, run.step_ms)):
        verdict = watch.check(nodes, steps)
        if verdict.skipped is None:
            tally.cycles += 1
            tally.checked += len(nodes) * 2
        tally.flags += [(index, r.node, r.direction) for r in verdict.regressions]
    return tally


def rate(tallies: list[Tally]) -> str:
    flagged, checked = sum(len(t.flags) for t in tallies), sum(t.checked for t in tallies)
    cycles = sum(len({c for c, _, _ in t.flags}) for t in tallies)
    return f"{flagged}/{checked} ({100 * flagged / max(checked, 1):.2f}%) [{cycles}/{sum(t.cycles for t in tallies)}]"


def detected(runs: list[Run], tallies: list[Tally]) -> str:
    """``first/runs (at all) +others`` for the slowdown runs."""
    first = [first_flag(r, t) for r, t in zip(runs, tallies)]
    others = sum(1 for r, t in zip(runs, tallies) for c, n, _ in t.flags if n != r.slowed_node or c < r.slowed_from)
    return (f"{sum(1 for f, r in zip(first, runs) if f == r.slowed_from)}/{len(runs)} "
            f"({sum(1 for f in first if f is not None)}) +{others}")


def first_flag(run: Run, tally: Tally) -> int | None:
    """The first cycle, from the slowdown on, in which the slowed layer was flagged (either direction)."""
    return min((c for c, n, _ in tally.flags if n == run.slowed_node and c >= run.slowed_from), default=None)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("   " + "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip()
                     for row in [header, *rows])


def detection(run: Run, tally: Tally) -> str:
    first = {d: min((c for c, n, dd in tally.flags if n == run.slowed_node and dd == d and c >= run.slowed_from),
                    default=None) for d in ("forward", "backward")}
    others = sum(1 for c, n, _ in tally.flags if n != run.slowed_node or c < run.slowed_from)
    return f"{first['forward'] if first['forward'] is not None else '-'}/" \
           f"{first['backward'] if first['backward'] is not None else '-'} +{others}"


def measured_ratio(run: Run) -> str:
    parts = []
    for direction, attr in (("forward", "median_ms"), ("backward", "bwd_median_ms")):
        values = [getattr(next(n for n in t if n.name == run.slowed_node), attr) for t in run.tables]
        before, after = statistics.median(values[: run.slowed_from]), statistics.median(values[run.slowed_from:])
        parts.append(f"{direction} {after / before:.2f}x")
    return ", ".join(parts)


# ------------------------------------------------------------------ report


def header(quick: bool) -> str:
    load = " ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return "\n".join([
        f"fxprof_lightning regression-check benchmark ({'quick' if quick else 'full'} run)",
        f"date      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine   {platform.platform()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load avg {load}",
        f"versions  python {platform.python_version()}, torch {torch.__version__}",
        f"package   {package_state()}",
        f"defaults  k={DEFAULT_K:g}, min_relative={DEFAULT_MIN_RELATIVE:g}, min_ms={DEFAULT_MIN_MS:g}, "
        f"min_share={DEFAULT_MIN_SHARE:g}, fastest-call check and shared-slowdown discount on, "
        "baseline = last 5 cycles",
    ])


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    budget = QUICK if args.quick else FULL
    began, stall = time.perf_counter(), cpu_stall_us()
    print(header(args.quick), flush=True)

    steady = [
        profile("MLP", mlp(), torch.randn(128, 512), budget.steady_cycles),
        profile("CNN", cnn(), torch.randn(32, 3, 32, 32), budget.steady_cycles),
    ]
    slow = []
    for i in range(budget.slow_runs):
        model = mlp()
        slow.append(profile(f"slowdown {i + 1}", model, torch.randn(128, 512), budget.slow_cycles,
                            slow_layer=model[9], slow_from=budget.slow_cycles // 2))
    for run in steady + slow:
        print(f"  {run.name}: {len(run.tables)} cycles, {len(run.tables[0])} nodes, {run.seconds:.0f} s", flush=True)

    distorted = sum(len(r.tables) - sound_cycles(r) for r in steady)
    print()
    print(f"1. Steady runs ({', '.join(f'{r.name} {len(r.tables)} cycles' for r in steady)}; {distorted} cycle(s) "
          "distorted by load, skipped as the engine does): false flags = flagged (node, direction, cycle) / checked "
          "[cycles with a flag]")
    rows = [[name, *(rate([check_run(r, k, options) for r in steady]) for k in KS)]
            for name, options in VARIANTS.items()]
    print(table(["variant", *(f"k={k:g}" for k in KS)], rows))
    for run in steady:
        tally = check_run(run, DEFAULT_K, {})
        if tally.flags:
            print(f"   {run.name}, defaults: flagged {', '.join(f'{n} {d} (cycle {c})' for c, n, d in tally.flags)}")

    print()
    print(f"2. Slowdown: one Linear computes {100 * SLOWER_ROWS:.0f}% more rows from cycle {slow[0].slowed_from} on, "
          f"{len(slow)} runs: runs where it is flagged in the first slowed cycle (at all) +other flags of the runs")
    rows = [[name, *(detected(slow, [check_run(r, k, options) for r in slow]) for k in KS)]
            for name, options in VARIANTS.items()]
    print(table(["variant", *(f"k={k:g}" for k in KS)], rows))
    print("   with the defaults, first flagged cycle forward/backward ('-': never) +other flags, per run:")
    for run in slow:
        print(f"   {run.name}: node {run.slowed_node}, slowed from cycle {run.slowed_from} of {len(run.tables)}, "
              f"measured {measured_ratio(run)}: {detection(run, check_run(run, DEFAULT_K, {}))}")

    share = contention(stall, began)
    print()
    print("CPU contention during the run: " + ("unknown (no /proc/pressure/cpu)" if share is None else
          f"some task waited for a CPU {100 * share:.0f}% of the time (/proc/pressure/cpu; near 0 when idle)"))
    steady_tallies = [check_run(r, DEFAULT_K, {}) for r in steady]
    slow_tallies = [check_run(r, DEFAULT_K, {}) for r in slow]
    first = [first_flag(r, t) for r, t in zip(slow, slow_tallies)]
    start = slow[0].slowed_from
    others = sum(1 for r, t in zip(slow, slow_tallies) for c, n, _ in t.flags if n != r.slowed_node or c < start)
    load = "" if share is None else f", CPU contention {100 * share:.0f}%"
    print(f"Summary (defaults, torch threads {torch.get_num_threads()}{load}): steady runs {rate(steady_tallies)} "
          f"false flags over {sum(len(r.tables) for r in steady)} cycles; a layer made {100 * SLOWER_ROWS:.0f}% "
          f"slower flagged in its first slowed cycle in {sum(1 for f in first if f == start)} of {len(slow)} runs, "
          f"by the next in {sum(1 for f in first if f is not None and f <= start + 1)}, at all in "
          f"{sum(1 for f in first if f is not None)}; {others} other flag(s) in those runs")
    for same_level, how in ((0.0, "at any level"), (SAME_LEVEL, f"at the same level, {SAME_LEVEL:g}: the default")):
        reported_steady = [watch_run(r, same_level) for r in steady]
        reported_slow = [watch_run(r, same_level) for r in slow]
        first = [first_flag(r, t) for r, t in zip(slow, reported_slow)]
        others = sum(1 for r, t in zip(slow, reported_slow) for c, n, _ in t.flags if n != r.slowed_node or c < start)
        print(f"Reported as the engine does (RegressionWatch: confirmed by the next sound cycle {how}, or beyond "
              f"doubt): steady runs {rate(reported_steady)}; the slower layer reported in its first slowed cycle in "
              f"{sum(1 for f in first if f == start)} of {len(slow)} runs, by the next in "
              f"{sum(1 for f in first if f is not None and f <= start + 1)}, by the one after in "
              f"{sum(1 for f in first if f is not None and f <= start + 2)}, at all in "
              f"{sum(1 for f in first if f is not None)}; {others} other report(s) in those runs")
    print(f"total wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
