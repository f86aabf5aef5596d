"""A cycle's samples folded into its statistics: per node (forward and backward, FLOPs, memory), per module of the
tree, per FSDP range; and the ranks' node tables merged into one (means over ranks, the slowest rank named)."""

from __future__ import annotations

import statistics
from dataclasses import fields, replace
from typing import Any

from fxprof_lightning.nodes import NodeInfo
from fxprof_lightning.report import NS_PER_MS, ModuleStats, NodeStats, RangeStats

__all__ = ["merge_ranks", "summarize_modules", "summarize_nodes", "summarize_ranges"]


def summarize_ranges(per_rank: list[dict[str, list[int]] | None], steps: int) -> list[RangeStats]:
    """Per-step time of each named range, averaged over the ranks that recorded it, slowest first."""
    names = sorted({name for ranges in per_rank if ranges for name in ranges})
    stats = []
    for name in names:
        tables = [ranges[name] for ranges in per_rank if ranges and name in ranges]
        module = name.rpartition(" (")[2].rstrip(")") if name.endswith(")") else name.rpartition(" for ")[2] if " for " in name else ""
        stats.append(RangeStats(name, module, sum(len(t) for t in tables) / len(tables) / steps,
                                sum(sum(t) for t in tables) / len(tables) / steps / NS_PER_MS))
    return sorted(stats, key=lambda r: r.ms_per_step, reverse=True)


def _mad(ns: list[int]) -> float:
    """Median absolute deviation of nanosecond samples, in ms."""
    if len(ns) < 2:
        return 0.0
    middle = statistics.median(ns)
    return statistics.median(abs(x - middle) for x in ns) / NS_PER_MS


def _spread(ns: list[int]) -> tuple[float, float, float, float, float]:
    """mean, median, min, max, total of nanosecond samples, in ms."""
    if not ns:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    total = sum(ns)
    return total / len(ns) / NS_PER_MS, statistics.median(ns) / NS_PER_MS, min(ns) / NS_PER_MS, max(ns) / NS_PER_MS, total / NS_PER_MS


def _gflops(flops: int | None, mean_ms: float) -> float | None:
    return flops / (mean_ms * 1e6) if flops and mean_ms > 0 else None  # no rate for ops that count no FLOPs


def summarize_nodes(
    nodes: list[NodeInfo],
    fwd: list[list[int]],
    bwd: list[list[int]] | None = None,
    costs: Any = None,
    mem_delta: list[list[int]] | None = None,
    mem_peak: list[list[int]] | None = None,
    saved: list[float | None] | None = None,
    held: list[float | None] | None = None,
) -> list[NodeStats]:
    """Statistics per node (nodes that never ran are left out; a node with backward time only, such as a checkpointed
    region's recompute, has no forward calls), slowest (forward + backward) first.

    ``costs`` is a ``flops.NodeCosts`` for the same nodes, or None; ``saved`` the bytes each keeps for backward per
    call (``saved_memory``), or None; ``held`` the bytes kept for backward once each has run, or None.
    """
    bwd = bwd or [[] for _ in nodes]
    fwd_grand = sum(sum(s) for s in fwd) or 1
    bwd_grand = sum(sum(s) for s in bwd) or 1
    stats = []
    for i, info in enumerate(nodes):
        if not fwd[i] and not bwd[i]:
            continue
        mean, median, low, high, total = _spread(fwd[i])
        b_mean, b_median, b_low, b_high, b_total = _spread(bwd[i])
        fwd_flops = costs.fwd_flops[i] if costs else None
        bwd_flops = costs.bwd_flops[i] if costs else None
        stats.append(
            NodeStats(
                name=info.name, op=info.op, target=info.target, module_path=info.module_path,
                calls=len(fwd[i]), mean_ms=mean, median_ms=median, min_ms=low, max_ms=high, total_ms=total,
                pct=100.0 * sum(fwd[i]) / fwd_grand,
                bwd_calls=len(bwd[i]), bwd_mean_ms=b_mean, bwd_median_ms=b_median, bwd_min_ms=b_low,
                bwd_max_ms=b_high, bwd_total_ms=b_total, bwd_pct=100.0 * sum(bwd[i]) / bwd_grand,
                fwd_flops=fwd_flops, bwd_flops=bwd_flops,
                fwd_gflops_per_s=_gflops(fwd_flops, mean), bwd_gflops_per_s=_gflops(bwd_flops, b_mean),
                out_bytes=costs.out_bytes[i] if costs else None, fwd_bytes=costs.fwd_bytes[i] if costs else None,
                mem_delta_bytes=statistics.fmean(mem_delta[i]) if mem_delta and mem_delta[i] else None,
                mem_peak_bytes=statistics.fmean(mem_peak[i]) if mem_peak and mem_peak[i] else None,
                slowest_rank_ms=mean, mad_ms=_mad(fwd[i]), bwd_mad_ms=_mad(bwd[i]), source=info.source,
                saved_bytes=saved[i] if saved is not None and i < len(saved) else None,
                saved_held_bytes=held[i] if held is not None and i < len(held) else None,
            )
        )
    stats.sort(key=lambda s: s.total_ms + s.bwd_total_ms, reverse=True)
    return stats


