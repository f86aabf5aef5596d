"""``fxprof``: compare two profiled runs layer by layer, or summarize one, from the files they left.

    fxprof compare RUN_A RUN_B       # per-layer forward/backward deltas of B against A, beyond-noise marks
    fxprof report RUN                # cycles, trend of the slowest layers, regressions, advice
    fxprof report RUN --html [OUT]   # ... and the same as one self-contained page (default RUN/fxprof_report.html)
    fxprof trigger DIR               # ask the running job writing DIR for a cycle now (``follow``)
    python -m fxprof_lightning ...   # the same

A RUN is a cycle directory (it holds ``fx_nodes.csv``) or a directory holding cycle directories,
up to 4 levels down (``lightning_logs/version_0``, ``.../fxprof``); see ``runs``. ``compare``
takes every complete training cycle of A as the baseline and B's last sound training cycle (complete, not distorted)
(``--cycle N``: B's cycle N; ``--stage val``: validation cycles) and applies
``regressions.compare``'s noise model; its totals are per step, and per sample too when A and B recorded
different batch sizes (``CycleReport.batch_size``).

Exit status: 0 done, no confirmed regression; 1 confirmed regressions found (``compare``: a node of
B slower than in A beyond the noise in B's cycle and in B's cycle before it, or every call 3x slower, or a layer of B
saving twice as much for backward, ``memory_growth``;
``report``: a cycle with a node slower than in the cycles before it, confirmed as the engine does,
``watch.RegressionWatch``); 2 usage error or nothing to read (no cycle directory, an unreadable file), with a
message on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from fxprof_lightning.analysis.memory_growth import growth_lines, saved_growth
from fxprof_lightning.analysis.regressions import (
    CONFIRM_RATIO,
    DEFAULT_K,
    DEFAULT_MIN_MS,
    DEFAULT_MIN_RELATIVE,
    DEFAULT_MIN_SHARE,
    MIN_ADDED_MS,
    STEP_SHARE,
    Delta,
    Regression,
    added_per_step,
    beyond_doubt,
    compare,
    gone_rows,
    new_rows,
    same_level,
    shared_factor,
    step_change,
    step_rows,
)
from fxprof_lightning.analysis.trust import distortion, waited_out
from fxprof_lightning.analysis.watch import RegressionWatch, Verdict
from fxprof_lightning.engine.follow import INDEX_FILE, read_lines, request_cycle
from fxprof_lightning.layout import HTML_FILE
from fxprof_lightning.outputs.formats import (
    BASELINE_CYCLES,
    legend_report,
    ms_text,
    per_step,
    ratio_text,
    steps_text,
)
from fxprof_lightning.outputs.runs import RunError, find_cycles, load_cycle
from fxprof_lightning.report import CycleReport, NodeStats, describe_phases, last_sound, shorten

__all__ = ["main"]

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2
WIDTH = 120
NAME_WIDTH = 44
TREND_LAYERS = 6
HTML_NAME = HTML_FILE  # fxprof report RUN --html: the page's default place, in RUN

EPILOG = """\
exit status:
  0  done, no regression beyond the noise
  1  confirmed regressions found (compare: a node of B slower than in A beyond the noise
     in B's cycle and the one before it, or every call 3x slower, or a layer of B that
     saves 2x as much for backward as in A; report: a node slower
     than in the cycles before it, in two sound cycles running or beyond doubt in one)
  2  usage error, or nothing to read (no cycle directory with fx_nodes.csv, an unreadable file)

