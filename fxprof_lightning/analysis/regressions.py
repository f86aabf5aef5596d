"""Per-layer regressions: which nodes got slower than in earlier cycles, beyond the timing noise.

Pure functions over node tables (``report.NodeStats`` lists, one per cycle); nothing here reads
files or knows the engine. ``compare`` gives every node's change, slower or faster, and says
whether it is beyond the noise; ``find_regressions`` keeps the slower ones.

Noise model. Each node is compared per direction (forward, backward) on its per-call median
(``median_ms``, ``bwd_median_ms``). The baseline value is the median, over the baseline cycles,
of each cycle's per-call median. Its spread (``noise_ms``, a robust standard deviation) combines,
in quadrature, the cycle-to-cycle spread, 1.4826 x the median absolute deviation (MAD) of those
cycle medians (from 3 baseline cycles on; with fewer it counts 0), and the within-cycle spreads,
1.4826 x the MAD of the per-call samples (``mad_ms``, ``bwd_mad_ms``): the median of the baseline
cycles' and the one of the cycle under test. A change is beyond the noise when it exceeds ``k``
spreads, ``min_relative`` of the baseline (timers on a busy machine drift together by several
percent), ``min_ms`` (timing resolution) and, counted over all its calls, ``min_share`` of the
cycle's summed node time (forward and backward): a change too small to matter to the step is not
flagged, and the smallest nodes are the noisiest. Two guards against load from other processes,
which delays some calls by whole scheduler time slices or slows every node at once:

* ``check_fastest``: the cycle's fastest call (``min_ms``, ``bwd_min_ms``) must pass the same test
  against the baseline cycles' fastest calls. Work that a layer really added slows every call;
  a busy machine slows some, so a median moved by two delayed calls of three is not flagged.
* A node back at a level it had in one of the run's earlier sound cycles (within ``MODE_MARGIN``, 5 %; the
  baseline's and, with ``levels``, older ones: ``find_regressions`` gives its whole history) is not flagged slower.
  Some nodes have two modes that last many steps: the weight gradient of ResNet18's ``layer4.0.conv2``
  is a fresh 9.4 MB buffer each backward, and glibc either reuses touched memory (6.5 ms) or extends the
  heap (2304 first-touch page faults, 9.2 ms), the same for hundreds of steps; in identical runs the
  return to the slower mode was flagged 1.4-1.8x (2026-11-24, see benchmarks/README.md).
* ``discount_shared``: when the cycle's nodes ran slower as a whole (the median of now/baseline
  over every node and direction compared, from 5 of them), the baselines are scaled by that
  factor before the tests (and by a factor below 1 for "faster"). A slowdown shared by most
  nodes (load, clocks, thread count) is then no layer's regression: it shows in the totals.

``find_regressions`` flags nothing before it has ``min_baseline`` (3) earlier cycles. The defaults
(``k=4``, ``min_relative=0.15``, ``min_ms=0.002``, ``min_share=0.005``, both guards on) were chosen
with ``benchmarks/bench_regressions.py`` (numbers in benchmarks/README.md). A node or direction
timed on one side only (new, removed, no backward) gets no delta and is no regression.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fxprof_lightning.report import CycleReport, ModuleStats, NodeStats

__all__ = [
    "CONFIRM_FLOOR_MS",
    "CONFIRM_RATIO",
    "CONFIRM_SPREAD",
    "DEFAULT_K",
    "DEFAULT_MIN_MS",
    "DEFAULT_MIN_RELATIVE",
    "DEFAULT_MIN_SHARE",
    "MIN_ADDED_MS",
    "MIN_BASELINE",
    "ROWS_OUTSIDE",
    "SAME_LEVEL",
    "Delta",
    "Regression",
    "added_per_step",
    "beyond_doubt",
    "compare",
    "find_regressions",
    "gone_rows",
    "module_rows",
    "new_rows",
    "outside_explained",
    "same_level",
    "shared_factor",
    "step_change",
    "step_rows",
]

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal samples
DEFAULT_K = 4.0
DEFAULT_MIN_RELATIVE = 0.15
DEFAULT_MIN_MS = 0.002
DEFAULT_MIN_SHARE = 0.005
MIN_BASELINE = 3  # find_regressions: earlier cycles needed before any flag (the cycle-to-cycle spread needs 3)
MODE_MARGIN = 0.05  # a node within this of its highest baseline cycle is back at a level it had: not slower
SHARED_FROM = 5  # compared (node, direction) pairs needed to estimate a shared slowdown
DIRECTIONS = ("forward", "backward")
ROWS_OUTSIDE = ("module", "step", "unowned")  # rows that are no node: a module's (its nodes' sum), the step's others


@dataclass(frozen=True)
class Regression:
    """A node slower than in the baseline cycles beyond the noise (per-call medians, ms).

    ``ratio`` is ``now_ms / baseline_ms``; ``noise_ms`` the spread of the noise model (a robust
    standard deviation; beyond the noise means more than ``k`` times it).
    """

    node: str
    direction: str  # "forward" or "backward"
    baseline_ms: float
    now_ms: float
    ratio: float
    noise_ms: float


@dataclass(frozen=True)
class Delta:
    """One node's change in one direction, slower or faster; ``beyond_noise`` as for a ``Regression``."""

    node: str
    direction: str
    baseline_ms: float
    now_ms: float
    ratio: float
    noise_ms: float
    beyond_noise: bool

    @property
    def delta_ms(self) -> float:
        return self.now_ms - self.baseline_ms

    @property
    def slower(self) -> bool:
        """Slower beyond the noise: a regression."""
        return self.beyond_noise and self.now_ms > self.baseline_ms

    def regression(self) -> Regression:
        return Regression(self.node, self.direction, self.baseline_ms, self.now_ms, self.ratio, self.noise_ms)


