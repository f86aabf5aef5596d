"""``fxprof report --html``: a run's report as one self-contained HTML page.

The page says what ``fxprof report`` prints, from the same analysis (``cli.check_cycles``: the verdicts of the
engine's ``RegressionWatch``), with pictures: where the whole step went in the last cycle, its slowest layers, its
module tree as an icicle, the step time and the slowest layers over the cycles (distorted cycles shaded), the
regressions, the advice, and links to each cycle's torch.profiler traces (relative to the page: a page written in
the run directory, the default, moves with it). Nothing is fetched: the CSS is inline, the pictures are inline SVG, and the page has no script.

``render`` builds the page from loaded cycles; ``write_page`` writes it. Every string that comes from the run (node
and module names, advice, paths) is escaped with ``html.escape``.
"""

from __future__ import annotations

import html
import math
import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from fxprof_lightning.analysis.regressions import Regression
from fxprof_lightning.analysis.watch import Verdict
from fxprof_lightning.layout import PHASES
from fxprof_lightning.outputs.formats import legend_report, ms_text, per_step, ratio_text, steps_text
from fxprof_lightning.outputs.plots import tree_of
from fxprof_lightning.report import CycleReport, describe_phases, last_sound, shorten

__all__ = ["render", "write_page"]

SLOWEST_ROWS = 20
ICICLE_DEPTH = 4  # levels below the root
CHART_WIDTH = 960
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
           "#64b5cd")
PHASE_COLOURS = dict(zip(PHASES, ("#8172b3", "#4c72b0", "#64b5cd", "#dd8452", "#55a868", "#ccb974", "#c44e52",
                                  "#b0b0b0")))
DISTORTED_FILL = "#fbe3c8"

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #1f2328;
       margin: 0; background: #f4f5f7; }
