"""Per-cycle results: node statistics from raw samples, and their Markdown and CSV forms."""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fxprof_lightning.node_timing import NodeInfo

__all__ = ["CycleReport", "NodeStats", "merge_ranks", "summarize_nodes"]

NS_PER_MS = 1e6


@dataclass(frozen=True)
class NodeStats:
    """Forward wall time of one FX node over a cycle's recorded steps.

    ``mean_ms``/``median_ms``/``min_ms``/``max_ms`` are per call; ``total_ms`` is the sum over
    all calls in the cycle and ``pct`` its share of the summed time of all nodes. With several
    ranks (see ``merge_ranks``) the figures are means over ranks, ``min_ms``/``max_ms`` the
    extremes over ranks, and ``slowest_rank``/``slowest_rank_ms`` name the rank with the
    highest ``mean_ms`` and that mean.
    """

    name: str
    op: str
    target: str
    module_path: str
    calls: int
    mean_ms: float
    median_ms: float
    min_ms: float
    max_ms: float
    total_ms: float
    pct: float
    slowest_rank: int = 0
    slowest_rank_ms: float = 0.0


def summarize_nodes(nodes: list[NodeInfo], samples: list[list[int]]) -> list[NodeStats]:
    """Statistics per node (nodes that never ran are left out), slowest total first."""
    grand_total = sum(sum(s) for s in samples) or 1
    stats = []
    for info, ns in zip(nodes, samples, strict=True):
        if not ns:
            continue
        total = sum(ns)
        stats.append(
            NodeStats(
                name=info.name,
                op=info.op,
                target=info.target,
                module_path=info.module_path,
                calls=len(ns),
                mean_ms=total / len(ns) / NS_PER_MS,
                median_ms=statistics.median(ns) / NS_PER_MS,
                min_ms=min(ns) / NS_PER_MS,
                max_ms=max(ns) / NS_PER_MS,
                total_ms=total / NS_PER_MS,
                pct=100.0 * total / grand_total,
                slowest_rank_ms=total / len(ns) / NS_PER_MS,
            )
        )
    stats.sort(key=lambda s: s.total_ms, reverse=True)
    return stats


def merge_ranks(per_rank: list[list[NodeStats] | None]) -> list[NodeStats]:
    """One table from every rank's table (index = rank; None or [] for a rank that timed nothing)."""
    by_name: dict[str, list[tuple[int, NodeStats]]] = {}
    for rank, table in enumerate(per_rank):
        for stats in table or []:
            by_name.setdefault(stats.name, []).append((rank, stats))
    merged = []
    for entries in by_name.values():
        tables = [s for _, s in entries]
        slowest_rank, slowest = max(entries, key=lambda entry: entry[1].mean_ms)
        merged.append(
            replace(
                tables[0],
                calls=max(s.calls for s in tables),
                mean_ms=statistics.fmean(s.mean_ms for s in tables),
                median_ms=statistics.median(s.median_ms for s in tables),
                min_ms=min(s.min_ms for s in tables),
                max_ms=max(s.max_ms for s in tables),
                total_ms=statistics.fmean(s.total_ms for s in tables),
                slowest_rank=slowest_rank,
                slowest_rank_ms=slowest.mean_ms,
            )
        )
    grand_total = sum(s.total_ms for s in merged) or 1.0
    merged = [replace(s, pct=100.0 * s.total_ms / grand_total) for s in merged]
    merged.sort(key=lambda s: s.total_ms, reverse=True)
    return merged


@dataclass
class CycleReport:
    """What one profiling cycle recorded.

    Attributes:
        index: 0-based cycle number in the schedule.
        steps: the recorded (active) step numbers.
        nodes: per-node statistics, slowest first (empty without FX timing).
        trace_paths: torch.profiler trace files written for this cycle.
        directory: the cycle's output directory.
        partial: True when the report holds only some of the cycle's recorded steps (training stopped
            inside it, or this run resumed inside it).
        ranks: how many ranks' node tables were merged into ``nodes``.
        stage: ``"train"`` or ``"val"``.
    """

    index: int
    steps: list[int]
    nodes: list[NodeStats] = field(default_factory=list)
    trace_paths: list[Path] = field(default_factory=list)
    directory: Path | None = None
    partial: bool = False
    ranks: int = 1
    stage: str = "train"

    @property
    def forward_ms_per_step(self) -> float:
        """Summed node forward time per recorded step."""
        return sum(n.total_ms for n in self.nodes) / max(len(self.steps), 1)

    def to_markdown(self, top_k: int | None = None) -> str:
        """The node table as Markdown, slowest first (``top_k`` rows at most)."""
        shown = self.nodes if top_k is None else self.nodes[:top_k]
        steps = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "no recorded step"
        stage = "Validation cycle" if self.stage == "val" else "Cycle"
        over_ranks = f", mean over {self.ranks} ranks" if self.ranks > 1 else ""
        straggler = self.ranks > 1
        lines = [
            f"{stage} {self.index}{' (partial)' if self.partial else ''}, {steps}: "
            f"forward {self.forward_ms_per_step:.3f} ms per step over {len(self.nodes)} nodes{over_ranks}",
            "",
            "| op type | node | target | mean ms | % of total | calls |" + (" slowest rank ms | slowest rank |" if straggler else ""),
            "|---|---|---|---:|---:|---:|" + ("---:|---:|" if straggler else ""),
        ]
        for n in shown:
            row = f"| {n.op} | {_md(n.name)} | {_md(n.target)} | {n.mean_ms:.3f} | {n.pct:.1f} | {n.calls} |"
            if straggler:
                row += f" {n.slowest_rank_ms:.3f} | {n.slowest_rank} |"
            lines.append(row)
        if len(shown) < len(self.nodes):
            lines.append(f"\n{len(self.nodes) - len(shown)} faster nodes not shown.")
        return "\n".join(lines)

    def to_csv(self) -> str:
        """All node statistics as CSV, one row per node, slowest first."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[f.name for f in fields(NodeStats)], lineterminator="\n")
        writer.writeheader()
        for n in self.nodes:
            writer.writerow(_rounded(asdict(n)))
        return buffer.getvalue()


def _md(text: str) -> str:
    """A code span that is safe inside a Markdown table cell."""
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