A RUN is a cycle directory (holding fx_nodes.csv) or a directory holding cycle directories
(cycle_NNNN, val_cycle_NNNN), up to 4 levels down: lightning_logs/version_0, fxprof, ...
"""


class UsageError(Exception):
    """Bad arguments for what was found on disk (exit status 2)."""


# ------------------------------------------------------------------ the command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxprof", description="Per-layer timings that fxprof_lightning wrote: compare two runs, summarize one.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{compare,report,trigger}")
    commands.required = True

    cmp = commands.add_parser(
        "compare", help="per-layer deltas of run B against run A", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill("Per-layer forward and backward times of B against A (median ms per call), largest "
                                  "change first. A's baseline: all its complete cycles of the stage; B: its last "
                                  "complete cycle, or --cycle N.", 80))
    cmp.add_argument("a", metavar="A", help="baseline run or cycle directory")
    cmp.add_argument("b", metavar="B", help="run or cycle directory to compare with A")
    cmp.add_argument("--cycle", type=int, metavar="N", help="use B's cycle N (default: its last sound one: complete, not distorted by other load)")
    shown = cmp.add_mutually_exclusive_group()
    shown.add_argument("--top", type=int, default=20, metavar="N", help="show N changes, flagged ones first, then the largest (default 20; every flagged one is shown)")
    shown.add_argument("--all", action="store_true", help="show every node and direction")
    _common(cmp)

    rep = commands.add_parser(
        "report", help="a run's cycles, the trend of its slowest layers, regressions and advice", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill("A run's cycles, the trend of its slowest layers, the regressions found when each "
                                  "cycle is compared with the ones before it, and the advice stored with its last "
                                  "cycle.", 80))
    rep.add_argument("run", metavar="RUN", help="run directory (or one cycle directory)")
    rep.add_argument("--last", type=int, default=20, metavar="N",
                     help="show the last N cycles in the tables (default 20)")
    rep.add_argument("--layers", type=int, default=TREND_LAYERS, metavar="N",
                     help=f"trend of the N slowest layers of the last cycle (default {TREND_LAYERS})")
    rep.add_argument("--html", nargs="?", const="", metavar="OUT.html",
                     help=f"also write the report as one self-contained HTML page (no network; default: RUN/{HTML_NAME})")
    _common(rep)

    trig = commands.add_parser(
        "trigger", help="ask a running job for a cycle now",
        description=textwrap.fill("Ask the running job whose output directory is DIR (its dirpath: the directory "
                                  "that holds its cycle_NNNN directories) for a cycle now, and print which cycle "
                                  "answers. The job starts its warm-up within 2 steps of seeing the request; it looks "
                                  "between training steps, every second at most. Exit status: 0 answered, 1 the job "
                                  "ended or did not answer in time, 2 no profiled job ever ran with that DIR.", 80))
    trig.add_argument("dir", metavar="DIR", help="the running job's dirpath")
    trig.add_argument("--active", type=int, metavar="N", help="recorded steps (default: the job's schedule's)")
    trig.add_argument("--reason", default="", metavar="TEXT", help="why, as the cycle's reports will say")
    trig.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for the answer (60)")
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", choices=("train", "val"), default="train",
                        help="training or validation cycles (default train)")
    parser.add_argument("--k", type=float, default=DEFAULT_K, metavar="K",
                        help=f"a change must exceed K noise spreads (default {DEFAULT_K:g})")
    parser.add_argument("--min-change", type=float, default=DEFAULT_MIN_RELATIVE, metavar="R",
                        help=f"... and this share of the baseline (default {DEFAULT_MIN_RELATIVE:g})")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, 1 or 2, see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already printed by argparse
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command == "trigger":
        if args.active is not None and args.active < 1:
            print(f"fxprof: error: --active must be at least 1, got {args.active}", file=sys.stderr)
            return EXIT_USAGE
        text, status = request_cycle(Path(args.dir), args.active, args.reason or "from the command line", args.timeout)
        print(text, file=sys.stdout if status == 0 else sys.stderr)
        return status
    try:
        for name in ("top", "last", "layers"):
            if getattr(args, name, 1) < 1:
                raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
        if args.k < 0 or args.min_change < 0:
            raise UsageError("--k and --min-change must not be negative")
        options = {"k": args.k, "min_relative": args.min_change}
        if args.command == "compare":
            text, status = run_compare(Path(args.a), Path(args.b), args.stage, args.cycle,
                                       None if args.all else args.top, options)
        else:
            html = None if args.html is None else Path(args.html or Path(args.run) / HTML_NAME)
            text, status = run_report(Path(args.run), args.stage, args.last, args.layers, options, html)
    except (RunError, UsageError) as error:
        print(f"fxprof: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # fxprof report RUN | head: the reader left, and so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


# ------------------------------------------------------------------ loading


def load_stage(path: Path, stage: str, role: str) -> tuple[list[CycleReport], bool, int]:
    """The cycles of ``stage`` at ``path`` in order, whether ``path`` is itself one cycle directory, and how
    many cycles of the other stage it holds."""
    directories = find_cycles(path)
    if not directories:
        raise RunError(f"{role} {path}: no cycle directory found (a directory holding fx_nodes.csv, at most 4 "
                       "levels below, as the CsvSink writes them: lightning_logs/version_0/fxprof/cycle_0000)")
    if directories == [path]:
        return [load_cycle(path)], True, 0
    parents = sorted({d.parent for d in directories})
    if len(parents) > 1:
        listed = ", ".join(str(p) for p in parents[:4]) + (", ..." if len(parents) > 4 else "")
        raise UsageError(f"{role} {path} holds the cycles of {len(parents)} runs ({listed}): name one of them")
    cycles = [load_cycle(d) for d in directories]
    chosen = [c for c in cycles if c.stage == stage]
    if not chosen:
        stages = sorted({c.stage for c in cycles})
        raise RunError(f"{role} {path}: no {_stage_name(stage)} cycle (it has {' and '.join(stages)} cycles: "
                       f"--stage {stages[0]})")
    return chosen, False, len(cycles) - len(chosen)


def _stage_name(stage: str) -> str:
    return "validation" if stage == "val" else "training"


def describe(report: CycleReport) -> str:
    """``training cycle 4 (steps 400-402, partial)`` and its directory."""
    parts = []
    if report.steps:
        parts.append(f"steps {steps_text(report)}")
    if report.batch_size:
        parts.append(f"{report.batch_size} samples per step")
    if report.partial:
        parts.append("partial")
    inside = f" ({', '.join(parts)})" if parts else ""
    return f"{_stage_name(report.stage)} cycle {report.index}{inside}"


# ------------------------------------------------------------------ compare


def run_compare(a: Path, b: Path, stage: str, cycle: int | None, top: int | None,
                options: dict) -> tuple[str, int]:
    """The text of ``fxprof compare`` and its exit status."""
    a_cycles, _, _ = load_stage(a, stage, "A:")
    b_cycles, b_single, _ = load_stage(b, stage, "B:")
    if cycle is not None and b_single:
        raise UsageError(f"--cycle picks a cycle of a run, and B ({b}) is one cycle directory")
    baseline = [c for c in a_cycles if not c.partial] or a_cycles
    if cycle is not None:
        matching = [c for c in b_cycles if c.index == cycle]
        if not matching:
            raise UsageError(f"B: {b} has no {_stage_name(stage)} cycle {cycle} (it has "
                             f"{_index_list([c.index for c in b_cycles])})")
        now = matching[-1]
    else:
        now = last_sound(b_cycles)  # (as report and its page read the slowest layers)
    tables = [_rows(c) for c in baseline]  # the node rows and the step's time outside them (``step_rows``)
    step = statistics.median(now.step_ms) if now.step_ms else 0.0  # (as the watch: the share of the step a row adds)
    steps = max(len(now.steps), 1)
    deltas = [*compare(tables, _rows(now), **options), *new_rows(tables, now.nodes, steps, step),  # (new code: from 0,
              *gone_rows([c.nodes for c in baseline], now.nodes)]  # code no longer run: to 0)
    factor = shared_factor([c.nodes for c in baseline], now.nodes)
    earlier = [c for c in b_cycles if not c.partial and c.index < now.index][-1:] if not b_single else []
    before = {(d.node, d.direction): d.delta_ms for c in earlier for d in compare(tables, _rows(c), **options) if d.slower}
    by_name = {n.name: n for n in _rows(now)}
    outside = {n.name for n in _rows(now) if n.op in ("step", "unowned")}
    waits = [w for c in baseline if (w := c.waited_share) is not None]
    confirmed = {(d.node, d.direction) for d in deltas  # (a row outside the nodes: by the cycle before only, and
                 if d.slower and (same_level(before.get((d.node, d.direction)), d.delta_ms)  # at least STEP_SHARE of
                                  or (d.node not in outside and beyond_doubt(by_name[d.node], d, steps, step)))  # the step)
                 and (d.node not in outside or d.delta_ms >= STEP_SHARE * step)
                 and (added := added_per_step(by_name[d.node], d, steps)) >= MIN_ADDED_MS  # (as the watch: tens of us
                 and not waited_out(added, now.waited_share, waits, step)}  # a step are what a fresh buffer's pages
    # faulted in again make of a tiny node in an identical run; a row B's threads' wait for a core explains is load)
    lines = [f"A: {a}",
             "   " + (describe(baseline[0]) if len(baseline) == 1 else
                      f"{len(baseline)} {_stage_name(baseline[0].stage)} cycles "
                      f"({_index_list([c.index for c in baseline])}); baseline: the median of their per-call medians"),
             f"B: {now.directory}", f"   {describe(now)}", ""]
    lines += delta_table(deltas, top, confirmed)
    grown, scaled = _saved_growth(baseline, now)
    lines += ["", *growth_lines(grown, scaled)] if grown else []
    lines += ["", *totals_table(baseline, now)]
    whole = step_change([c.step_ms for c in baseline], now.step_ms, **options)
    whole_before = step_change([c.step_ms for c in baseline], earlier[0].step_ms, **options) if earlier else None
    load = distortion(now.step_ms, [statistics.median(c.step_ms) for c in baseline if c.step_ms], factor,
                      wait=now.waited_share, earlier_wait=waits)
    whole_confirmed = whole is not None and whole.slower and load is None and (
        whole.ratio >= CONFIRM_RATIO or same_level(whole_before.delta_ms if whole_before and whole_before.slower
                                                   else None, whole.delta_ms))
    lines += step_lines(whole, whole_confirmed, deltas, baseline, now)
    if load is not None and whole is not None and whole.slower:
        lines.append(_wrap(f"B's cycle looks distorted by other load ({load}): its step is not flagged."))
    lines += ["", *legend(options, factor, len(baseline))]
    only_a = {n.name for c in baseline for n in c.nodes} - {n.name for n in now.nodes} - {d.node for d in deltas}
    only_b = {n.name for n in now.nodes} - {n.name for c in baseline for n in c.nodes} - {d.node for d in deltas}
    if only_a or only_b:
        lines.append(_wrap(f"Not compared: {_names(only_b)} only in B; {_names(only_a)} only in A."))
    slower = [d for d in deltas if d.slower]
    unconfirmed = len(slower) - len(confirmed)
    lines.append(f"{len(confirmed)} node direction(s) of B slower than A beyond the noise." if confirmed
                 else "No node of B is slower than A beyond the noise.")
    if unconfirmed:
        lines.append(_wrap(f"{unconfirmed} more slower in B's cycle {now.index} only (marked slower?): not confirmed by "
                           "B's cycle before it nor large enough to rule out noise (every call 3x slower); no regression."))
    return "\n".join(lines), EXIT_REGRESSION if confirmed or whole_confirmed or grown else EXIT_OK


def _saved_growth(baseline: list[CycleReport], now: CycleReport) -> tuple[list, bool]:
    """The rows of B that save much more for backward than in A (``memory_growth``), per sample where the batch sizes
    differ, and whether they did."""
    sizes = (now.batch_size, baseline[0].batch_size)
    scale = sizes[0] / sizes[1] if all(sizes) and sizes[0] != sizes[1] else 1.0
    return saved_growth([(c.nodes, len(c.steps)) for c in baseline], now.nodes, len(now.steps), scale), scale != 1.0


def step_lines(whole: Delta | None, confirmed: bool, deltas: list[Delta], baseline: list[CycleReport],
               now: CycleReport) -> list[str]:
    """The step slower as a whole beyond the noise, flagged even where no single row explains it, with the rows that
    added most per step (a new row from nothing, a gone one to nothing)."""
    if whole is None or not whole.slower:
        return []
    rows = {n.name: (n, max(len(c.steps), 1)) for c in baseline for n in c.nodes}  # (a gone row: A's calls per step)
    rows |= {n.name: (n, max(len(now.steps), 1)) for n in _rows(now)}
    added = [(added_per_step(rows[d.node][0], d, rows[d.node][1]), d) for d in deltas if d.node in rows]
    top = sorted((item for item in added if item[0] > 0), key=lambda item: -item[0])[:3]
    named = ", ".join(f"{shorten(d.node, 48)} {d.direction} {ms:+.3f} ms{' (new)' if d.ratio == float('inf') else ''}"
                      for ms, d in top)
    mark = "STEP SLOWER" if confirmed else "Step slower?"
    return ["", _wrap(f"{mark}: B's step took {ratio_text(whole.ratio)} A's, {whole.delta_ms:+.3f} ms (the median of the "
                      f"steps from their start to their end, as the regression watch compares them), beyond the noise"
                      f" ({whole.noise_ms:.3f} ms)" + (f"; most added by {named}" if named else "")
                      + f"; all the rows' changes add {sum(ms for ms, _ in added):+.3f} ms per step.")]


def _rows(cycle: CycleReport) -> list[NodeStats]:
    return [*cycle.nodes, *step_rows(cycle)]


def delta_table(deltas: list[Delta], top: int | None, confirmed: set[tuple[str, str]] = frozenset()) -> list[str]:
    """The changes, those beyond the noise first (slower before faster), then by size; ``top`` rows at most, but every
    flagged row is shown."""
    ordered = sorted(deltas, key=lambda d: (not d.slower, not d.beyond_noise, -abs(d.delta_ms)))
    flagged = sum(1 for d in ordered if d.beyond_noise)
    shown = ordered if top is None else ordered[:max(top, flagged)]
    lines = [f"{'node':<{NAME_WIDTH}}  {'direction':<9}  {'A ms/call':>10}  {'B ms/call':>10}  {'delta ms':>10}  "
             f"{'ratio':>7}  mark"]
    for d in shown:
        slower = "SLOWER" if (d.node, d.direction) in confirmed else "slower?"
        mark = (slower if d.slower else "faster") if d.beyond_noise else ""
        lines.append(f"{shorten(d.node, NAME_WIDTH):<{NAME_WIDTH}}  {d.direction:<9}  {ms_text(d.baseline_ms):>10}  "
                     f"{ms_text(d.now_ms):>10}  {d.delta_ms:>+10.3f}  {ratio_text(d.ratio):>7}  {mark}".rstrip())
    hidden = ordered[len(shown):]
    if hidden:
        beyond = sum(1 for d in hidden if d.beyond_noise)
        lines.append(f"... {len(hidden)} smaller change(s) not shown"
                     + (f", {beyond} of them beyond the noise" if beyond else "") + " (--all shows them)")
    if not deltas:
        lines.append("(no node timed in both)")
    return lines


def totals_table(baseline: list[CycleReport], now: CycleReport) -> list[str]:
    """Per-step totals: A's median over its cycles, B's cycle; per sample too when A and B ran different batch sizes
    (recorded in every cycle compared), which ratio is then the comparable one."""
    rows = total_rows(baseline, now, lambda c: 1.0)
    if not rows:
        return ["Per step: no totals (no step numbers or module tree in A or B)."]
    lines = _totals_lines("per step", "ms", rows)
    if not now.batch_size or not all(c.batch_size for c in baseline):
        return lines  # a batch size not recorded: nothing to divide by
    a_sizes = sorted({c.batch_size for c in baseline})
    if a_sizes == [now.batch_size]:
        return lines  # the same batch size: per step is per sample
    lines += _totals_lines("per sample", "us", total_rows(baseline, now, lambda c: c.batch_size / 1000))
    a_batch = str(a_sizes[0]) if len(a_sizes) == 1 else f"{a_sizes[0]}-{a_sizes[-1]}"
    work = now.batch_size / statistics.median(a_sizes)
    lines += textwrap.wrap(
        f"A and B ran different batch sizes (A {a_batch}, B {now.batch_size} samples per step): B's steps and node "
        f"calls do {work:.3g}x A's work, so the per-sample ratios are the comparable ones; the per-step ratios and the "
        "ms per call of the rows above include the batch size.", WIDTH, break_on_hyphens=False)
    return lines


def total_rows(baseline: list[CycleReport], now: CycleReport,
               per: Callable[[CycleReport], float]) -> list[tuple[str, float, float]]:
    """(what, A, B) for the nodes' forward and backward and the step's wall time, each cycle's ms per step divided by
    ``per(cycle)``; A's value is the median over its cycles."""
    rows = []
    a_steps = [(s[0] / per(c), s[1] / per(c)) for c in baseline if (s := per_step(c)) is not None]
    b_step = per_step(now)
    if a_steps and b_step is not None:
        rows.append(("forward (nodes)", statistics.median(s[0] for s in a_steps), b_step[0] / per(now)))
        rows.append(("backward (nodes)", statistics.median(s[1] for s in a_steps), b_step[1] / per(now)))
    a_wall = [m / per(c) for c in baseline if (m := c.step_wall_ms) is not None]
    b_wall = now.step_wall_ms
    if a_wall and b_wall is not None:
        rows.append(("step (wall)", statistics.median(a_wall), b_wall / per(now)))
    return rows


