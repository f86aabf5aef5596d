"""How far a cycle's numbers can be trusted: the spread of its step times and its CPU time against wall time.

Per-node times measured while other processes compete for the cores are inflated, and by
different amounts for different nodes. Two signs of that, computed from the wall time and the
process CPU time of each recorded step (``CycleReport.step_ms``, ``step_cpu_ms``):

- the **spread** of the recorded steps, ``(slowest - fastest) / median``: steps of one training
  run do the same work, so a spread above ``SPREAD_LIMIT`` (50 %) means something else ran;
- a **jump** of the cycle's median step time to more than ``JUMP_LIMIT`` (2x) the median of the
  earlier cycles (a run whose steps get slower for a reason of its own shows it as a regression
  of the nodes that got slower, not of the whole step).

``cpu_per_wall`` (CPU seconds per wall second, over all threads) is reported beside them: on an
idle machine it stays near the number of threads the step keeps busy; when it drops in one cycle,
the process waited for cores.
"""

from __future__ import annotations

import statistics

__all__ = ["JUMP_LIMIT", "SPREAD_LIMIT", "cpu_per_wall", "distortion", "step_spread"]

SPREAD_LIMIT = 0.5
JUMP_LIMIT = 2.0


def step_spread(step_ms: list[float]) -> float | None:
    """``(max - min) / median`` of the recorded steps' wall times (None for fewer than 2 steps).

    >>> step_spread([10.0, 11.0, 12.0])
    0.18181818181818182
    """
    if len(step_ms) < 2:
        return None
    middle = statistics.median(step_ms)
    return (max(step_ms) - min(step_ms)) / middle if middle > 0 else None


def cpu_per_wall(step_ms: list[float], step_cpu_ms: list[float]) -> float | None:
    """The process's CPU time over the wall time of the recorded steps (None without steps)."""
    wall = sum(step_ms)
    return sum(step_cpu_ms) / wall if wall > 0 and step_cpu_ms else None


def distortion(step_ms: list[float], earlier_medians: list[float]) -> str | None:
    """Why a cycle's numbers look distorted by other load, or None when they look sound.

    ``earlier_medians`` are the median step times of the run's earlier sound cycles.

    >>> distortion([10.0, 10.5, 10.2], [10.1]) is None
    True
    >>> distortion([10.0, 31.0, 10.2], [])
    'its recorded steps took 10.0 to 31.0 ms (spread 206% of the median, limit 50%)'
    """
    reasons = []
    spread = step_spread(step_ms)
    if spread is not None and spread > SPREAD_LIMIT:
        reasons.append(f"its recorded steps took {min(step_ms):.1f} to {max(step_ms):.1f} ms "
                       f"(spread {100 * spread:.0f}% of the median, limit {100 * SPREAD_LIMIT:.0f}%)")
    if step_ms and earlier_medians:
        now, before = statistics.median(step_ms), statistics.median(earlier_medians)
        if before > 0 and now > JUMP_LIMIT * before:
            reasons.append(f"its median step took {now:.1f} ms, {now / before:.1f}x the earlier cycles' {before:.1f} ms")
    return "; ".join(reasons) or None
