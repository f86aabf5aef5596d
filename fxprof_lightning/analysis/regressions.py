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
from dataclasses import dataclass, field

from fxprof_lightning.analysis.trust import distortion
from fxprof_lightning.report import CycleReport, ModuleStats, NodeStats, cpu_per_wall, step_spread, waited_share

__all__ = [
    "CONFIRM_FLOOR_MS",
    "CONFIRM_RATIO",
    "DEFAULT_K",
    "DEFAULT_MIN_MS",
    "DEFAULT_MIN_RELATIVE",
    "DEFAULT_MIN_SHARE",
    "MIN_ADDED_MS",
    "MIN_BASELINE",
    "SAME_LEVEL",
    "Delta",
    "Regression",
    "RegressionWatch",
    "Verdict",
    "added_per_step",
    "beyond_doubt",
    "compare",
    "find_regressions",
    "gone_rows",
    "module_rows",
    "new_rows",
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
            backward, all calls), that counts.
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
    node_time = sum(s.total_ms + s.bwd_total_ms for s in now)
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
        if stats.name in known or stats.op in ("module", "step", "unowned"):
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
            if stats.name not in present and stats.op not in ("module", "step", "unowned"):
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


def _outside_explained(flagged: list[Regression], by_name: dict[str, NodeStats], steps: int,
                       step_ms: float) -> list[Regression]:
    """Leave out a row outside the nodes (``step_rows``) that added less than ``STEP_SHARE`` of the step
    (``step_ms``, the median), less per step than a node flagged with it, or less than half what another such row
    added: such rows drift by tens of microseconds in a steady run, and the time between rows and the step's other
    phases move with a slower part's work (its autograd nodes, the cache misses after it): that part says it better."""
    added = {r.node: added_per_step(by_name[r.node], r, steps) for r in flagged}
    outside = [r for r in flagged if by_name[r.node].op in ("step", "unowned")]
    nodes = max((added[r.node] for r in flagged if by_name[r.node].op not in ("module", "step", "unowned")), default=0.0)
    most = max((added[r.node] for r in outside), default=0.0)
    return [r for r in flagged if r not in outside
            or (added[r.node] > nodes and added[r.node] >= most / 2 and added[r.node] >= STEP_SHARE * step_ms)]


# Watching a run --------------------------------------------------------------------------------------------------------

CONFIRM_RATIO = 3.0  # a regression confirmed in its first cycle: every call this much slower, ...
CONFIRM_FLOOR_MS = 0.1  # ... each call at least this much slower (ms), ...
CONFIRM_SPREAD = 0.25  # ... steps this regular, the step slower by at least half the node's added time, which
# is at least STEP_SHARE of the step
SAME_LEVEL = 0.5  # confirmed by the next cycle: its added time at least this x the cycle before's
# A watched row adding less per step is not flagged: the allocator's doing (pages faulted in again) in identical runs,
# for two cycles each, once a step: ReLU's backward 0.006 -> 0.027 ms and 0.020 -> 0.106 ms (CI, tests, 2026-11-28).
MIN_ADDED_MS = 0.1


@dataclass
class Verdict:
    """What one cycle's check found (``RegressionWatch.check``).

    ``skipped`` says why the cycle was not checked (partial, distorted, baseline still short), None if it was;
    ``distortion`` the load signature when distorted. ``regressions`` are confirmed: flagged in this cycle and
    in the sound cycle before it, still adding at least ``same_level`` (``SAME_LEVEL`` by default) x what it added
    there (a change in the code stays or grows, load comes and goes: the plain loop's "other" phase rose 4x, then
    1.6x, in an identical run), or so large in this one that noise cannot explain it (``beyond_doubt``, the steps
    regular, the step slower by at least half the node's added time). Rows adding under ``MIN_ADDED_MS`` per step
    are not flagged. ``unconfirmed`` are flagged for the first time: the next cycle confirms them or not.
    """

    skipped: str | None = None
    distortion: str | None = None
    regressions: list[Regression] = field(default_factory=list)
    unconfirmed: list[Regression] = field(default_factory=list)