def _totals_lines(title: str, unit: str, rows: list[tuple[str, float, float]]) -> list[str]:
    lines = [f"{title:<{NAME_WIDTH}}  {'':<9}  {f'A {unit}':>10}  {f'B {unit}':>10}  {f'delta {unit}':>10}  "
             f"{'ratio':>7}"]
    for name, a, b in rows:
        ratio = b / a if a > 0 else float("inf")
        lines.append(f"{name:<{NAME_WIDTH}}  {'':<9}  {ms_text(a):>10}  {ms_text(b):>10}  {b - a:>+10.3f}  {ratio_text(ratio):>7}")
    return lines


def legend(options: dict, factor: float, baseline_cycles: int) -> list[str]:
    k, floor = options.get("k", DEFAULT_K), options.get("min_relative", DEFAULT_MIN_RELATIVE)
    spread = ("the spread of A's cycle medians and the spread within each cycle" if baseline_cycles >= 3
              else "the spread within each cycle (A has fewer than 3 cycles: no cycle-to-cycle spread)")
    text = (f"SLOWER / faster: beyond the noise, i.e. the median ms per call changed by more than {k:g} x the noise "
            f"({spread}, robust: 1.4826 x MAD), more than {100 * floor:g}%, {DEFAULT_MIN_MS * 1000:g} us and "
            f"{100 * DEFAULT_MIN_SHARE:g}% of B's node time, and the fastest call moved too; counted (exit 1) when it "
            f"adds at least {MIN_ADDED_MS:g} ms a step, more than twice B's threads' longer wait for a core. B's nodes ran "
            f"{factor:.2f}x A's as a whole (median ratio)"
            + ("; that shared change is discounted: it shows in the totals, not as a layer's."
               if abs(factor - 1) > 0.005 else "."))
    return textwrap.wrap(text, WIDTH)