main { max-width: 1060px; margin: 0 auto; padding: 12px 24px 48px; }
h1 { font-size: 22px; margin: 12px 0 4px; }
h2 { font-size: 17px; margin: 2px 0 10px; }
nav a { margin-right: 14px; }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 12px 18px; margin: 14px 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: 6px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eceef1; text-align: left; vertical-align: top; }
th { font-weight: 600; background: #f7f8fa; }
.num { text-align: right; white-space: nowrap; }
tr.distorted td { background: #fff2e2; }
tr.partial td { color: #777; }
.status { font-weight: 600; }
.bad { color: #b3261e; }
.good { color: #1a7f37; }
.note { color: #666; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace;
       background: #f1f3f5; padding: 0 3px; border-radius: 3px; }
.phasebar { display: flex; height: 30px; border-radius: 4px; overflow: hidden; margin: 6px 0 10px; }
.phasebar span { display: block; height: 100%; overflow: hidden; color: #fff; font-size: 12px; line-height: 30px;
                 text-align: center; white-space: nowrap; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px;
          vertical-align: -1px; }
.share { display: inline-block; height: 10px; border-radius: 2px; vertical-align: -1px; }
.legend span { margin-right: 16px; white-space: nowrap; display: inline-block; }
svg { display: block; max-width: 100%; height: auto; margin: 4px 0; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
ul.advice li { margin: 4px 0; }
details summary { cursor: pointer; color: #555; }
"""


def write_page(path: str | os.PathLike, cycles: Sequence[CycleReport], found: dict[int, Verdict], **kwargs) -> Path:
    """Write ``render(cycles, found, page_dir=path's directory, **kwargs)`` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render(cycles, found, page_dir=path.parent, **kwargs), encoding="utf-8")
    return path


def render(cycles: Sequence[CycleReport], found: dict[int, Verdict], *, run: str | os.PathLike, title: str,
           options: dict, last: int = 20, layers: int = 6, page_dir: str | os.PathLike = ".") -> str:
    """The page for ``cycles`` (one stage of a run, in order) and what ``cli.check_cycles`` found in them (by id).

    ``title`` is the report's second line (how many cycles), ``last`` how many cycles the tables show, ``layers``
    how many of the last cycle's slowest layers the trend follows; trace links are relative to ``page_dir``.
    """
    now = last_sound(cycles)  # (the last cycle not distorted by other load)
    shown = list(cycles[-last:])
    confirmed = sum(len(found[id(c)].regressions) for c in cycles)
    sections = [  # id, link text, heading, content; the first screen: where the step goes, then the slowest layers
        ("step", "Step", f"The whole step in cycle {now.index}", _phases(now)),
        ("slowest", "Slowest layers", f"Slowest layers of cycle {now.index}", _slowest(now)),
        ("cycles", "Cycles", "Cycles", _cycles(shown, found, len(cycles))),
        ("modules", "Module tree", f"Module tree of cycle {now.index}", _icicle(now)),
        ("memory", "Memory", f"Memory of cycle {now.index}", _memory(now)),
        ("trend", "Trend", "Over the cycles", _trend(shown, found, layers)),
        ("regressions", "Regressions", "Regressions", _regressions(cycles, found, options)),
        ("advice", "Advice", f"Advice stored with cycle {now.index}", _advice(now)),
        ("traces", "Traces", "Trace files", _traces(shown, Path(page_dir))),
    ]
    status = (f'<span class="status bad">{confirmed} confirmed regression(s)</span>' if confirmed
              else '<span class="status good">No regression beyond the noise</span>')
    nav = " ".join(f'<a href="#{key}">{link}</a>' for key, link, _, _ in sections)
    body = "\n".join(f'<section id="{key}">\n<h2>{_e(heading)}</h2>\n{content}\n</section>'
                     for key, _, heading, content in sections)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>fxprof report: {_e(Path(run).name or str(run))}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
            f'<h1>fxprof report</h1>\n<p id="run">Run: <code>{_e(str(run))}</code><br>{_e(title)}. {status}.</p>\n'
            f"<nav>{nav}</nav>\n{body}\n</main>\n</body>\n</html>\n")


# ------------------------------------------------------------------ sections


def _phases(cycle: CycleReport) -> str:
    """A bar of the step's phases (ms per step, each as wide as its share) and their table, largest first."""
    if not cycle.phases:
        return (f'<p class="note">No phase times in cycle {cycle.index}: they come from Lightning\'s profiler '
                "actions (the callback), not from a plain loop.</p>")
    total = sum(cycle.phases.values()) or 1.0
    ordered = [p for p in PHASES if p in cycle.phases] + [p for p in cycle.phases if p not in PHASES]
    bar = "".join(f'<span style="width:{100 * cycle.phases[p] / total:.3f}%;background:{_phase_colour(p)}" '
                  f'title="{_e(p)}: {cycle.phases[p]:.2f} ms">{_e(p) if cycle.phases[p] >= 0.08 * total else ""}</span>'
                  for p in ordered if cycle.phases[p] > 0)
    rows = [[f'<span class="swatch" style="background:{_phase_colour(p)}"></span>{_e(p)}',
             f"{ms:.2f}", f"{100 * ms / total:.0f}%"]
            for p, ms in sorted(cycle.phases.items(), key=lambda item: -item[1])]
    return (f"<p>{_e(describe_phases(cycle.phases))}</p>\n"
            f'<div class="phasebar" role="img" aria-label="phases of the step">{bar}</div>\n'
            + _table(["phase", "ms per step", "share"], rows, "phases", numeric=(1, 2)))


def _cycles(shown: list[CycleReport], found: dict[int, Verdict], total: int) -> str:
    """The cycles table of ``fxprof report``; distorted cycles shaded, with the reason; why a cycle out of the
    schedule ran (``CycleReport.trigger``)."""
    rows, classes = [], []
    for c in shown:
        verdict = found[id(c)]
        totals, step, spread = per_step(c), c.step_wall_ms, c.step_spread
        note = verdict.skipped or ""
        if verdict.distortion:
            note = f"distorted: {verdict.distortion}"
        if c.trigger != "schedule":
            note = f"{note}; {c.trigger}" if note else c.trigger
        rows.append([c.label, _e(steps_text(c)), ms_text(totals[0]) if totals else "?",
                     ms_text(totals[1]) if totals else "?", ms_text(step) if step is not None else "",
                     f"{100 * spread:.0f}%" if spread is not None else "",
                     str(len(verdict.regressions)) if verdict.skipped is None else "-", _e(note)])
        classes.append("distorted" if verdict.skipped == "distorted" else "partial" if c.partial else "")
    earlier = (f'<p class="note">The last {len(shown)} cycles; {total - len(shown)} earlier ones are left out '
               f"(--last {total}).</p>\n" if len(shown) < total else "")
    head = ["cycle", "steps", "fwd ms/step", "bwd ms/step", "step ms", "spread", "regressions", "note"]
    return earlier + _table(head, rows, "cycles", numeric=(0, 2, 3, 4, 5, 6), classes=classes)


def _slowest(cycle: CycleReport) -> str:
    """The slowest nodes: per-call means (the console's and the Markdown's numbers; times calls per step, the ms per
    step beside them), ms per step and share of the node time, with a bar."""
    if not cycle.nodes:
        return f'<p class="note">Cycle {cycle.index} timed no node.</p>'
    steps = max(len(cycle.steps), 1)
    grand = sum(n.total_ms + n.bwd_total_ms for n in cycle.nodes) or 1.0
    rows = []
    for rank, n in enumerate(cycle.nodes[:SLOWEST_ROWS], start=1):
        share = 100 * (n.total_ms + n.bwd_total_ms) / grand
        rows.append([str(rank), f"<code>{_e(n.layer or n.name)}</code>", f"<code>{_e(n.name)}</code>",
                     _e(n.op.removeprefix("call_")), ms_text(n.mean_ms),
                     ms_text(n.bwd_mean_ms), ms_text((n.total_ms + n.bwd_total_ms) / steps), f"{share:.1f}%",
                     f'<span class="share" style="width:{1.6 * share:.1f}px;background:{PALETTE[0]}"></span>'])
    head = ["#", "layer", "node", "op", "fwd ms/call", "bwd ms/call", "fwd+bwd ms/step", "share", ""]
    more = len(cycle.nodes) - SLOWEST_ROWS
    tail = (f'<p class="note">{more} faster node(s) not shown (fx_nodes.csv in the cycle directory has every one).'
            "</p>" if more > 0 else "")
    return (f"<p>ms per call are means over the cycle's calls, as in every view but the regressions' (the median call); share: of the cycle's summed node time (forward "
            f"{ms_text(cycle.forward_ms_per_step)} + backward {ms_text(cycle.backward_ms_per_step)} ms per step).</p>\n"
            + _table(head, rows, "slowest", numeric=(0, 4, 5, 6, 7)) + tail)


def _memory(cycle: CycleReport) -> str:
    """The layers that hold the most at the end of the forward (saved for backward, MB per step, with a bar), what
    else the step holds (parameters, gradients, optimizer state) and the checkpointing plan (docs/memory.md)."""
    steps = max(len(cycle.steps), 1)
    held = sorted(((n, n.saved_bytes * n.calls / steps) for n in cycle.nodes if n.saved_bytes is not None),
                  key=lambda item: -item[1])
    total = sum(b for _, b in held)
    if not total:
        why = f" ({cycle.memory_note})" if cycle.memory_note else " (memory=False, validation, or CUDA without the trace)"
        return f'<p class="note">No saved bytes in cycle {cycle.index}{_e(why)}.</p>'
    root = next((m for m in cycle.modules if m.path == ""), None)
    state = [(what, value) for what, value in (("parameters", root and root.param_bytes), ("gradients", root and root.grad_bytes),
                                                ("optimizer state", root and root.optimizer_bytes)) if value is not None]
    rows = [[str(rank), f"<code>{_e(n.layer or n.name)}</code>", f"{b / 1e6:.3f}", f"{100 * b / total:.1f}%",
             f'<span class="share" style="width:{1.6 * 100 * b / total:.1f}px;background:{PALETTE[1]}"></span>',
             "" if n.saved_held_bytes is None else f"{n.saved_held_bytes / 1e6:.3f}"]
            for rank, (n, b) in enumerate(held[:SLOWEST_ROWS], start=1) if b > 0]
    plan = cycle.checkpoint_plan
    return (f"<p>Held at the end of the forward: {total / 1e6:.3f} MB saved for backward per step"
            + "".join(f", {what} {value / 1e6:.3f} MB" for what, value in state) + ".</p>\n"
            + (f"<p>Checkpointing plan: {_e(plan.text())}.</p>\n" if plan is not None else "")
            + _table(["#", "layer", "MB saved/step", "share", "", "MB held once it ran (a forward call)"], rows, "memory",
                     numeric=(0, 2, 3, 5)))


def _icicle(cycle: CycleReport, depth: int = ICICLE_DEPTH) -> str:
    """The module tree as an inline SVG icicle: one row per depth, each module as wide as its forward + backward ms
    per step, its submodules under its span (the space they leave is its own nodes' time)."""
    if not cycle.modules:
        return f'<p class="note">Cycle {cycle.index} has no module tree.</p>'
    width, children, types = tree_of(cycle.modules)
    total = width[""] or 1.0
    rows = min(depth, max(m.depth for m in cycle.modules)) + 1
    row_height = 34
    colours: dict[str, str] = {}
    shapes: list[str] = []

    def draw(path: str, left: float, level: int) -> None:
        type_name = types.get(path, "")
        colour = colours.setdefault(type_name, PALETTE[len(colours) % len(PALETTE)]) if type_name else "#dddddd"
        x, w = left / total * CHART_WIDTH, width[path] / total * CHART_WIDTH
        name = path.rpartition(".")[2] or "(root)"
        tip = f"{path or '(root)'} ({type_name}): {width[path]:.3f} ms per step, forward + backward"
        shapes.append(f'<g class="module" data-path="{_e(path)}"><title>{_e(tip)}</title><rect x="{x:.2f}" '
                      f'y="{level * row_height}" '
                      f'width="{max(w - 1, 0.5):.2f}" height="{row_height - 2}" fill="{colour}" rx="2"/>')
        for label in (f"{name} {width[path]:.3g} ms", name):
            if len(label) * 7 + 8 < w:
                shapes.append(f'<text x="{x + w / 2:.2f}" y="{level * row_height + row_height / 2 + 4}" '
                              f'text-anchor="middle" font-size="12" fill="{"#fff" if type_name else "#333"}">'
                              f"{_e(label)}</text>")
                break
        shapes.append("</g>")
        if level + 1 < rows:
            for child in children.get(path, []):
                draw(child, left, level + 1)
                left += width[child]

    draw("", 0.0, 0)
    svg = (f'<svg id="icicle" viewBox="0 0 {CHART_WIDTH} {rows * row_height}" width="{CHART_WIDTH}" '
           f'height="{rows * row_height}" role="img" aria-label="module tree">{"".join(shapes)}</svg>')
    legend = "".join(f'<span><span class="swatch" style="background:{c}"></span>{_e(t)}</span>'
                     for t, c in colours.items())
    return (f"<p>Forward + backward ms per step, {ms_text(total)} in all; each module as wide as its time, its "
            f"submodules below it (hover for the numbers); {rows - 1} level(s) below the root.</p>\n{svg}\n"
            f'<p class="legend">{legend}</p>')


def _trend(shown: list[CycleReport], found: dict[int, Verdict], layers: int) -> str:
    """Two charts over the cycles: the step (wall) and all nodes, ms per step; the last sound cycle's slowest layers
    (``report.last_sound``), ms per call (forward + backward means, as the tables and ``fxprof report``'s trend). Distorted cycles
    are shaded."""
    labels = [str(c.index) for c in shown]
    distorted = [found[id(c)].skipped == "distorted" for c in shown]
    steps = [("step (wall)", [c.step_wall_ms for c in shown]),
             ("node rows summed, forward + backward", [sum(t) if (t := per_step(c)) else None for c in shown])]
    now = last_sound(shown)
    top = now.nodes[:layers]
    calls = []
    for node in top:
        values = []
        for c in shown:
            n = next((n for n in c.nodes if n.name == node.name), None)
            values.append(n.mean_ms + n.bwd_mean_ms if n is not None else None)
        calls.append((node.layer or node.name, values))
    marked = [f"cycle {c.index}" for c, d in zip(shown, distorted) if d]
    key = (f'<p class="legend"><span><span class="swatch" style="background:{DISTORTED_FILL}"></span>distorted by other '
           f"load, not checked: {_e(', '.join(marked))}</span></p>" if marked else "")
    rows = [[_e(label), *[ms_text(values[j]) if values[j] is not None else "-" for _, values in calls]]
            for j, label in enumerate(labels)]
    numbers = _table(["cycle", *[f"[{i + 1}]" for i in range(len(top))]], rows, "trend-numbers",
                     numeric=range(len(top) + 1))
    names = "".join(f"<li>[{i + 1}] <code>{_e(n.layer or n.name)}</code></li>" for i, n in enumerate(top))
    return (f"<h3>ms per step, cycles {labels[0]}-{labels[-1]}</h3>\n{_line_chart(labels, steps, distorted, 'ms')}\n"
            f"{_legend(steps)}\n<h3>ms per call of the {len(top)} slowest layers of cycle {now.index} "
            f"(forward + backward, means)</h3>\n{_line_chart(labels, calls, distorted, 'ms')}\n{_legend(calls)}\n"
            f"{key}\n<details><summary>the numbers</summary>\n<ol class=\"note\" style=\"list-style:none\">{names}</ol>\n"
            f"{numbers}\n</details>")


def _regressions(cycles: Sequence[CycleReport], found: dict[int, Verdict], options: dict) -> str:
    """Confirmed regressions of every cycle, the last cycle's unconfirmed flags, and how one is decided."""
    confirmed = [(c, r) for c in cycles for r in found[id(c)].regressions]
    pending = [(c, r) for c in cycles[-1:] for r in found[id(c)].unconfirmed]
    parts = []
    if confirmed:
        parts.append("<p>Regressions, each cycle against the sound cycles before it (median ms per call):</p>")
        parts.append(_regression_table(confirmed, "confirmed"))
    else:
        parts.append(f'<p class="good">No regression beyond the noise in {len(cycles)} cycle(s) (each against the '
                     "sound cycles before it).</p>")
    if pending:
        parts.append("<p>Flagged in the last cycle, not yet confirmed (the next cycle confirms them or not):</p>")
        parts.append(_regression_table(pending, "unconfirmed"))
    parts.append(f'<p class="note">{_e(" ".join(legend_report(options)))}</p>')
    return "\n".join(parts)


def _regression_table(entries: list[tuple[CycleReport, Regression]], key: str) -> str:
    rows = [[str(c.index), f"<code>{_e(r.node)}</code>", _e(r.direction), ms_text(r.baseline_ms),
             ms_text(r.now_ms), ratio_text(r.ratio), ms_text(r.noise_ms)] for c, r in entries]
    head = ["cycle", "node", "direction", "before ms", "now ms", "ratio", "noise ms"]
    return _table(head, rows, key, numeric=(0, 3, 4, 5, 6))


def _advice(cycle: CycleReport) -> str:
    if not cycle.advice:
        return f'<p class="note">No advice stored with cycle {cycle.index}.</p>'
    return '<ul class="advice">' + "".join(f"<li>{_code_spans(str(a))}</li>" for a in cycle.advice) + "</ul>"


def _traces(shown: list[CycleReport], page_dir: Path) -> str:
    """Each cycle's torch.profiler trace files, linked relative to the page."""
    rows = []
    for c in shown:
        links = [f'<a href="{_href(p, page_dir)}">{_e(p.name)}</a> <span class="note">({_size(p)})</span>'
                 for p in c.trace_paths]
        rows.append([str(c.index), _e(steps_text(c)), "<br>".join(links) or '<span class="note">none</span>'])
    if not any(c.trace_paths for c in shown):
        return '<p class="note">No trace files in these cycles (the profiler ran with torch_profiler=False).</p>'
    return ("<p>torch.profiler's Chrome traces: open them in Perfetto UI (ui.perfetto.dev), chrome://tracing or "
            "TensorBoard's PyTorch Profiler tab.</p>\n" + _table(["cycle", "steps", "trace files"], rows, "trace-files",
                                                                    numeric=(0,)))


# ------------------------------------------------------------------ charts


def _line_chart(labels: list[str], series: list[tuple[str, list[float | None]]], shaded: list[bool], unit: str,
                height: int = 230) -> str:
    """An inline SVG line chart: one x position per label, a line per series (gaps where a value is None), the
    shaded positions on a light band behind."""
    left, right, top, bottom = 64, 16, 10, 36
    plot_w, plot_h = CHART_WIDTH - left - right, height - top - bottom
    values = [v for _, s in series for v in s if v is not None]
    high = _nice(max(values, default=1.0) * 1.08)
    slot = plot_w / max(len(labels), 1)

    def x(i: int) -> float:
        return left + (i + 0.5) * slot

    def y(v: float) -> float:
        return top + (1 - v / high) * plot_h

    parts = [f'<rect class="distorted" x="{x(i) - slot / 2:.2f}" y="{top}" width="{slot:.2f}" height="{plot_h}" '
             f'fill="{DISTORTED_FILL}"><title>cycle {_e(labels[i])}: distorted by other load</title></rect>'
             + (f'<text x="{x(i):.2f}" y="{top + 13}" text-anchor="middle" font-size="11" fill="#a0622d">distorted'
                "</text>" if slot > 60 else "")
             for i, mark in enumerate(shaded) if mark]
    for k in range(5):
        v = high * k / 4
        parts.append(f'<line x1="{left}" x2="{CHART_WIDTH - right}" y1="{y(v):.2f}" y2="{y(v):.2f}" stroke="#e3e5e8"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.2f}" text-anchor="end" font-size="11" fill="#555">'
                     f"{v:.3g}</text>")
    every = math.ceil(len(labels) / 24)
    parts += [f'<text x="{x(i):.2f}" y="{top + plot_h + 16}" text-anchor="middle" font-size="11" fill="#555">'
              f"{_e(label)}</text>" for i, label in enumerate(labels) if i % every == 0 or i == len(labels) - 1]
    parts.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 4}" text-anchor="middle" font-size="11" '
                 'fill="#555">cycle</text>')
    parts.append(f'<text x="12" y="{top + plot_h / 2:.0f}" font-size="11" fill="#555" '
                 f'transform="rotate(-90 12 {top + plot_h / 2:.0f})" text-anchor="middle">{_e(unit)}</text>')
    for number, (name, points) in enumerate(series):
        colour = PALETTE[number % len(PALETTE)]
        for run in _runs(points):
            coords = " ".join(f"{x(i):.2f},{y(points[i]):.2f}" for i in run)
            parts.append(f'<polyline class="series" points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [f'<circle cx="{x(i):.2f}" cy="{y(v):.2f}" r="3.5" fill="{colour}"><title>{_e(name)}, cycle '
                  f"{_e(labels[i])}: {v:.3f} {_e(unit)}</title></circle>"
                  for i, v in enumerate(points) if v is not None]
    return (f'<svg class="chart" viewBox="0 0 {CHART_WIDTH} {height}" width="{CHART_WIDTH}" height="{height}" '
            f'role="img">{"".join(parts)}</svg>')


def _legend(series: list[tuple[str, list[float | None]]]) -> str:
    return '<p class="legend">' + "".join(
        f'<span><span class="swatch" style="background:{PALETTE[i % len(PALETTE)]}"></span>'
        f"{_e(shorten(name, 60, '…'))}</span>" for i, (name, _) in enumerate(series)) + "</p>"


def _runs(points: list[float | None]) -> list[list[int]]:
    """The indexes of ``points`` in runs without a None (a line has a gap where a cycle lacks the value)."""
    runs: list[list[int]] = [[]]
    for i, v in enumerate(points):
        if v is None:
            runs.append([])
        else:
            runs[-1].append(i)
    return [r for r in runs if r]


def _nice(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x a power of ten at or above ``value`` (a round top for an axis)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= value)


# ------------------------------------------------------------------ small pieces


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _table(head: list[str], rows: list[list[str]], key: str, numeric: Sequence[int] = (),
           classes: Sequence[str] = ()) -> str:
    """A table with id ``key``; cells are HTML already (escaped by the caller), columns ``numeric`` right-aligned,
    row ``i`` of class ``classes[i]`` if given."""

    def cells(tag: str, row: list[str]) -> str:
        return "".join(f'<{tag} class="num">{c}</{tag}>' if i in numeric else f"<{tag}>{c}</{tag}>"
                       for i, c in enumerate(row))

    lines = [f'<table id="{key}">', f"<thead><tr>{cells('th', head)}</tr></thead>", "<tbody>"]
    for i, row in enumerate(rows):
        css = classes[i] if i < len(classes) else ""
        lines.append((f'<tr class="{css}">' if css else "<tr>") + cells("td", row) + "</tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _code_spans(text: str) -> str:
    """``text`` escaped, with its `backtick` spans as <code>."""
    pieces = text.split("`")
    if len(pieces) % 2 == 0:  # an odd backtick: no spans
        return _e(text)
    return "".join(f"<code>{_e(p)}</code>" if i % 2 else _e(p) for i, p in enumerate(pieces))


def _phase_colour(phase: str) -> str:
    return PHASE_COLOURS.get(phase, "#999999")


def _href(path: Path, page_dir: Path) -> str:
    relative = os.path.relpath(Path(path).resolve(), Path(page_dir).resolve())
    return urllib.parse.quote(Path(relative).as_posix())


def _size(path: Path) -> str:
    try:
        size = Path(path).stat().st_size
    except OSError:
        return "missing"
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"
