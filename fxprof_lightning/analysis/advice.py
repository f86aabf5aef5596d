"""What to try: rules that read a cycle's node table and return one sentence per finding.

Each rule is a pure function of node statistics (and, for some, of earlier cycles or the
regressions found) returning ``Advice`` items; ``advise`` runs them all and keeps the most
important. A sentence names the node or module, gives the evidence, and says what to try.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fxprof_lightning.report import NodeStats

__all__ = ["Advice", "advise", "checkpointing", "elementwise_share", "heavy_backward", "host_syncs", "low_peak",
           "memory_bound", "model_share", "overhead_bound", "regressed", "saved_grew", "slow_rank", "whole_step"]

MIN_SHARE = 5.0  # % of the step's node time: smaller nodes are not worth advice
MEMORY_SHARE = 20.0  # % of node time in one memory-bound matmul/conv: worth saying the batch is too small
LOW_PEAK = 30.0  # % of the roofline's attainable rate below which a large matmul or conv is "low"
BACKWARD_RATIO = 3.0  # backward this many times its forward is suspicious (2x is normal for matmuls)
ELEMENTWISE_SHARE = 15.0  # % of the step's node time in one module's elementwise nodes
BACKWARD_RATE = 2.0  # heavy_backward: a backward slower per FLOP than this times its forward is worth a look
LOOKUP_READS = 100  # a node reading this many times the bytes it writes, with no FLOPs, is a table lookup
SLOW_RANK_EXCESS = 10.0  # % of node time the slow rank's forward must lag behind the ranks' mean
SLOW_RANK_SHARE = 2 / 3  # the same rank slowest in this share of the cycles
STEP_SHARE = 25.0  # % of the whole step in data, optimizer or other callbacks worth saying first
MODEL_SHARE = 40.0  # % of the whole step in training_step + backward below which node-level advice is left out
LOOP_NODES = 16  # FLOP-less nodes of one module, a quarter of them indexing: a Python loop over a tensor's slices
HOST_SYNC_WEIGHT = 101.5  # host_syncs: above every node-level finding (a share, at most 101), below the step's phases
PER_RULE = 2  # findings of one rule kept, so that the few lines cover different problems


@dataclass(frozen=True)
class Advice:
    """One finding: ``weight`` orders them (the share of step time at stake, in %)."""

    weight: float
    text: str


def _share(node: NodeStats, grand_ms: float) -> float:
    return 100.0 * (node.total_ms + node.bwd_total_ms) / grand_ms if grand_ms > 0 else 0.0


def _grand(nodes: list[NodeStats]) -> float:
    return sum(n.total_ms + n.bwd_total_ms for n in nodes)


def low_peak(nodes: list[NodeStats]) -> list[Advice]:
    """A matmul or conv with a large share of the time that reaches a small fraction of the device's peak."""
    grand, found = _grand(nodes), []
    for n in nodes:
        if not n.fwd_flops or n.pct_of_peak is None or n.pct_of_peak >= LOW_PEAK or _share(n, grand) < MIN_SHARE \
                or n.bound == "overhead":
            continue
        what = "a larger batch or matrix sizes (multiples of 8/64), bf16 autocast or TF32" if n.bound == "compute" else \
            "a larger batch (more work per byte), fusing it with its neighbours (torch.compile), or a lower precision"
        found.append(Advice(_share(n, grand), (
            f"{_named(n)} ({_share(n, grand):.0f}% of node time) reaches {n.pct_of_peak:.0f}% of what the "
            f"device allows at its {n.intensity:.1f} FLOP/byte ({n.bound}-bound, {n.fwd_gflops_per_s or 0:.1f} GFLOP/s): "
            f"try {what}.")))
    return found


def _named(n: NodeStats) -> str:
    """A row in advice: as the user's code names it (``NodeStats.layer``), else its node name and target."""
    return f"`{n.layer}`" if n.layer else f"`{n.name}` ({n.target})"