# ------------------------------------------------------------------ report


def run_report(path: Path, stage: str, last: int, layers: int, options: dict,
               html: Path | None = None) -> tuple[str, int]:
    """The text of ``fxprof report`` and its exit status; with ``html``, the same report as a page written there."""
    cycles, _, others = load_stage(path, stage, "RUN:")
    found = check_cycles(cycles, options)
    title = f"{len(cycles)} {_stage_name(cycles[0].stage)} cycle(s)"
    if others:
        other = "val" if stage == "train" else "train"
        title += f"; {others} {_stage_name(other)} cycle(s) too (--stage {other})"
    lines = [f"Run: {path}", title, ""]
    shown = cycles[-last:]
    if len(shown) < len(cycles):
        lines.append(f"(the last {len(shown)} cycles; {len(cycles) - len(shown)} earlier ones: --last {len(cycles)})")
    lines += cycle_table(shown, found)
    lines += ["", *trend_table(shown, layers)]
    now = last_sound(cycles)  # (the last cycle not distorted by other load)
    if now.phases:
        lines += ["", *textwrap.wrap(f"The whole step in cycle {now.index}: {describe_phases(now.phases)}", WIDTH)]
    if now.unowned():
        lines += ["", *textwrap.wrap(f"Time no row owns in cycle {now.index}: {_unowned(now)}", WIDTH)]
    for cycle in (c for c in shown if c.dropped_steps or c.capture_s):
        lines += textwrap.wrap(f"Left out of cycle {cycle.label}'s numbers: {cycle.dropped_text()}", WIDTH)
    lines += textwrap.wrap(_costs(cycles), WIDTH)
    regressions = [(c, r) for c in cycles for r in found[id(c)].regressions]
    lines.append("")
    if regressions:
        lines.append("Regressions, each cycle against the sound cycles before it (median ms per call):")
        lines += [_regression_line(c, r) for c, r in regressions]
    else:
        lines.append(f"No regression beyond the noise in {len(cycles)} cycle(s) (each against the sound cycles "
                     "before it).")
    pending = [(c, r) for c in cycles[-1:] for r in found[id(c)].unconfirmed]
    if pending:
        lines.append("Flagged in the last cycle, not yet confirmed (the next cycle confirms them or not):")
        lines += [_regression_line(c, r) for c, r in pending]
    lines += legend_report(options)
    if now.advice:
        note = " (the last not distorted by other load)" if now is not cycles[-1] else ""
        lines += ["", f"Advice stored with cycle {now.index}{note}:"]
        for item in now.advice:
            lines += textwrap.wrap(str(item), WIDTH, initial_indent="  - ", subsequent_indent="    ")
    if html is not None:
        from fxprof_lightning.outputs.html_report import write_page  # it builds on this module's helpers

        try:
            write_page(html, cycles, found, run=path, title=title, options=options, last=last, layers=layers)
        except OSError as error:
            raise UsageError(f"--html {html}: cannot write the page ({error.strerror or error})") from error
        lines += ["", f"HTML report: {html}"]
    return "\n".join(lines), EXIT_REGRESSION if regressions else EXIT_OK


