"""What the benchmarks print about the run itself: CPU contention during it and the package's commit."""

from __future__ import annotations

import os
import subprocess
import time

import fxprof_lightning


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


def package_state() -> str:
    """fxprof_lightning's version and the git commit it was measured at (+dirty: uncommitted edits)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fxprof_lightning.__file__)))
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return f"fxprof_lightning {fxprof_lightning.__version__} (git {commit})"