def memory_bound(nodes: list[NodeStats]) -> list[Advice]:
    """Matmuls and convs (nodes with FLOPs) that are memory-bound and together take a large share of the time: their
    weights are read for too little work, which a larger batch fixes (a matmul at a sensible batch is compute-bound).
    One piece of advice for all of them: eight Linear(1024, 1024) at a batch of 2 take 12 % of the time each, 97 %
    together, and no one of them is the batch's problem alone."""
    grand = _grand(nodes)
    bound = [n for n in nodes if n.bound == "memory" and n.fwd_flops and n.intensity is not None
             and not (n.pct_of_peak is not None and n.pct_of_peak < LOW_PEAK)]  # (low_peak says it for those)
    share = sum(_share(n, grand) for n in bound)
    if not bound or share < MEMORY_SHARE:
        return []
    top = max(bound, key=lambda n: _share(n, grand))
    if len(bound) == 1:
        what = (f"{_named(top)} ({share:.0f}% of node time) is memory-bound: {top.intensity:.1f} FLOP per byte moved, so "
                "it waits for its")
    else:
        what = (f"{len(bound)} matmuls or convs ({share:.0f}% of node time; the largest {_named(top)}, "
                f"{_share(top, grand):.0f}%) are memory-bound: {top.intensity:.1f} FLOP per byte moved, so they wait for their")
    return [Advice(1.01 * share, (
        f"{what} weights and activations to be read ({top.fwd_gbytes_per_s or 0:.1f} GB/s), not for "
        "arithmetic; a larger batch does more work per weight read (the backward, which reads and writes them again, "
        "gains the same)."))]


def overhead_bound(nodes: list[NodeStats]) -> list[Advice]:
    """A node that takes a large share of the time while its work is far below one op's fixed cost (``roofline``)."""
    grand, found = _grand(nodes), []
    for n in nodes:
        if n.bound != "overhead" or _share(n, grand) < MIN_SHARE or n.pct_of_peak is None:
            continue
        needs_us = 1e3 * n.mean_ms * n.pct_of_peak / 100
        found.append(Advice(_share(n, grand), (
            f"{_named(n)} ({_share(n, grand):.0f}% of node time) takes {1e3 * n.mean_ms:.1f} us per call where "
            f"its compute and memory traffic need {needs_us:.2f} us: it is bound by the fixed cost of each op (dispatch, "
            "kernel launch, Python), not by the device. Fewer, larger ops help: batch the work or vectorise a Python "
            "loop, CUDA graphs or torch.compile(mode='reduce-overhead'), and no .item() or other host sync inside.")))
    return found


def heavy_backward(nodes: list[NodeStats]) -> list[Advice]:
    """A node whose backward takes many times its forward."""
    grand, found = _grand(nodes), []
    for n in nodes:
        if not _heavy_backward(n) or _share(n, grand) < MIN_SHARE:
            continue
        if n.fwd_flops and n.bwd_flops and (n.bwd_mean_ms / n.mean_ms) / (n.bwd_flops / n.fwd_flops) < BACKWARD_RATE:
            continue  # its backward does that much more work at a rate near its forward's (a conv on a CPU): expected
        evidence = (f"{_named(n)} takes {n.bwd_mean_ms / n.mean_ms:.1f}x as long in backward as in forward "
                    f"({n.bwd_mean_ms:.3f} vs {n.mean_ms:.3f} ms per call, {_share(n, grand):.0f}% of node time; about 2x is "
                    "usual for a matmul or conv)")
        if _table_lookup(n):
            found.append(Advice(_share(n, grand), (
                f"{evidence}. Its inputs hold {n.fwd_bytes / 1e6:.1f} MB, it writes {n.out_bytes / 1e3:.1f} kB and computes "
                "nothing: a lookup into a large table (an embedding), whose dense gradient is the whole table, "
                "written and then updated by the optimizer every step though a batch touches few rows. "
                "nn.Embedding(..., sparse=True) with SGD or torch.optim.SparseAdam (or EmbeddingBag) handles only the "
                "rows used; gradients nobody needs (a frozen table) can be turned off with requires_grad_(False).")))
            continue
        found.append(Advice(_share(n, grand), (
            f"{evidence}: look for gradients nobody needs (frozen weights, inputs with requires_grad) "
            "or an op whose backward is slow on this device; the node's backward ops in the trace show which.")))
    return found