def _unowned(cycle: CycleReport) -> str:
    """The named rows of ``CycleReport.unowned`` on one line, with the rows' share of each measured wall."""
    parts, unowned = [], cycle.unowned()
    for side, index, rows_ms, wall in (("forward", 0, cycle.forward_ms_per_step, cycle.forward_wall_ms),
                                       ("backward", 1, cycle.backward_ms_per_step, cycle.backward_wall_ms)):
        named = [f"{name} {ms[index]:.3f} ms" for name, ms in unowned.items() if ms[index] is not None]
        if named and wall:
            parts.append(f"{side} {', '.join(named)} (the rows: {100 * rows_ms / wall:.0f}% of the measured "
                         f"{wall:.3f} ms)")
    return "; ".join(parts) + " per step."


def _regression_line(cycle: CycleReport, r: Regression) -> str:
    return (f"  cycle {cycle.index:<5} {shorten(r.node, NAME_WIDTH):<{NAME_WIDTH}} {r.direction:<9} "
            f"{ms_text(r.baseline_ms):>9} -> {ms_text(r.now_ms):<9} {ratio_text(r.ratio):>7}  noise {ms_text(r.noise_ms)}")


def check_cycles(cycles: list[CycleReport], options: dict) -> dict[int, Verdict]:
    """For each cycle (by id): what its check found (why it was not checked, confirmed and unconfirmed flags).

    As the engine does (``watch.RegressionWatch``): each cycle against the last 5 sound cycles before it
    (once there are 3); a flag counts once confirmed (in the next sound cycle too, or beyond what noise explains).
    """
    watch = RegressionWatch(BASELINE_CYCLES, **options)
    return {id(cycle): watch.check(cycle.nodes, cycle.step_ms, cycle.step_cpu_ms, cycle.partial, cycle.modules,
                                   step_rows(cycle), cycle.step_wait_ms) for cycle in cycles}