def _at_level_before(table: Sequence[NodeStats], regressions: list[Regression],
                     before: Sequence[NodeStats]) -> list[NodeStats]:
    """``table`` as it joins the baseline: each row of a confirmed regression at its level ``before`` (the last
    baseline table's row; a new row left out, and so are the new nodes of a module flagged as ``module <path>``), so
    that the slowdown stays flagged in every cycle while it lasts instead of becoming the level later cycles are
    compared with."""
    slower, old = {r.node for r in regressions}, {s.name: s for s in before}
    modules = [r.node.removeprefix("module ") for r in regressions if r.node.startswith("module ")]
    # A flagged module's new nodes stay new: the module, not they, is compared with the run before the slowdown.
    slower |= {s.name for s in table if s.name not in old and s.op not in ("module", "step", "unowned") and any(
        s.module_path == m or s.module_path.startswith(m + ".") for m in modules)}
    return [old.get(s.name, s) if s.name in slower else s for s in table if s.name not in slower or s.name in old]


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


class RegressionWatch:
    """Checks a run's cycles in order, as the engine does during training and ``fxprof report`` afterwards.

    Each cycle is checked against the last ``baseline_cycles`` sound cycles before it (once there are
    ``MIN_BASELINE``; with fewer, from one, only a change beyond doubt is flagged, and reported once the next sound
    cycle confirms it: a regression starting while the baseline is short is not taken into it as a level the run
    had, and a one-cycle jump of a node with two modes, such as ResNet18's ``layer4.0.conv2`` backward, is no
    alarm); a sound cycle (complete, not distorted by load, ``trust.distortion``) then joins the
    baseline. A flag is reported once confirmed (see ``Verdict``); a cycle whose only flags are unconfirmed
    joins the baseline only if the next sound cycle confirms them (a blip must not raise the baseline, nor
    hide the regression it was the start of). A confirmed regression's row joins at its level before, so the
    slowdown is flagged in every cycle while it lasts (a new row stays new), and no more once it is gone.

    >>> from fxprof_lightning.report import NodeStats
    >>> def table(fc, other=1.0):
    ...     return [NodeStats("fc", "call_module", "fc", "fc", 3, fc, fc, fc, fc, 3 * fc, 50.0)] + [
    ...         NodeStats(f"n{i}", "call_module", "n", "n", 3, other, other, other, other, 3 * other, 10.0) for i in range(5)]
    >>> watch = RegressionWatch()
    >>> [watch.check(table(1.0), [9.0, 9.1, 9.0]).skipped for _ in range(3)]
    ['baseline: 0 of 3 earlier cycles', 'baseline: 1 of 3 earlier cycles', 'baseline: 2 of 3 earlier cycles']
    >>> first = watch.check(table(1.8), [11.4, 11.5, 11.4])  # 1.8x: flagged, not yet confirmed
    >>> [r.node for r in first.unconfirmed], first.regressions
    (['fc'], [])
    >>> [r.node for r in watch.check(table(1.8), [11.4, 11.5, 11.4]).regressions]  # it persists: confirmed
    ['fc']
    >>> [r.node for r in watch.check(table(1.8), [11.4, 11.5, 11.4]).regressions]  # flagged while it lasts
    ['fc']
    >>> watch.check(table(1.0), [9.0, 9.1, 9.0]).regressions  # gone
    []
    """

    def __init__(self, baseline_cycles: int = 5, history: int = 20, same_level: float = SAME_LEVEL,
                 **options: float | bool) -> None:
        self.baseline_cycles, self.history, self.same_level, self.options = baseline_cycles, history, same_level, options
        self.baseline: list[Sequence[NodeStats]] = []  # the recent sound cycles' tables
        self.medians: list[float] = []  # and their median step ms
        self.cpu: list[float] = []  # and their CPU s per wall s
        self.wait: list[float] = []  # and the share of their wall time our threads waited for a core (where known)
        self._flagged: dict[tuple[str, str], float] = {}  # flagged in the last sound cycle: ms per call it added
        self._held: tuple[Sequence[NodeStats], float, float | None, float | None] | None = None  # that cycle, if only flags in question

    def _confirms(self, change: Regression) -> bool:
        """Whether the same row was flagged in the sound cycle before at the same level (``same_level``)."""
        return same_level(self._flagged.get((change.node, change.direction)), change.now_ms - change.baseline_ms,
                          self.same_level)

    def check(self, nodes: Sequence[NodeStats], step_ms: list[float], step_cpu_ms: list[float] = (),
              partial: bool = False, modules: Sequence[ModuleStats] = (), steps: Sequence[NodeStats] = (),
              step_wait_ms: Sequence[float] = ()) -> Verdict:
        """``modules``: the cycle's module tree; a module slower per step that has nodes the last baseline cycle
        did not (a loop run more times, a branch taken) is flagged as ``"module <path>"`` (see ``module_rows``).
        ``steps``: the step's time outside the node rows as rows (``step_rows``), watched as the nodes are.
        ``step_wait_ms``: the process's threads' wait for a core in each recorded step, where Linux says (``trust``)."""
        if partial:
            return Verdict(skipped="partial")
        recent = self.baseline[-self.baseline_cycles:]
        shared = shared_factor(recent, nodes) if recent else 1.0
        cpu, wait = cpu_per_wall(step_ms, list(step_cpu_ms)), waited_share(step_ms, list(step_wait_ms))
        load = distortion(step_ms, self.medians, shared, cpu, self.cpu, wait, self.wait)
        if load is not None:
            return Verdict(skipped="distorted", distortion=load)
        verdict = Verdict()
        rows = [*nodes, *module_rows(modules), *steps]
        short = len(self.baseline) < MIN_BASELINE  # the cycle-to-cycle noise is not known yet: only the clear count
        if self.baseline:
            flagged = find_regressions(self.baseline, rows, self.baseline_cycles, min_baseline=1, **self.options)
            before = {s.name for s in self.baseline[-1] if s.op not in ("module", "step", "unowned")}
            new_in = {s.module_path for s in nodes if s.name not in before}  # modules with nodes the baseline lacks
            flagged = [r for r in flagged if not r.node.startswith("module ") or any(
                p == r.node[7:] or p.startswith(r.node[7:] + ".") for p in new_in)]  # else its nodes tell it better
            by_name = {s.name: s for s in rows}
            steps = max(len(step_ms), 1)
            median_step = statistics.median(step_ms) if step_ms else 0.0
            modules = [r.node.removeprefix("module ") for r in flagged if r.node.startswith("module ")]
            flagged += [d.regression() for d in new_rows(self.baseline, nodes, steps, median_step)  # (new nodes
                        if not any(by_name[d.node].module_path == m or by_name[d.node].module_path.startswith(m + ".")
                                   for m in modules)]  # of a module flagged as one: the module says it)
            flagged = _outside_explained(flagged, by_name, steps, median_step)
            flagged = [r for r in flagged if added_per_step(by_name[r.node], r, steps) >= MIN_ADDED_MS]
            step_rise = median_step - statistics.median(self.medians) if step_ms and self.medians else 0.0
            regular = (step_spread(step_ms) or 0.0) <= CONFIRM_SPREAD
            for r in flagged:
                stats = by_name[r.node]
                # (a row outside the nodes, one value per cycle, is confirmed by the next sound cycle only: it
                # moves with the nodes' work, and noise cannot be told from one cycle)
                clear = (stats.op not in ("step", "unowned") and beyond_doubt(stats, r, steps, median_step) and regular
                         and step_rise >= added_per_step(stats, r, steps) / 2)
                if self._confirms(r) or (clear and not short):
                    verdict.regressions.append(r)
                elif clear or not short:  # (on a short baseline, only a change beyond doubt is flagged at all)
                    verdict.unconfirmed.append(r)
            self._flagged = {(r.node, r.direction): r.now_ms - r.baseline_ms
                             for r in (*verdict.regressions, *verdict.unconfirmed)}
        if short and not verdict.regressions and not verdict.unconfirmed:
            verdict.skipped = f"baseline: {len(self.baseline)} of {MIN_BASELINE} earlier cycles"
        entry = (rows, statistics.median(step_ms or [0.0]), cpu, wait)
        if verdict.unconfirmed and not verdict.regressions:
            self._held = entry  # in question: kept out of the baseline until the next sound cycle decides
            return verdict
        held, self._held = self._held, None
        before = self.baseline[-1] if self.baseline else []
        for table, median, used, waited in ([held] if held is not None and verdict.regressions else []) + [entry]:
            table = _at_level_before(table, verdict.regressions, before)
            self.baseline = [*self.baseline, table][-self.history:]
            self.medians = [*self.medians, median][-self.history:]
            if used is not None:
                self.cpu = [*self.cpu, used][-self.history:]
            if waited is not None:
                self.wait = [*self.wait, waited][-self.history:]
        return verdict