@dataclass(frozen=True)
class _Side:
    """One statistic of one node and direction: baseline, now and spread (ms per call), and the highest
    baseline cycle's value."""

    baseline: float
    now: float
    noise: float
    highest: float = math.inf

    def beyond(self, factor: float, k: float, min_relative: float, min_ms: float) -> bool:
        base = self.baseline * factor
        change = abs(self.now - base)
        return change > k * self.noise and change > min_relative * base and change > min_ms


def _samples(stats: NodeStats, direction: str) -> tuple[float, float, float] | None:
    """(per-call median, fastest call, within-cycle spread) of one direction, or None when it did not run."""
    if direction == "forward":
        return (stats.median_ms, stats.min_ms, MAD_TO_SIGMA * stats.mad_ms) if stats.calls > 0 else None
    return (stats.bwd_median_ms, stats.bwd_min_ms, MAD_TO_SIGMA * stats.bwd_mad_ms) if stats.bwd_calls > 0 else None


def _calls(stats: NodeStats, direction: str) -> int:
    return stats.calls if direction == "forward" else stats.bwd_calls


def _side(earlier: list[float], now: float, within: float) -> _Side:
    base = statistics.median(earlier)
    cycle_to_cycle = MAD_TO_SIGMA * statistics.median(abs(v - base) for v in earlier) if len(earlier) >= 3 else 0.0
    return _Side(base, now, math.sqrt(cycle_to_cycle**2 + within**2), max(earlier))


Pair = tuple[NodeStats, str, _Side, _Side]  # the node's stats now, direction, median side, fastest-call side


def _pairs(baseline: Sequence[Sequence[NodeStats]], now: Sequence[NodeStats]) -> list[Pair]:
    """A ``Pair`` for every node and direction timed on both sides."""
    by_name = [{s.name: s for s in table} for table in baseline]
    pairs = []
    for stats in now:
        for direction in DIRECTIONS:
            current = _samples(stats, direction)
            if current is None:
                continue
            earlier = [sample for table in by_name if stats.name in table
                       and (sample := _samples(table[stats.name], direction)) is not None]
            if not earlier:
                continue
            within = math.hypot(statistics.median(w for _, _, w in earlier), current[2])
            pairs.append((stats, direction, _side([m for m, _, _ in earlier], current[0], within),
                          _side([f for _, f, _ in earlier], current[1], within)))
    return pairs


def shared_factor(baseline: Sequence[Sequence[NodeStats]], now: Sequence[NodeStats]) -> float:
    """How much slower ``now``'s nodes ran as a whole: the median now/baseline ratio (1.0 below 5 pairs)."""
    return _factor(_pairs(baseline, now))