def cycle_table(cycles: list[CycleReport], found: dict[int, Verdict]) -> list[str]:
    lines = [f"{'cycle':>7}  {'steps':<13}  {'fwd ms/step':>11}  {'bwd ms/step':>11}  {'step ms':>9}  {'spread':>6}  "
             f"{'regressions':>11}  note"]
    for c in cycles:
        totals = per_step(c)
        steps = steps_text(c)
        step, spread = c.step_wall_ms, c.step_spread
        why, regressions = found[id(c)].skipped, found[id(c)].regressions
        name = c.directory.name if c.directory is not None else str(c.index)
        index = str(c.index) if name.endswith(f"{c.index:04d}") else name.removeprefix("val_").removeprefix("cycle_")
        forward, backward = (ms_text(totals[0]), ms_text(totals[1])) if totals else ("?", "?")
        lines.append(
            f"{index:>7}  {steps:<13}  {forward:>11}  {backward:>11}  {ms_text(step) if step is not None else '':>9}  "
            f"{f'{100 * spread:.0f}%' if spread is not None else '':>6}  "
            f"{len(regressions) if why is None else '-':>11}  {_note(why, c)}".rstrip())
    return [*lines, "(fwd, bwd ms/step: the node rows summed; step ms: the measured step, from the end of the one before; means per step)"]


