"""What the benchmarks share: their command line, a quiet stderr, and what they print about the run itself
(CPU contention during it and the package's commit)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import fxprof_lightning


def parse_args(description: str, more: Callable[[argparse.ArgumentParser], Any] | None = None) -> argparse.Namespace:
    """``--quick``, ``--threads N`` (applied here: ``torch.set_num_threads``) and ``--accelerator`` (for the
    benchmarks whose Trainer can run on a GPU); ``more`` adds a benchmark's own."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--quick", action="store_true", help="smoke run: few repetitions, numbers are rough")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first (default: as it is)")
    parser.add_argument("--accelerator", default="cpu", help="the Trainer's accelerator where it applies (default cpu)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (Kineto logs 'profiler_start/stop' there from C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def cpu_stall_us() -> int | None:
    """Linux pressure stall information: total us during which some runnable task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            some = pressure.readline().split()
        return int(some[-1].removeprefix("total="))
    except (OSError, ValueError, IndexError):
        return None


def contention(stall_start: int | None, wall_start: float) -> float | None:
    """The share of wall time since ``wall_start`` during which some task waited for a CPU (None: unknown)."""
    stall_end = cpu_stall_us()
    if stall_start is None or stall_end is None:
        return None
    return (stall_end - stall_start) / 1e6 / (time.perf_counter() - wall_start)


def closing_lines(stall_start: int | None, wall_start: float) -> list[str]:
    """A run's last lines: the CPU contention during it and its wall time."""
    share = contention(stall_start, wall_start)
    return [f"CPU contention: some task waited for a CPU {100 * share:.0f} % of the time" if share is not None
            else "CPU contention: unknown", f"total wall time {time.perf_counter() - wall_start:.0f} s"]


def package_state() -> str:
    """fxprof_lightning's version and the git commit it was measured at (+dirty: uncommitted edits)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fxprof_lightning.__file__)))
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return f"fxprof_lightning {fxprof_lightning.__version__} (git {commit})"


def median_ci(values: list[float]) -> tuple[float, float]:
    """Distribution-free ~95 % confidence interval of the median: order statistics n/2 -+ 0.98 sqrt(n)."""
    ordered = sorted(values)
    n, half = len(ordered), 0.98 * math.sqrt(len(ordered))
    return ordered[max(math.floor(n / 2 - half), 0)], ordered[min(math.ceil(n / 2 + half), n - 1)]