def _factor(pairs: list[Pair]) -> float:
    ratios = [median.now / median.baseline for _, _, median, _ in pairs if median.baseline > 0]
    return statistics.median(ratios) if len(ratios) >= SHARED_FROM else 1.0


def compare(
    baseline: Sequence[Sequence[NodeStats]],
    now: Sequence[NodeStats],
    *,
    k: float = DEFAULT_K,
    min_relative: float = DEFAULT_MIN_RELATIVE,
    min_ms: float = DEFAULT_MIN_MS,
    min_share: float = DEFAULT_MIN_SHARE,
    check_fastest: bool = True,
    discount_shared: bool = True,
    levels: Sequence[Sequence[NodeStats]] = (),
) -> list[Delta]:
    """Every node and direction timed in ``now`` and in at least one baseline table, in ``now``'s order.

    Args:
        baseline: one or more earlier cycles' node tables.
        now: the node table under test.
        k: how many spreads (robust standard deviations) a change must exceed.
        min_relative: the smallest relative change (of the baseline) that counts.
        min_ms: the smallest absolute change (ms per call) that counts.
        min_share: the smallest cost of the change, as a share of ``now``'s summed node time (forward and
            backward, all calls, of the node rows: a module's row and the step's other rows are not summed; under
            load, the step's other rows of 70 ms hid a node 1.8x slower in a 2 ms table), that counts.
        check_fastest: the fastest call must have moved beyond the noise too.
        discount_shared: measure changes against baselines scaled by the cycle's shared slowdown.
        levels: more earlier cycles (the run's sound cycles before the baseline's) whose per-call medians a node
            may return to without being flagged slower (a change of mode), besides the baseline's own.

    ``Delta.baseline_ms``, ``now_ms`` and ``ratio`` are the plain medians, unscaled. See the module
    docstring for the noise model.

    Example:
        >>> from fxprof_lightning.report import NodeStats
        >>> def table(ms):
        ...     return [NodeStats("fc", "call_module", "fc", "fc", 3, ms, ms, ms, ms, 3 * ms, 100.0)]
        >>> compare([table(1.0), table(1.01), table(0.99)], table(1.5))[0].beyond_noise
        True
    """
    pairs = _pairs(baseline, now)
    reached: dict[tuple[str, str], float] = {}
    for table in levels:
        for stats in table:
            for direction in DIRECTIONS:
                sample = _samples(stats, direction)
                if sample is not None:
                    key = (stats.name, direction)
                    reached[key] = max(reached.get(key, 0.0), sample[0])
    factor = _factor(pairs) if discount_shared else 1.0
    up, down = max(factor, 1.0), min(factor, 1.0)  # slower than a shared slowdown, faster than a shared speedup
    node_time = sum(s.total_ms + s.bwd_total_ms for s in now if s.op not in ROWS_OUTSIDE)  # (they hold ms per step)
    deltas = []
    for stats, direction, median, fastest in pairs:
        name = stats.name
        slower = median.now > median.baseline * up
        scale = up if slower else down
        cost = abs(median.now - median.baseline * scale) * _calls(stats, direction)
        beyond = ((slower or median.now < median.baseline * down) and cost > min_share * node_time
                  and median.beyond(scale, k, min_relative, min_ms))
        highest = max(median.highest, reached.get((name, direction), 0.0))
        if beyond and slower and median.now <= highest * (1 + MODE_MARGIN):
            beyond = False  # back at a level a baseline cycle had: a change of mode (the allocator's), not a regression
        if beyond and check_fastest:  # the fastest call moved too, the same way
            same_way = (fastest.now > fastest.baseline * scale) == slower
            beyond = same_way and fastest.beyond(scale, k, min_relative, min_ms)
        ratio = median.now / median.baseline if median.baseline > 0 else (math.inf if median.now > 0 else 1.0)
        deltas.append(Delta(name, direction, median.baseline, median.now, ratio, median.noise, beyond))
    return deltas