def _costs(cycles: list[CycleReport]) -> str:
    """What the run's training cycles cost, from its index of cycles (``follow.INDEX_FILE``; '' where none)."""
    directory = cycles[-1].directory
    index = read_lines(directory.parent / INDEX_FILE) if directory else []
    costs = {line.get("cycle"): line for line in index}
    known = [costs[c.directory.name] for c in cycles if c.directory is not None and c.directory.name in costs]
    if not known:
        return ""
    total = sum(float(line.get("cost_s") or 0.0) for line in known)
    setup = float(known[-1].get("setup_s") or 0.0)  # (runs before 2026-11-26 did not write it)
    idle = float(known[-1].get("idle_s") or 0.0)  # (nor before 2026-11-28 this)
    notes = [str(line["note"]) for line in index if "note" in line]
    cost = (f"What profiling cost: {total + setup + idle:.2f} s, {total:.2f} s for {len(known)} cycle(s) (the last "
            f"{float(known[-1]['cost_s']):.2f} s), {setup:.2f} s making the capture ready at the run's start and "
            f"{idle:.2f} s in the idle steps between cycles, "
            f"{100 * float(known[-1].get('run_share') or 0.0):.2f}% of the run's wall time by its last cycle "
            "(each cycle's wall time from its first step to its files written, less as many idle steps).")
    absent: dict[str, list[str]] = {}  # why -> the cycles the schedule selected that have no report
    for line in index:
        if "absent" in line:
            absent.setdefault(str(line.get("why")), []).append(str(line["absent"]))
    return "".join(f"Step time: {note}. " for note in notes) + cost + "".join(
        f" No report for {', '.join(names)}: {why}." for why, names in absent.items())


