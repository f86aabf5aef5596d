"""Layers that now save much more for backward than before: between two runs (``fxprof compare``) and across a run's
cycles (the regression watch). Saved bytes are deterministic for a given input shape, so there is no noise to rule
out: a layer is flagged where its saved bytes per step grew ``GROWTH`` times or more, and by more than a floor (a share
of what the step saves, and a few kB), so that a layer that goes from nothing to a few bytes is not."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fxprof_lightning.report import NodeStats

__all__ = ["GROWTH", "MIN_BYTES", "MIN_SHARE", "SavedGrowth", "growth_lines", "saved_growth"]

GROWTH = 2.0  # saved bytes per step this many times the baseline's
MIN_SHARE = 5.0  # % of the step's saved bytes (now) the growth must reach
MIN_BYTES = 4096.0  # bytes per step the growth must reach


@dataclass(frozen=True)
class SavedGrowth:
    """A row whose saved bytes per step grew: ``node`` (its name), ``layer`` (as the user's code names it), the
    baseline's bytes per step (the median over the baseline's cycles) and now's."""

    node: str
    layer: str
    baseline_bytes: float
    now_bytes: float

    @property
    def ratio(self) -> float:
        return self.now_bytes / self.baseline_bytes if self.baseline_bytes else float("inf")

    def text(self) -> str:
        """In one line.

        >>> SavedGrowth("fc", "fc (Linear)", 1e6, 2.5e6).text()
        '`fc (Linear)` saves 2.5x as much for backward (1.000 -> 2.500 MB per step)'
        """
        times = f"{self.ratio:.1f}x as much" if self.baseline_bytes else "where it saved nothing"
        return (f"`{self.layer or self.node}` saves {times} for backward ({self.baseline_bytes / 1e6:.3f} -> "
                f"{self.now_bytes / 1e6:.3f} MB per step)")


def _per_step(nodes: Sequence[NodeStats], steps: int, scale: float = 1.0) -> dict[str, float]:
    return {n.name: scale * n.saved_bytes * n.calls / max(steps, 1) for n in nodes if n.saved_bytes is not None}


def saved_growth(baseline: Sequence[tuple[Sequence[NodeStats], int]], now: Sequence[NodeStats], steps: int,
                 scale: float = 1.0, growth: float = GROWTH, min_share: float = MIN_SHARE,
                 min_bytes: float = MIN_BYTES) -> list[SavedGrowth]:
    """The rows of ``now`` (a node table of ``steps`` recorded steps) whose saved bytes per step are ``growth`` times
    the baseline's or more (the median over the ``baseline`` tables, each with its recorded steps, that measured the
    row; times ``scale``, the ratio of the batch sizes where they differ), by at least ``min_share`` % of ``now``'s
    saved bytes per step and ``min_bytes``; most grown first."""
    current = _per_step(now, steps)
    total = sum(current.values())
    before: dict[str, list[float]] = {}
    for table, table_steps in baseline:
        for name, value in _per_step(table, table_steps, scale).items():
            before.setdefault(name, []).append(value)
    layers = {n.name: n.layer for n in now}
    found = []
    for name, value in current.items():
        if name not in before:
            continue
        base = statistics.median(before[name])
        if value >= growth * base and value - base >= max(min_share * total / 100, min_bytes):
            found.append(SavedGrowth(name, layers.get(name, ""), base, value))
    return sorted(found, key=lambda g: g.baseline_bytes - g.now_bytes)


def growth_lines(grown: list[SavedGrowth], scaled: bool = False) -> list[str]:
    """The Markdown table of ``fxprof compare`` for the grown rows ([] where none grew); ``scaled``: the baseline's
    bytes were scaled to B's batch size."""
    if not grown:
        return []
    per_sample = "; A scaled to the batch size of B" if scaled else ""
    lines = [f"Saved for backward, MB per step: {len(grown)} layer(s) of B save {GROWTH:g}x as much as in A or more "
             f"(bytes are exact: no noise to rule out){per_sample}:", "",
             "| layer | node | A MB/step | B MB/step | ratio |", "|---|---|---:|---:|---:|"]
    lines += [f"| `{g.layer or g.node}` | `{g.node}` | {g.baseline_bytes / 1e6:.3f} | {g.now_bytes / 1e6:.3f} | "
              f"{g.ratio:.2f}x |" for g in grown]
    return lines