def module_rows(modules: Sequence[ModuleStats]) -> list[NodeStats]:
    """Each module below the root as a row named ``"module <path>"``: its forward and backward ms per step (with its
    submodules) as one call each, for ``compare``. A module whose time grows through nodes of its own that are new
    (a Python loop run more times is unrolled into new nodes, which are never regressions) shows here."""
    return [NodeStats(name=f"module {m.path}", op="module", target=m.type_name, module_path=m.path, calls=1,
                      mean_ms=m.total_fwd_ms, median_ms=m.total_fwd_ms, min_ms=m.total_fwd_ms, max_ms=m.total_fwd_ms,
                      total_ms=m.total_fwd_ms, pct=0.0, bwd_calls=1 if m.total_bwd_ms > 0 else 0,
                      bwd_mean_ms=m.total_bwd_ms, bwd_median_ms=m.total_bwd_ms, bwd_min_ms=m.total_bwd_ms,
                      bwd_max_ms=m.total_bwd_ms, bwd_total_ms=m.total_bwd_ms)
            for m in modules if m.depth >= 1]


# The step's phases that no node row covers (``step_phases.PHASES``; forward and backward are the rows' own, and the
# profiler's own phase is not the user's): each a row of its own, as is the time no row owns.
WATCHED_PHASES = ("data", "zero_grad", "optimizer", "callbacks", "other")
STEP_SHARE = 0.05  # the least share of the step a row outside the nodes must add to be flagged


def step_rows(report: CycleReport) -> list[NodeStats]:
    """The time of the step outside the node rows as rows ``compare`` can watch, ms per recorded step as one call:
    each of ``WATCHED_PHASES`` (``"step: data"``...), ``training_step`` outside the timed forward (the user's code
    around the model: the loss, metrics), and what no row owns inside the forward and backward
    (``CycleReport.unowned``), so that a slowdown anywhere in the step is some row's."""
    phases = report.phases
    values = {f"step: {name}": ("step", ms, 0.0) for name, ms in phases.items() if name in WATCHED_PHASES}
    if "training_step" in phases and report.forward_wall_ms is not None:
        outside = max(phases["training_step"] - report.forward_wall_ms, 0.0)
        values["step: training_step outside the forward"] = ("step", outside, 0.0)
    for name, (forward, backward) in report.unowned().items():
        values[name] = ("unowned", forward or 0.0, backward or 0.0)
    return [NodeStats(name=name, op=op, target=name, module_path="", calls=1 if fwd > 0 else 0, mean_ms=fwd,
                      median_ms=fwd, min_ms=fwd, max_ms=fwd, total_ms=fwd, pct=0.0, bwd_calls=1 if bwd > 0 else 0,
                      bwd_mean_ms=bwd, bwd_median_ms=bwd, bwd_min_ms=bwd, bwd_max_ms=bwd, bwd_total_ms=bwd)
            for name, (op, fwd, bwd) in values.items()]


def find_regressions(
    history: Sequence[Sequence[NodeStats]],
    now: Sequence[NodeStats],
    baseline_cycles: int = 5,
    *,
    min_baseline: int = MIN_BASELINE,
    k: float = DEFAULT_K,
    min_relative: float = DEFAULT_MIN_RELATIVE,
    min_ms: float = DEFAULT_MIN_MS,
    min_share: float = DEFAULT_MIN_SHARE,
    check_fastest: bool = True,
    discount_shared: bool = True,
) -> list[Regression]:
    """Nodes of ``now`` slower than in the last ``baseline_cycles`` tables of ``history`` beyond the noise.

    Largest ratio first. With fewer than ``min_baseline`` tables in ``history`` (an empty one
    included) there are none: the cycle-to-cycle noise is not known yet. The other keyword
    arguments are ``compare``'s.
    """
    if baseline_cycles < 1 or min_baseline < 1:
        raise ValueError(f"baseline_cycles and min_baseline must be >= 1, got {baseline_cycles!r}, {min_baseline!r}")
    if len(history) < min_baseline:
        return []
    deltas = compare(history[-baseline_cycles:], now, k=k, min_relative=min_relative, min_ms=min_ms,
                     min_share=min_share, check_fastest=check_fastest, discount_shared=discount_shared,
                     levels=history)
    return sorted((d.regression() for d in deltas if d.slower), key=lambda r: r.ratio, reverse=True)


