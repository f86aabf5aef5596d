"""One cycle, read back from every view a user sees: the console, the Markdown the loggers get, the CSV files,
TensorBoard's scalars, ``fxprof report`` and its HTML page show the same statistic under the same label (issue 40
item 6). Times are means: ms per call over the cycle's calls, ms per step over its recorded steps (the sums the
step is made of); the step is the whole measured step, from the end of the one before. The regression watch alone
compares the median call, and says so."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import torch
from helpers import LitClassifier, image_loader, make_trainer, read_events
from tensorboard.util import tensor_util
from test_html_report import Nested, parse

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.cli import main
from fxprof_lightning.outputs.sinks import TAG_UNSAFE
from fxprof_lightning.report import last_sound

ROWS = 5


def shows(text: str, value: float) -> bool:
    """Whether ``text`` is ``value`` as printed to its own number of decimals."""
    decimals = len(text.partition(".")[2])
    return abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-9


def test_one_cycle_reads_the_same_in_every_view(tmp_path, capsys):
    torch.manual_seed(0)
    callback = FXProfilerCallback(module="model", wait=1, warmup=1, active=4, repeat=2)
    trainer = make_trainer(tmp_path, [callback], max_steps=12)
    trainer.fit(LitClassifier(Nested()), image_loader(samples=12 * 8, batch_size=8))
    printed = capsys.readouterr().out
    run = Path(trainer.log_dir)
    cycle = last_sound(callback.cycles)
    steps = len(cycle.steps)
    rows = cycle.nodes[:ROWS]
    per_call = {n.name: (n.mean_ms, n.bwd_mean_ms) for n in rows}
    per_step = {n.name: (n.total_ms + n.bwd_total_ms) / steps for n in rows}
    step = cycle.step_wall_ms
    # The whole step is not the timed part of it (``step_ms``: from the step's start hook to its end hook), nor its
    # median: a view that showed either would fail below.
    assert cycle.phases and abs(step - sum(cycle.step_ms) / steps) > 0.05, (step, cycle.step_ms)

    # the console: the cycle's line and the end summary's slowest nodes (mean ms per call)
    line = next(t for t in printed.splitlines() if f"cycle {cycle.label}, steps" in t)
    forward, backward = re.search(r"node rows forward ([\d.]+) ms, backward ([\d.]+) ms per step", line).groups()
    assert shows(forward, cycle.forward_ms_per_step) and shows(backward, cycle.backward_ms_per_step), line
    assert shows(re.search(r"measured step ([\d.]+) ms", line)[1], step), line
    summary = printed.split(f"Slowest nodes of cycle {cycle.index} ")[1].splitlines()
    assert "mean ms per call" in summary[0]
    for n, text in zip(rows, summary[1:], strict=False):
        fwd, bwd = re.search(r"forward\s+([\d.]+) .*backward\s+([\d.]+) ", text).groups()
        assert shows(fwd, n.mean_ms) and shows(bwd, n.bwd_mean_ms), (text, n)

    # the Markdown the loggers get (TensorBoard's text), and TensorBoard's scalars at the same step
    events = read_events(run)
    texts = {t.step: tensor_util.make_ndarray(t.tensor_proto).item().decode()
             for t in events.Tensors("fxprof/layers/text_summary")}
    at, markdown = next((s, t) for s, t in texts.items() if t.startswith(f"Cycle {cycle.label}, "))
    assert shows(re.search(r"forward ([\d.]+) ms", markdown)[1], cycle.forward_ms_per_step)
    assert shows(re.search(r"Recorded steps took ([\d.]+) ms \(mean\)", markdown)[1], step)
    assert shows(re.search(r"The whole step: ([\d.]+) ms per step", markdown)[1], step)
    head = next(t for t in markdown.splitlines() if t.startswith("| layer |"))
    assert [c.strip() for c in head.split("|")[3:6]] == ["fwd ms/call", "bwd ms/call", "fwd+bwd ms/step"]
    table = {cells[11].strip().strip("`"): cells for t in markdown.splitlines()
             if len(cells := t.split("|")) > 12 and cells[11].strip().startswith("`")}
    for name in per_call:
        fwd, bwd, both = (table[name][i].strip() for i in (3, 4, 5))
        assert shows(fwd, per_call[name][0]) and shows(bwd, per_call[name][1]) and shows(both, per_step[name])
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert abs(scalars["fxprof/forward_ms_per_step"][at] - cycle.forward_ms_per_step) < 1e-4
    tracked = [n for n in rows if n.name in cycle.tracked]
    assert tracked, cycle.tracked
    for n in tracked:
        tag = TAG_UNSAFE.sub("_", n.name)
        assert abs(scalars[f"fxprof_nodes/{tag}/forward_ms_per_call"][at] - n.mean_ms) < 1e-4, n
        assert abs(scalars[f"fxprof_nodes/{tag}/backward_ms_per_call"][at] - n.bwd_mean_ms) < 1e-4, n

    # one call gives a sink every view it writes (``CycleReport.views``), byte for byte the views one by one
    settings = callback.profiler.settings
    views = cycle.views(settings.top_k, settings.module_depth)
    assert views.markdown == cycle.to_markdown(settings.top_k) == markdown
    assert views.modules_text == cycle.modules_to_text(settings.module_depth) and views.summary == cycle.to_summary()
    assert views.nodes_csv == cycle.to_csv() == (cycle.directory / "fx_nodes.csv").read_text()
    assert views.modules_csv == cycle.modules_to_csv() == (cycle.directory / "fx_modules.csv").read_text()

    # the CSV files of the cycle's directory
    with open(cycle.directory / "fx_nodes.csv", newline="") as f:
        nodes = {r["name"]: r for r in csv.DictReader(f)}
    for name, (fwd, bwd) in per_call.items():
        assert shows(nodes[name]["mean_ms"], fwd) and shows(nodes[name]["bwd_mean_ms"], bwd)
        assert abs((float(nodes[name]["total_ms"]) + float(nodes[name]["bwd_total_ms"])) / steps - per_step[name]) < 1e-5
    with open(cycle.directory / "fx_step.csv", newline="") as f:
        assert abs(sum(float(r["ms_per_step"]) for r in csv.DictReader(f) if r["kind"] == "phase") - step) < 1e-5

    # fxprof report: the cycles table, the trend of the slowest layers, the whole step
    assert main(["report", str(run)]) in (0, 1)
    out = capsys.readouterr().out
    mine = next(t.split() for t in out.splitlines() if re.match(rf"\s+{cycle.index}\s+{cycle.steps[0]}-", t))
    assert shows(mine[2], cycle.forward_ms_per_step) and shows(mine[3], cycle.backward_ms_per_step)
    assert shows(mine[4], step), mine
    assert shows(re.search(rf"The whole step in cycle {cycle.index}: ([\d.]+) ms per step", out)[1], step)
    trend = out.split("Trend of the ")[1]
    assert "(forward + backward, means)" in trend.splitlines()[0]
    cells = next(t.split() for t in trend.splitlines() if t.split()[:1] == [str(cycle.index)])[1:]
    top = cycle.nodes[:len(cells)]
    assert all(shows(cell, n.mean_ms + n.bwd_mean_ms) for cell, n in zip(cells, top, strict=True)), cells

    # the HTML page: the cycles table, the slowest layers, the trend's numbers
    assert main(["report", str(run), "--html", str(tmp_path / "page.html")]) in (0, 1)
    page = parse(tmp_path / "page.html")
    mine = next(r for r in page.tables["cycles"] if r[0] == str(cycle.index))
    assert shows(mine[2], cycle.forward_ms_per_step) and shows(mine[3], cycle.backward_ms_per_step)
    assert shows(mine[4], step)
    for n, r in zip(rows, page.tables["slowest"], strict=False):
        assert r[2] == n.name and shows(r[4], n.mean_ms) and shows(r[5], n.bwd_mean_ms) and shows(r[6], per_step[n.name])
    trend = next(r for r in page.tables["trend-numbers"] if r[0] == str(cycle.index))[1:]
    assert all(shows(cell, n.mean_ms + n.bwd_mean_ms) for cell, n in zip(trend, cycle.nodes, strict=False)), trend