def _heavy_backward(n: NodeStats) -> bool:
    """Whether a node's backward takes ``BACKWARD_RATIO`` times its forward or more."""
    return n.bwd_calls > 0 and n.mean_ms > 0 and n.bwd_mean_ms >= BACKWARD_RATIO * n.mean_ms


def _table_lookup(n: NodeStats) -> bool:
    """A node that computes nothing and reads far more than it writes: a gather from a table (an embedding)."""
    return n.fwd_flops == 0 and bool(n.fwd_bytes) and bool(n.out_bytes) and n.fwd_bytes >= LOOKUP_READS * n.out_bytes


def elementwise_share(nodes: list[NodeStats]) -> list[Advice]:
    """Many small FLOP-less nodes (activations, adds, norms' pieces) of one module taking a large share."""
    grand = _grand(nodes)
    by_module: dict[str, list[NodeStats]] = {}
    for n in nodes:  # by module; outside every submodule, by the user's function (``source``)
        if n.op in ("call_function", "call_method") and not n.fwd_flops:
            by_module.setdefault(n.module_path or re.sub(r":\d+\)$", ")", n.source), []).append(n)
    found = []
    for key, group in by_module.items():
        module = key if group[0].module_path or not group[0].source else group[0].source
        share = sum(_share(n, grand) for n in group)
        if len(group) < 2 or share < ELEMENTWISE_SHARE:
            continue
        names = ", ".join(f"`{n.name}`" for n in group[:4]) + (", ..." if len(group) > 4 else "")
        indexing = sum(1 for n in group if _base_name(n).endswith(("getitem", "select", "unbind")))
        if len(group) >= LOOP_NODES and indexing >= len(group) / 4:  # ops on one slice at a time: a Python loop
            found.append(Advice(share, (
                f"`{module or '(root)'}` runs {len(group)} small ops per call on slices of a tensor ({names}), "
                f"{share:.0f}% of node time: a Python loop over rows, each op paying the fixed cost of an op "
                "(overhead-bound). Vectorise it: one batched op over the whole tensor instead of one per row.")))
            continue
        group = [n for n in group if not _is_view(n)]  # a view reads and writes nothing: fusing saves nothing there
        share = sum(_share(n, grand) for n in group)
        if len(group) < 2 or share < ELEMENTWISE_SHARE:
            continue
        names = ", ".join(f"`{n.name}`" for n in group[:4]) + (", ..." if len(group) > 4 else "")
        found.append(Advice(share, (
            f"{len(group)} elementwise nodes of `{module or '(root)'}` ({names}) take {share:.0f}% of node time, each "
            "reading and writing whole tensors: fusing them (torch.compile, or a fused kernel for the pattern) "
            "would save most of it.")))
    return found


# Ops that give another view of their input (shape, order, a slice) without reading or writing its elements.
VIEWS = {"view", "view_as", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "expand",
         "expand_as", "t", "split", "chunk", "getitem", "size", "narrow", "select", "unbind", "movedim", "as_strided"}


def _is_view(n: NodeStats) -> bool:
    return n.target.rsplit(".", 1)[-1] in VIEWS or _base_name(n).rsplit("_", 1)[-1] in VIEWS


def _base_name(n: NodeStats) -> str:
    """A row's name without the call number ``_N`` of a repeated op (``attn_transpose_3`` -> ``attn_transpose``)."""
    return re.sub(r"_\d+$", "", n.name)


def host_syncs(reads: dict[str, str], on_cpu: bool = False) -> list[Advice]:
    """Where the forward reads a tensor's value on the host (``Capture.host_reads``, found where Dynamo breaks its
    graph): each such read is a host sync on a GPU. Weighted before node-level findings (``HOST_SYNC_WEIGHT``): the
    place and cause are certain, and its cost, the device idle while the host catches up, is out of the node times'
    sight (on a CPU there is none to see)."""
    if not reads:
        return []
    places = "; ".join(f"`{path}` {what}" for path, what in list(reads.items())[:3])
    more = f" (and {len(reads) - 3} more places)" if len(reads) > 3 else ""
    cost = (" On this CPU it costs little, so no node time shows it; on a GPU it does." if on_cpu else "")
    return [Advice(HOST_SYNC_WEIGHT, (
        f"A host sync in the forward, at every call: {places}{more}. Reading a value on the host waits for all the "
        "device work queued before it, so the GPU idles while Python catches up and the next kernels launch late. "
        "Keep the value on the device (torch.where, masks of fixed shape, torch._assert_async for checks), or read "
        f"it every N steps or outside the forward.{cost}"))]