def new_rows(baseline: Sequence[Sequence[NodeStats]], now: Sequence[NodeStats], steps: int, step_ms: float) -> list[Delta]:
    """The node rows of ``now`` that no ``baseline`` table has (new code: a graph break's row, a branch taken, a layer
    added), each direction that adds at least ``STEP_SHARE`` of the step (``step_ms``, the median, over ``steps``
    steps), as slower from nothing (baseline 0 ms, ratio ``inf``): a slowdown that arrives with new code is compared
    like a slower row, and named.

    >>> from fxprof_lightning.report import NodeStats
    >>> def row(name, ms):
    ...     return NodeStats(name, "call_function", name, "", 1, ms, ms, ms, ms, ms, 50.0)
    >>> [(d.node, d.ratio) for d in new_rows([[row("fc", 1.0)]], [row("fc", 1.0), row("helper (train.py:9)", 30.0)], 1, 32.0)]
    [('helper (train.py:9)', inf)]
    """
    known = {s.name for table in baseline for s in table}
    found = []
    for stats in now:
        if stats.name in known or stats.op in ROWS_OUTSIDE:
            continue
        for direction in DIRECTIONS:
            sample = _samples(stats, direction)
            delta = Delta(stats.name, direction, 0.0, sample[0], math.inf, 0.0, True) if sample is not None else None
            if delta is not None and added_per_step(stats, delta, steps) >= STEP_SHARE * step_ms:
                found.append(delta)
    return found


def gone_rows(baseline: Sequence[Sequence[NodeStats]], now: Sequence[NodeStats]) -> list[Delta]:
    """The node rows of ``baseline`` that ``now`` lacks (code no longer run), each direction faster to nothing (now
    0 ms, ratio 0): the time they took is gone from the step, and shown with the other changes.

    >>> from fxprof_lightning.report import NodeStats
    >>> def row(name, ms):
    ...     return NodeStats(name, "call_function", name, "", 1, ms, ms, ms, ms, ms, 50.0)
    >>> [(d.node, d.ratio) for d in gone_rows([[row("fc", 1.0), row("helper", 3.0)]], [row("fc", 1.0)])]
    [('helper', 0.0)]
    """
    present, gone = {s.name for s in now}, {}
    for table in baseline:
        for stats in table:
            if stats.name not in present and stats.op not in ROWS_OUTSIDE:
                gone.setdefault(stats.name, []).append(stats)
    found = []
    for name, earlier in gone.items():
        for direction in DIRECTIONS:
            medians = [sample[0] for stats in earlier if (sample := _samples(stats, direction)) is not None]
            if medians:
                found.append(Delta(name, direction, statistics.median(medians), 0.0, 0.0, 0.0, True))
    return found


def step_change(baseline_steps: Sequence[Sequence[float]], now_steps: Sequence[float], *, k: float = DEFAULT_K,
                min_relative: float = DEFAULT_MIN_RELATIVE) -> Delta | None:
    """The recorded step's wall time now against the baseline cycles' (ms, each cycle's median; the noise from the
    baseline's cycle-to-cycle and within-cycle spreads; slower only when the fastest step now is slower beyond it too),
    as a row ``"step (wall)"``, or None without steps on either side. Beyond the noise, slower, it is a change of
    the step as a whole, flagged even where no single row explains it (each row a little slower; a slowdown shared by
    every row, which ``compare`` discounts).

    >>> step_change([[10.0, 10.1], [10.2, 10.0], [10.1, 10.1]], [13.0, 13.1]).slower
    True
    >>> step_change([[10.0, 10.1], [10.2, 10.0], [10.1, 10.1]], [10.1, 25.0, 30.0]).slower  # two steps delayed
    False
    """
    cycles = [list(steps) for steps in baseline_steps if steps]
    if not cycles or not now_steps:
        return None
    side = _side([statistics.median(steps) for steps in cycles], statistics.median(now_steps),
                 statistics.median(_mad(steps) for steps in cycles))
    # Every step slower, the fastest too (not a median moved by delayed steps); B's own spread widens no threshold.
    fastest = _Side(side.baseline, min(now_steps), side.noise)
    beyond = side.beyond(1.0, k, min_relative, DEFAULT_MIN_MS) and (
        side.now < side.baseline or fastest.beyond(1.0, k, min_relative, DEFAULT_MIN_MS))
    ratio = side.now / side.baseline if side.baseline > 0 else math.inf
    return Delta("step (wall)", "step", side.baseline, side.now, ratio, side.noise, beyond)


