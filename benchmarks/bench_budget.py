"""What profiling costs under ``overhead_budget``, against the same loop without profiling, side by side.

    .venv/bin/python benchmarks/bench_budget.py               # 3 pairs of 3000-step runs, about 90 s
    .venv/bin/python benchmarks/bench_budget.py --quick       # 1 pair of 600-step runs

A plain loop of a small MLP (16-64-4, batch 8, forward and backward) with a 4 ms sleep per step (a job whose steps
wait for data or a device), run without a profiler and with ``Profiler(wait=1, warmup=1, active=3,
overhead_budget=B)`` (torch.profiler on, CSV and console sinks, no pictures), pairs interleaved. Prints each run's wall
time, the profiled/plain ratio, and the share the profiler reported (``Follow.share``: its cycles' measured cost over
the wall time). Issue 29's goal: with B = 2%, the profiled run within 3% of the plain one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

from fxprof_lightning import Profiler


def run(steps: int, budget: float | None, profiled: bool, sleep_s: float = 0.004) -> tuple[float, float, int, float, dict]:
    """Wall seconds, the reported share, the number of cycles, the reported seconds and where the profiler's time went
    (s: ``start()``, the ``step()`` calls with no cycle open before or after, the others, ``stop()``) of one run."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    parts = dict.fromkeys(("start", "idle steps", "cycles' steps", "stop"), 0.0)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profiler = Profiler(net, dirpath=out, wait=1, warmup=1, active=3, pictures=False,
                            overhead_budget=budget) if profiled else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.start()
            parts["start"] = time.perf_counter() - started
        for _ in range(steps):
            net(torch.randn(8, 16)).sum().backward()
            time.sleep(sleep_s)
            if profiler is not None:
                cycle = profiler._train.open is not None  # (a cycle open before or after the call: a cycle's step)
                before = time.perf_counter()
                profiler.step()
                cycle = cycle or profiler._train.open is not None
                parts["cycles' steps" if cycle else "idle steps"] += time.perf_counter() - before
        if profiler is not None:
            before = time.perf_counter()
            profiler.stop()
            parts["stop"] = time.perf_counter() - before
        seconds = time.perf_counter() - started
    if profiler is None:
        return seconds, 0.0, 0, 0.0, parts
    parts["reported for the idle steps"] = profiler.follow.idle_ns / 1e9  # (its time inside our calls, measured there)
    return seconds, profiler.follow.share(), len(profiler.cycles), profiler.follow.spent_s(), parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument("--sleep-ms", type=float, default=4.0, help="the sleep in each step (default 4: ~4.3 ms steps)")
    args = parser.parse_args()
    steps, pairs = (600, 1) if args.quick else (args.steps, args.pairs)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; {pairs} pair(s) of {steps}-step runs (a {args.sleep_ms:g} ms sleep a step), "
          f"budget {args.budget:.0%}")
    ratios = []
    for pair in range(pairs):
        plain, _, _, _, _ = run(steps, None, profiled=False, sleep_s=args.sleep_ms / 1e3)
        profiled, share, cycles, spent, parts = run(steps, args.budget, profiled=True, sleep_s=args.sleep_ms / 1e3)
        ratios.append(profiled / plain)
        print(f"  pair {pair}: plain {plain:.2f} s, profiled {profiled:.2f} s ({cycles} cycles): ratio {profiled / plain:.3f}, "
              f"reported cost {100 * share:.2f}% of the wall time ({spent:.2f} s; measured difference "
              f"{profiled - plain:.2f} s)")
        print("    inside the profiler's calls, timed around them: " + ", ".join(f"{name} {value:.3f} s" for name, value in parts.items()))
    print(f"median ratio profiled/plain: {statistics.median(ratios):.3f} (goals: <= 1.03 with a 2% budget, issue 29; "
          "<= 1.05 with 5%, issue 41)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