def slow_rank(history: list[list[NodeStats]], ranks: int) -> list[Advice]:
    """The same rank the slowest (for most node time) in most of the cycles so far, and by a material margin in the
    latest: its nodes' excess over the mean of the ranks at least ``SLOW_RANK_EXCESS`` of node time (with two ranks
    one of them is always the slowest; noise alone must not make it a finding)."""
    if ranks < 2 or len(history) < 3:
        return []
    slowest = []
    for nodes in history:
        weight: Counter[int] = Counter()
        for n in nodes:
            weight[n.slowest_rank] += n.total_ms + n.bwd_total_ms
        if weight:
            slowest.append(weight.most_common(1)[0][0])
    rank, count = Counter(slowest).most_common(1)[0] if slowest else (0, 0)
    latest = history[-1]
    mine = [n for n in latest if n.slowest_rank == rank]
    excess = 100.0 * sum(max(_lag_ms(n), 0.0) for n in mine) / max(sum(n.total_ms for n in latest), 1e-12)
    if count < SLOW_RANK_SHARE * len(history) or excess < SLOW_RANK_EXCESS:
        return []
    n = max(mine, key=_lag_ms)
    return [Advice(min(100.0, 50.0 + excess), (
        f"Rank {rank} was the slowest in {count} of {len(history)} cycles, most in `{n.name}` ({n.slowest_rank_ms:.3f} "
        f"ms per call on rank {rank} against {n.mean_ms:.3f} averaged over the ranks; its forward is {excess:.0f}% "
        "of node time above the ranks' mean): the others wait for it at every collective. Check its data loading "
        "and uneven inputs (batch sizes, sequence lengths), its GPU (clocks, other processes)."))]


def _lag_ms(n: NodeStats) -> float:
    """How far the slowest rank's calls of a node lag the ranks' mean, ms over the cycle's calls."""
    return (n.slowest_rank_ms - n.mean_ms) * n.calls


def whole_step(phases: dict[str, float], nodes: list[NodeStats] = ()) -> list[Advice]:
    """A part of the step outside the model (waiting for data, the optimizer, other callbacks) that takes a large
    share of it (``CycleReport.phases``). An optimizer step made large by a dense embedding gradient names the table."""
    total = sum(phases.values())
    if total <= 0:
        return []
    texts = {
        "data": "waits for its next batch {share} of the time ({ms}): more DataLoader workers (num_workers), "
                "pin_memory=True and persistent_workers=True, or less work per sample in the Dataset; the model's "
                "layers are not what the step waits for",
        "optimizer": "spends {share} of its time in the optimizer step ({ms}): a fused or foreach implementation "
                     "(e.g. torch.optim.AdamW(fused=True) on CUDA, foreach=True), fewer parameter groups, or a "
                     "lighter optimizer" + _dense_tables(nodes),
        "callbacks": "spends {share} of its time in other callbacks' hooks ({ms}): see which with Lightning's "
                     "SimpleProfiler, and run them less often",
    }
    found = []
    for phase, text in texts.items():
        share = 100.0 * phases.get(phase, 0.0) / total
        if share >= STEP_SHARE:
            found.append(Advice(share + 100.0, "The step " + text.format(share=f"{share:.0f}%",
                                                                         ms=f"{phases[phase]:.1f} of {total:.1f} ms") + "."))
    return found


def _dense_tables(nodes: list[NodeStats]) -> str:
    """What the optimizer step has to update because of table lookups with a heavy (dense) backward, or ''."""
    tables = [n for n in nodes if _table_lookup(n) and _heavy_backward(n)]
    if not tables:
        return ""
    names = ", ".join(f"`{n.name}`" for n in tables)
    return (f". Part of it is {names}: a lookup into a large table (an embedding) whose dense gradient is the whole "
            "table, which the optimizer then updates every step though a batch touches few rows; "
            "nn.Embedding(..., sparse=True) with SGD or torch.optim.SparseAdam updates only the rows used")