def summarize_modules(nodes: list[NodeInfo], stats: list[NodeStats], steps: int, type_of: Any) -> list[ModuleStats]:
    """Aggregate node times into the module tree, depth first; each node counted once per level.

    ``nodes[i].module_stack`` names the module invocations a node ran inside (``path`` or
    ``path@N`` for the N-th extra call of a shared module); ``type_of(path)`` gives a type name.
    """
    by_name = {s.name: s for s in stats}
    steps = max(steps, 1)
    invocations: dict[str, set[str]] = {"": {""}}
    self_fwd: dict[str, float] = {}
    self_bwd: dict[str, float] = {}
    total_fwd: dict[str, float] = {}
    total_bwd: dict[str, float] = {}
    hook_calls: dict[str, int] = {}
    saved: dict[str, float] = {}
    forward_calls = max((s.calls for s in stats if s.op != "module"), default=0)
    for info in nodes:
        s = by_name.get(info.name)
        if s is None:
            continue
        paths = ["", *(key.split("@")[0] for key in info.module_stack)]
        for key in info.module_stack:
            invocations.setdefault(key.split("@")[0], set()).add(key)
        for path in dict.fromkeys(paths):
            total_fwd[path] = total_fwd.get(path, 0.0) + s.total_ms
            total_bwd[path] = total_bwd.get(path, 0.0) + s.bwd_total_ms
            if s.saved_bytes is not None:  # (a module none of whose nodes' is known has none)
                saved[path] = saved.get(path, 0.0) + s.saved_bytes * s.calls
        own = paths[-1]
        self_fwd[own] = self_fwd.get(own, 0.0) + s.total_ms
        self_bwd[own] = self_bwd.get(own, 0.0) + s.bwd_total_ms
        if s.op == "module":
            hook_calls[info.module_path] = s.calls
    ends = _module_ends(nodes, by_name)
    modules = []
    for path in sorted(total_fwd, key=_tree_order):
        calls = hook_calls.get(path, len(invocations.get(path, ())) * forward_calls)
        modules.append(
            ModuleStats(
                path=path, type_name=type_of(path), depth=0 if not path else path.count(".") + 1,
                calls_per_step=calls / steps,
                self_fwd_ms=self_fwd.get(path, 0.0) / steps, total_fwd_ms=total_fwd[path] / steps,
                self_bwd_ms=self_bwd.get(path, 0.0) / steps, total_bwd_ms=total_bwd[path] / steps,
                saved_bytes_per_step=saved[path] / steps if path in saved else None,
                **ends.get(path, {}),
            )
        )
    return modules


def _module_ends(nodes: list[NodeInfo], by_name: dict[str, NodeStats]) -> dict[str, dict[str, Any]]:
    """Per module path, what a checkpoint of it would keep (``ModuleStats.input_bytes``...): its input, the output of
    the row that ran (in graph order) just before its first row, and its output, that of its last row, each with
    whether that row saved it for backward (its saved bytes at least its output's, as a ``ReLU`` saves its result)."""
    rows = [by_name[info.name] for info in nodes if info.name in by_name and by_name[info.name].calls]
    stacks = [info.module_stack for info in nodes if info.name in by_name and by_name[info.name].calls]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, stack in enumerate(stacks):
        for key in stack:
            if "@" not in key:  # (a module's first call)
                first.setdefault(key, i)
                last[key] = i
    ends: dict[str, dict[str, Any]] = {}
    for path, i in first.items():
        before, end = rows[i - 1] if i > 0 else None, rows[last[path]]
        ends[path] = {"input_bytes": before.out_bytes if before is not None else None, "input_held": _keeps_output(before),
                      "output_bytes": end.out_bytes, "output_held": _keeps_output(end)}
    return ends


def _keeps_output(row: NodeStats | None) -> bool:
    return bool(row is not None and row.out_bytes and row.saved_bytes is not None and row.saved_bytes >= row.out_bytes)


def _tree_order(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.split(".")) if path else ()


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
        merged_fields = {  # means over ranks by default ...
            f.name: statistics.fmean(getattr(s, f.name) for s in tables)
            for f in fields(NodeStats)
            if (f.name.endswith(("_ms", "_bytes", "_per_s")) or f.name in ("intensity", "pct_of_peak")) and all(getattr(s, f.name) is not None for s in tables)
        }
        merged_fields.update(  # ... except these
            calls=max(s.calls for s in tables),
            bwd_calls=max(s.bwd_calls for s in tables),
            median_ms=statistics.median(s.median_ms for s in tables),
            bwd_median_ms=statistics.median(s.bwd_median_ms for s in tables),
            min_ms=min(s.min_ms for s in tables),
            max_ms=max(s.max_ms for s in tables),
            bwd_min_ms=min(s.bwd_min_ms for s in tables),
            bwd_max_ms=max(s.bwd_max_ms for s in tables),
            slowest_rank=slowest_rank,
            slowest_rank_ms=slowest.mean_ms,
        )
        merged.append(replace(tables[0], **merged_fields))
    fwd_grand = sum(s.total_ms for s in merged) or 1.0
    bwd_grand = sum(s.bwd_total_ms for s in merged) or 1.0
    merged = [replace(s, pct=100.0 * s.total_ms / fwd_grand, bwd_pct=100.0 * s.bwd_total_ms / bwd_grand) for s in merged]
    merged.sort(key=lambda s: s.total_ms + s.bwd_total_ms, reverse=True)
    return merged