def _note(why: str | None, cycle: CycleReport) -> str:
    """Why a cycle is left out of the comparisons, and why it ran when not by the schedule."""
    trigger = shorten(cycle.trigger, 60) if cycle.trigger != "schedule" else ""
    return "; ".join(part for part in (why, trigger) if part)


def trend_table(cycles: list[CycleReport], layers: int) -> list[str]:
    """ms per call (forward + backward means, as the tables') of the slowest nodes of the last sound cycle, in every
    cycle."""
    now = last_sound(cycles)
    top = now.nodes[:layers]
    if not top:
        return ["(the last cycle timed no node)"]
    column = 10
    lines = [f"Trend of the {len(top)} slowest layers of cycle {now.index}, ms per call "
             "(forward + backward, means):"]
    lines += [f"  [{i + 1}] {shorten(n.layer or n.name, 60)}  (node {shorten(n.name, 40)})" for i, n in enumerate(top)]
    lines.append(f"{'cycle':>7}" + "".join(f"{f'[{i + 1}]':>{column + 2}}" for i in range(len(top))))
    for c in cycles:
        by_name = {n.name: n for n in c.nodes}
        cells = [ms_text(by_name[n.name].mean_ms + by_name[n.name].bwd_mean_ms) if n.name in by_name else "-"
                 for n in top]
        lines.append(f"{c.index:>7}" + "".join(f"{cell:>{column + 2}}" for cell in cells))
    return lines


# ------------------------------------------------------------------ formatting


def _index_list(indexes: list[int]) -> str:
    if not indexes:
        return "none"
    if indexes == list(range(indexes[0], indexes[-1] + 1)) and len(indexes) > 2:
        return f"{indexes[0]}-{indexes[-1]}"
    return ", ".join(str(i) for i in indexes[:10]) + (", ..." if len(indexes) > 10 else "")


def _names(names: set[str]) -> str:
    if not names:
        return "none"
    ordered = sorted(names)
    return ", ".join(ordered[:5]) + (f" and {len(ordered) - 5} more" if len(ordered) > 5 else "")


def _wrap(text: str) -> str:
    return "\n".join(textwrap.wrap(text, WIDTH))


if __name__ == "__main__":
    sys.exit(main())