def model_share(phases: dict[str, float]) -> float | None:
    """The share (%) of the step in training_step, zero_grad and backward: what node-level advice can act on."""
    total = sum(phases.values())
    model = ("training_step", "zero_grad", "backward", "forward")  # (forward: a plain loop's, ``LoopClock``)
    return 100.0 * sum(phases.get(p, 0.0) for p in model) / total if total > 0 else None


def regressed(regressions: list) -> list[Advice]:
    """A node that got slower than in the earlier cycles, beyond the noise (``regressions.Regression``)."""
    return [Advice(100.0 * (r.ratio - 1), (
        f"`{r.node}` {r.direction} got {r.ratio:.2f}x slower than in the earlier cycles ({r.baseline_ms:.3f} -> "
        f"{r.now_ms:.3f} ms per call, noise {r.noise_ms:.3f} ms): look at what changed since (input shapes, "
        "data, another process on the machine); `fxprof compare` shows it against any earlier run.")) for r in regressions]


def saved_grew(grown: list) -> list[Advice]:
    """Rows that save much more for backward than in the earlier cycles (``memory_growth``): memory, weighed as a
    regression of a few % of the step."""
    return [Advice(10.0, f"{g.text()} than in the earlier cycles of the same batch size: look at what changed "
                         "(input shapes, sequence lengths, a layer's code); `fxprof compare` shows it against any earlier run.")
            for g in grown]


def checkpointing(plan: Any) -> list[Advice]:
    """Where saved activations are much of what the step holds: the checkpointing plan (``memory_plan``), weighed by
    half the share of the step's peak it saves (memory, not time: it ranks with findings of a smaller share of time)."""
    if plan is None:
        return []
    share = 100 * plan.saved_bytes / plan.peak_bytes
    return [Advice(share / 2, (
        f"Saved activations are much of what the step holds at the end of its forward: {plan.text()}; wrap "
        f"{'each of ' if len(plan.modules) > 1 else ''}`{plan.blocks}` in torch.utils.checkpoint.checkpoint(block, x, "
        "use_reentrant=False) where memory is short (a larger batch or model then fits)."))]


def advise(nodes: list[NodeStats], history: list[list[NodeStats]] = (), regressions: list = (), ranks: int = 1,
           top: int = 5, phases: dict[str, float] | None = None, host_reads: dict[str, str] | None = None,
           on_cpu: bool = False, plan: Any = None, grown: list = ()) -> list[str]:
    """The ``top`` findings (at most ``PER_RULE`` of each rule), most at stake first.

    ``history`` holds the node tables of the cycles so far (this one last), ``regressions`` this
    cycle's regressions, ``ranks`` how many ranks were merged, ``phases`` where the whole step went
    (``CycleReport.phases``): read first; a large share outside the model comes first, and advice about
    the model's nodes is given only when the model is what the step waits for (``MODEL_SHARE`` of it).
    ``host_reads`` are the forward's host syncs (``Capture.host_reads``), ``on_cpu`` whether the run is on a CPU,
    ``plan`` the cycle's checkpointing plan (``memory_plan.CheckpointPlan``) or None, ``grown`` the rows that save
    much more for backward than in the earlier cycles (``memory_growth.SavedGrowth``).
    """
    step = whole_step(phases or {}, nodes)
    share = model_share(phases or {})
    node_level = share is None or share >= MODEL_SHARE
    model = (host_syncs(host_reads or {}, on_cpu), low_peak(nodes), memory_bound(nodes), overhead_bound(nodes),
             heavy_backward(nodes), elementwise_share(nodes))
    rules = (step, regressed(list(regressions)), saved_grew(list(grown)), checkpointing(plan), *(model if node_level else ()), slow_rank(list(history), ranks))
    found = [a for items in rules for a in sorted(items, key=lambda a: a.weight, reverse=True)[:PER_RULE]]
    found.sort(key=lambda a: a.weight, reverse=True)
    return [a.text for a in found[:top]]