def _mad(values: list[float]) -> float:
    middle = statistics.median(values)
    return MAD_TO_SIGMA * statistics.median(abs(v - middle) for v in values)


def added_per_step(stats: NodeStats, change: Regression | Delta, steps: int) -> float:
    """ms per step a slower row added (a step's, an unowned time's or a module's row holds ms per step already)."""
    per_call = change.now_ms - change.baseline_ms
    return per_call if stats.op in ("step", "unowned", "module") else per_call * _calls(stats, change.direction) / steps


def outside_explained(flagged: list[Regression], by_name: dict[str, NodeStats], steps: int,
                      step_ms: float) -> list[Regression]:
    """Leave out a row outside the nodes (``step_rows``) that added less than ``STEP_SHARE`` of the step
    (``step_ms``, the median), less per step than a node flagged with it, or less than half what another such row
    added: such rows drift by tens of microseconds in a steady run, and the time between rows and the step's other
    phases move with a slower part's work (its autograd nodes, the cache misses after it): that part says it better."""
    added = {r.node: added_per_step(by_name[r.node], r, steps) for r in flagged}
    outside = [r for r in flagged if by_name[r.node].op in ("step", "unowned")]
    nodes = max((added[r.node] for r in flagged if by_name[r.node].op not in ROWS_OUTSIDE), default=0.0)
    most = max((added[r.node] for r in outside), default=0.0)
    return [r for r in flagged if r not in outside
            or (added[r.node] > nodes and added[r.node] >= most / 2 and added[r.node] >= STEP_SHARE * step_ms)]


# Confirming a flag (the run's watch, ``watch.RegressionWatch``, and ``fxprof compare``) ----------------------------

CONFIRM_RATIO = 3.0  # a regression confirmed in its first cycle: every call this much slower, ...
CONFIRM_FLOOR_MS = 0.1  # ... each call at least this much slower (ms), ...
CONFIRM_SPREAD = 0.25  # ... steps this regular, the step slower by at least half the node's added time, which
# is at least STEP_SHARE of the step
SAME_LEVEL = 0.5  # confirmed by the next cycle: its added time at least this x the cycle before's
# A watched row adding less per step is not flagged: the allocator's doing (pages faulted in again) in identical runs,
# for two cycles each, once a step: ReLU's backward 0.006 -> 0.027 ms and 0.020 -> 0.106 ms (CI, tests, 2026-11-28).
MIN_ADDED_MS = 0.1


def same_level(before: float | None, now: float, share: float = SAME_LEVEL) -> bool:
    """Whether a slower row still adds what it added when flagged in the cycle before, or more (ms per call; ``before``
    None: it was not flagged): at least ``share`` x it. A change in the code stays or grows; load comes and goes."""
    return before is not None and now >= share * before


def beyond_doubt(stats: NodeStats, change: Regression | Delta, steps: int, step_ms: float) -> bool:
    """Whether every call of a slower node is slower, by more than noise explains, and by enough to matter to the
    step: its median ``CONFIRM_RATIO`` x the baseline, its fastest call ``CONFIRM_RATIO - 1`` x, each call at least
    ``CONFIRM_FLOOR_MS`` slower, and its added time at least ``STEP_SHARE`` of the step (``step_ms``, over ``steps``
    steps; ``stats``: the node now). A tiny node's every call 3x slower in one cycle is what load did to ReLU's
    backward in an identical run (0.02 -> 0.06 ms), and the allocator with no load (0.006 -> 0.026 and 0.016 -> 0.105
    ms: pages faulted in again). Such a change waits for the next cycle to confirm it."""
    fastest = _samples(stats, change.direction)[1]
    return (change.ratio >= CONFIRM_RATIO and fastest >= (CONFIRM_RATIO - 1) * change.baseline_ms
            and change.now_ms - change.baseline_ms >= CONFIRM_FLOOR_MS
            and added_per_step(stats, change, steps) >= STEP_SHARE * step_ms)
