"""How ``fxprof report`` and its HTML page write a run's numbers: per-step totals, step ranges, ms and ratios, and
the legend of the regression check (no torch import)."""

from __future__ import annotations

import textwrap

from fxprof_lightning.analysis.regressions import (
    CONFIRM_FLOOR_MS,
    CONFIRM_RATIO,
    DEFAULT_K,
    DEFAULT_MIN_MS,
    DEFAULT_MIN_RELATIVE,
    DEFAULT_MIN_SHARE,
    MIN_ADDED_MS,
    MIN_BASELINE,
)
from fxprof_lightning.report import CycleReport

__all__ = ["BASELINE_CYCLES", "legend_report", "ms_text", "per_step", "ratio_text", "steps_text"]

BASELINE_CYCLES = 5  # as the engine: each cycle against the last 5 sound ones before it
WIDTH = 120


def per_step(report: CycleReport) -> tuple[float, float] | None:
    """Summed node forward and backward ms per recorded step (from the module tree's root without step numbers)."""
    if report.steps:
        return report.forward_ms_per_step, report.backward_ms_per_step
    root = next((m for m in report.modules if m.path == ""), None)
    return (root.total_fwd_ms, root.total_bwd_ms) if root is not None else None


def legend_report(options: dict) -> list[str]:
    k, floor = options.get("k", DEFAULT_K), options.get("min_relative", DEFAULT_MIN_RELATIVE)
    return textwrap.wrap(
        f"A regression: a node whose median ms per call rose by more than {k:g} x the noise (robust spread of the "
        f"last {BASELINE_CYCLES} sound cycles' medians and within each cycle), more than {100 * floor:g}%, "
        f"{DEFAULT_MIN_MS * 1000:g} us and {100 * DEFAULT_MIN_SHARE:g}% of the cycle's node time (and by at least "
        f"{MIN_ADDED_MS:g} ms a step), its fastest call "
        "too, beyond the cycle's shared slowdown; checked once "
        f"{MIN_BASELINE} sound cycles came before (with one or two, only a change beyond doubt is flagged), and reported once confirmed: flagged in the next sound cycle "
        f"too, or every call {CONFIRM_RATIO:g}x and {CONFIRM_FLOOR_MS:g} ms slower with regular steps that got slower by "
        "it, unless the threads waited for a core half as long as it added longer than before (load). Partial cycles and "
        "those distorted by other load (step spread > 50%; the process's threads waiting for a core > 30% of the "
        "steps; where Linux does not say, a 2x step jump or a CPU-per-wall drop with the nodes slower in proportion) "
        "are not checked; a step slower because a few nodes are is their regression.", WIDTH)


def steps_text(report: CycleReport) -> str:
    if not report.steps:
        return "?"
    return f"{report.steps[0]}-{report.steps[-1]}" if len(report.steps) > 1 else str(report.steps[0])


def ms_text(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"


def ratio_text(value: float) -> str:
    """``1.42x``; ``new`` for a row from nothing, ``gone`` for one to nothing (``regressions.new_rows``, ``gone_rows``)."""
    return "new" if value == float("inf") else "gone" if value == 0.0 else f"{value:.2f}x"
