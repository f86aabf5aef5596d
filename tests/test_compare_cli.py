"""``runs`` and the ``fxprof`` command line (``compare``, ``report``) on directories the real engine wrote."""

from __future__ import annotations

import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from helpers import LitClassifier, SmallNet, image_loader, make_trainer, notices
from torch.nn import functional as F

from fxprof_lightning import CsvSink, FXProfilerCallback, Profiler
from fxprof_lightning.analysis.regressions import Regression
from fxprof_lightning.cli import NAME_WIDTH, main
from fxprof_lightning.outputs.formats import ms_text
from fxprof_lightning.outputs.runs import RunError, find_cycles, load_cycle, load_run
from fxprof_lightning.report import UNOWNED_FORWARD, ModuleStats, NodeStats, last_sound, shorten

SUMMARY = "cycle.jsonl"
TIMES = ("mean_ms", "median_ms", "min_ms", "max_ms", "total_ms", "mad_ms")  # (the spread scales with the node)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A real run: 4 training cycles of 3 recorded steps and one validation cycle, as a Lightning run nests them."""
    root = tmp_path_factory.mktemp("run") / "lightning_logs" / "version_0" / "fxprof"
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with Profiler(model, wait=0, warmup=1, active=3, repeat=4, dirpath=root, torch_profiler=False,
                  profile_validation=True, sinks=[CsvSink()]) as prof:
        for x, y in image_loader(samples=4 * 16):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
            if prof.step_num == 6:
                model.eval()
                with torch.no_grad(), prof.validation():
                    for vx, _ in image_loader(samples=16, seed=1):
                        model(vx)
                        prof.step()
                model.train()
    assert len(prof.cycles) == 4 and len(prof.val_cycles) == 1
    return root, prof


def copy_cycle(source: Path, target: Path, index: int, slower: dict[str, float] | None = None,
               step_ms: float = 10.0, wait_ms: float = 0.0, even_ms: float | None = None) -> Path:
    """``source`` copied to ``target`` as cycle ``index`` of a steady run (steady step times, calls within 2 % of
    their median, its threads waiting ``wait_ms`` a step for a core; with ``even_ms``, every node's median that many
    ms per call forward and backward, whatever load the real cycle had); forward times of the nodes in ``slower``
    scaled."""
    shutil.copytree(source, target)
    summary = json.loads((target / SUMMARY).read_text())
    # (steady: no thread waited for a core, one CPU second per wall second; the real cycle's own figures may say load:
    # on torch 2.6 the first cycle's steps waited 2-100 ms, which the copies' 1 ms steps made a 250 % wait)
    summary.update(index=index, steps=[10 * index + i for i in range(3)], step_ms=[step_ms] * 3, regressions=[],
                   step_wait_ms=[wait_ms] * 3, step_cpu_ms=[step_ms] * 3)
    (target / SUMMARY).write_text(json.dumps(summary) + "\n")
    # Steady by construction, whatever the machine did while the real cycle ran: every call within 2 % of the median,
    # and the totals those calls make (a call the load stretched left a total that hid a planted change as too small
    # a share of the node time: seen once in the suite run under load).
    if even_ms is not None:
        edit_nodes(target / "fx_nodes.csv", None, {f"{side}median_ms": lambda row: even_ms for side in ("", "bwd_")})
    edit_nodes(target / "fx_nodes.csv", None, {
        **{f"{side}{column}": (lambda row, side=side, f=factor: f * float(row[f"{side}median_ms"]))
           for side in ("", "bwd_") for column, factor in (("mad_ms", 0.02), ("min_ms", 0.98), ("max_ms", 1.02),
                                                            ("mean_ms", 1.0))},
        **{f"{side}total_ms": (lambda row, side=side: float(row[f"{side}median_ms"]) * int(row[f"{side}calls"]))
           for side in ("", "bwd_")}})
    for name, factor in (slower or {}).items():
        edit_nodes(target / "fx_nodes.csv", name,
                   {column: lambda row, c=column, f=factor: f * float(row[c]) for column in TIMES})
    return target


def edit_nodes(path: Path, node: str | None, edits: dict[str, Callable[[dict], object]]) -> None:
    """Rewrite cells of ``node``'s row (of every row: None) in an ``fx_nodes.csv``: column -> value from the row."""
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    for row in rows:
        if node is None or row["name"] == node:
            row.update({column: str(edit(row)) for column, edit in edits.items()})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(out.getvalue())


def rows_of(out: str) -> list[list[str]]:
    """The delta table's rows (node, direction, ...); the node's name fills the first column (a row of the step's time
    outside the nodes has spaces in it: ``step: data``)."""
    return [[line[:NAME_WIDTH].strip(), *line[NAME_WIDTH:].split()] for line in out.splitlines()
            if line[NAME_WIDTH:].split()[:1] in (["forward"], ["backward"])]


def slowest(nodes: list[NodeStats]) -> str:
    return max(nodes, key=lambda n: n.median_ms).name


@pytest.fixture
def steady_and_slow(profiled, tmp_path):
    """Two runs of 5 identical cycles (copies of a real one, with its median step); in ``slow`` the last has one node
    3.5x slower, and its steps slower by that node's added time (a real regression); in ``blip`` the same node, steps
    unchanged."""
    _, prof = profiled
    source = prof.cycles[0].directory
    node = slowest(prof.cycles[0].nodes)
    stats = next(n for n in prof.cycles[0].nodes if n.name == node)
    added = 2.5 * stats.median_ms * stats.calls / len(prof.cycles[0].steps)
    step = statistics.median(prof.cycles[0].step_ms)
    for name in ("steady", "slow", "blip"):
        for i in range(5):
            slower = {node: 3.5} if name != "steady" and i == 4 else None
            copy_cycle(source, tmp_path / name / f"cycle_{i:04d}", i, slower, step + added if slower and name == "slow" else step)
    return tmp_path / "steady", tmp_path / "slow", node


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def marks(out: str, nodes_only: bool = True) -> list[str]:
    """The marks of the delta table's rows; ``nodes_only``: of the node rows (not the step's time outside them, which
    in the cycles edited here moves against the edited nodes: their wall times were left as they were)."""
    return [row[-1] for row in rows_of(out) if row[-1] in ("SLOWER", "slower?", "faster")
            and not (nodes_only and row[0].startswith(("step: ", "(")))]


def assert_narrow(text: str) -> None:
    """No line wider than 120 columns, but those naming a path (as long as it is)."""
    assert max(len(line) for line in text.splitlines() if "/" not in line) <= 120


# ------------------------------------------------------------------ runs


def test_load_cycle_gives_back_what_the_engine_reported(profiled):
    _, prof = profiled
    for report in [*prof.cycles, *prof.val_cycles]:
        loaded = load_cycle(report.directory)
        assert [n.name for n in loaded.nodes] == [n.name for n in report.nodes]
        for record_type, ours, theirs in ((NodeStats, loaded.nodes, report.nodes),
                                          (ModuleStats, loaded.modules, report.modules)):
            for a, b in zip(ours, theirs, strict=True):
                for f in fields(record_type):
                    got, expected = getattr(a, f.name), getattr(b, f.name)
                    if isinstance(expected, float):
                        assert got == pytest.approx(expected, abs=1e-6), f.name  # the CSV keeps 6 decimals
                    else:
                        assert got == expected and type(got) is type(expected), f.name
        assert (loaded.index, loaded.stage, loaded.steps, loaded.partial, loaded.ranks) == \
               (report.index, report.stage, report.steps, report.partial, report.ranks)
        assert loaded.step_ms == report.step_ms and loaded.step_cpu_ms == report.step_cpu_ms
        assert loaded.advice == report.advice and loaded.directory == report.directory
        assert loaded.regressions == report.regressions
        assert all(isinstance(r, Regression) for r in loaded.regressions)
        assert loaded.forward_ms_per_step == pytest.approx(report.forward_ms_per_step, abs=1e-5)
    assert load_cycle(prof.val_cycles[0].directory).stage == "val"


def test_load_cycle_without_a_summary_takes_index_and_stage_from_the_name(profiled, tmp_path):
    _, prof = profiled
    for name, index, stage in (("cycle_0007-p1", 7, "train"), ("val_cycle_0012-r2", 12, "val")):
        target = tmp_path / name
        shutil.copytree(prof.cycles[0].directory, target)
        (target / SUMMARY).unlink()
        loaded = load_cycle(target)
        assert (loaded.index, loaded.stage, loaded.steps, loaded.regressions) == (index, stage, [], [])
        root = next(m for m in loaded.modules if m.path == "")
        assert root.total_fwd_ms == pytest.approx(prof.cycles[0].forward_ms_per_step, abs=1e-5)


def test_find_cycles_searches_a_few_levels_down_and_sorts(profiled, tmp_path):
    root, prof = profiled
    expected = [c.directory for c in prof.cycles] + [c.directory for c in prof.val_cycles]
    assert [d.name for d in expected] == ["cycle_0000", "cycle_0001", "cycle_0002", "cycle_0003", "val_cycle_0000"]
    for start in (root, root.parent, root.parent.parent, root.parent.parent.parent):  # fxprof ... its parent's parent
        assert find_cycles(start) == expected
    assert find_cycles(expected[1]) == [expected[1]]
    assert [r.index for r in load_run(root, stage="train")] == [0, 1, 2, 3]
    assert [r.stage for r in load_run(root, stage="val")] == ["val"]

    for name in ("cycle_0010", "cycle_0002-r1", "val_cycle_0000", "cycle_0002-p1", "cycle_0002", ".hidden/cycle_0000"):
        shutil.copytree(expected[0], tmp_path / "run" / name)
    names = [d.name for d in find_cycles(tmp_path / "run")]
    assert names == ["cycle_0002", "cycle_0002-r1", "cycle_0002-p1", "cycle_0010", "val_cycle_0000"]
    shutil.copytree(expected[0], tmp_path / "deep" / "a" / "b" / "c" / "d" / "cycle_0000")
    assert find_cycles(tmp_path / "deep") == []  # 5 levels down
    assert find_cycles(tmp_path / "deep" / "a") != []


def test_what_cannot_be_read_raises_run_error_naming_the_file(profiled, tmp_path):
    _, prof = profiled
    with pytest.raises(RunError, match="no such directory"):
        find_cycles(tmp_path / "missing")
    with pytest.raises(RunError, match=r"no fx_nodes\.csv"):
        load_cycle(tmp_path)
    bad = tmp_path / "cycle_0000"
    shutil.copytree(prof.cycles[0].directory, bad)
    text = (bad / "fx_nodes.csv").read_text().splitlines()
    header = text[0].split(",")
    row = text[1].split(",")
    row[header.index("median_ms")] = "fast"
    (bad / "fx_nodes.csv").write_text("\n".join([text[0], ",".join(row), *text[2:]]) + "\n")
    with pytest.raises(RunError, match=r"fx_nodes.csv, line 2, column median_ms"):
        load_cycle(bad)
    (bad / "fx_nodes.csv").write_text("name,op\nfc,call_module\n")
    with pytest.raises(RunError, match="not a NodeStats table"):
        load_cycle(bad)
    shutil.copy(prof.cycles[0].directory / "fx_nodes.csv", bad / "fx_nodes.csv")
    (bad / SUMMARY).write_text("{not json\n")
    with pytest.raises(RunError, match="not readable as JSON"):
        load_cycle(bad)
    (bad / SUMMARY).write_text(json.dumps({"index": 0, "steps": "1-3"}) + "\n")
    with pytest.raises(RunError, match="steps is '1-3'"):
        load_cycle(bad)


# ------------------------------------------------------------------ fxprof compare


def test_compare_identical_runs_finds_nothing(capsys, steady_and_slow):
    steady, _, _ = steady_and_slow
    status, out, err = run_cli(capsys, "compare", str(steady), str(steady))
    assert status == 0 and err == ""
    assert "A: " in out and "5 training cycles (0-4)" in out and "training cycle 4 (steps 40-42)" in out
    assert marks(out) == [] and "No node of B is slower than A beyond the noise." in out
    assert "forward (nodes)" in out and "backward (nodes)" in out and "step (wall)" in out
    assert_narrow(out)


def test_compare_flags_a_node_made_slower(capsys, steady_and_slow):
    steady, slow, node = steady_and_slow
    status, out, _ = run_cli(capsys, "compare", str(steady), str(slow))
    assert status == 1
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("node"))
    assert lines[header].split() == ["node", "direction", "A", "ms/call", "B", "ms/call", "delta", "ms", "ratio",
                                     "mark"]
    first = lines[header + 1].split()  # flagged rows come first
    assert first[:2] == [node, "forward"] and first[-2:] == ["3.50x", "SLOWER"]
    assert "1 node direction(s) of B slower than A beyond the noise." in out
    assert "SLOWER / faster: beyond the noise" in out
    assert_narrow(out)
    # shown first whatever the size of the other changes
    status, out, _ = run_cli(capsys, "compare", str(steady), str(slow), "--top", "1")
    assert marks(out) == ["SLOWER"]
    # the other way round it is faster, which is no regression
    status, out, _ = run_cli(capsys, "compare", str(slow / "cycle_0004"), str(steady / "cycle_0004"))
    assert status == 0 and marks(out) == ["faster"]


def test_compare_waits_for_the_cycle_before_when_a_node_3_5x_slower_is_2_percent_of_the_step(capsys, profiled,
                                                                                                  tmp_path):
    """As the engine's watch: every call 3.5x slower and the step slower by that, but the node adds 2 % of the step
    (what load did to a tiny node in an identical run): flagged 'slower?', exit 0, until the cycle before says so."""
    _, prof = profiled
    node = slowest(prof.cycles[0].nodes)
    stats = next(n for n in prof.cycles[0].nodes if n.name == node)
    added = 2.5 * stats.median_ms * stats.calls / len(prof.cycles[0].steps)
    step = 50 * added
    for name in ("a", "b"):
        for i in range(5):
            slower = {node: 3.5} if name == "b" and i == 4 else None
            copy_cycle(prof.cycles[0].directory, tmp_path / name / f"cycle_{i:04d}", i, slower,
                       step + added if slower else step)
    status, out, _ = run_cli(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert status == 0 and marks(out)[0] == "slower?", out


def test_compare_leaves_a_slowdown_the_threads_wait_for_a_core_explains_in_question(capsys, profiled, tmp_path):
    """As the engine's watch: every call of a node 3.5x slower, a fifth of the step, beyond doubt; where B's threads
    waited for a core longer by as much (not enough to call the cycle distorted), it is load's doing: 'slower?'."""
    _, prof = profiled
    node = slowest(prof.cycles[0].nodes)
    stats = next(n for n in prof.cycles[0].nodes if n.name == node)
    added = 2.5 * stats.median_ms * stats.calls / len(prof.cycles[0].steps)
    for name, wait in (("a", 0.0), ("quiet", 0.0), ("loaded", 0.9 * added)):
        for i in range(4):
            slower = {node: 3.5} if name != "a" and i == 3 else None
            copy_cycle(prof.cycles[0].directory, tmp_path / name / f"cycle_{i:04d}", i, slower,
                       5 * added + (added if slower else 0.0), wait if slower else 0.0)
    status, out, _ = run_cli(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "quiet"))
    assert status == 1 and marks(out)[0] == "SLOWER", out
    status, out, _ = run_cli(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "loaded"))
    assert status == 0 and marks(out)[0] == "slower?" and "distorted" not in out, out


@pytest.mark.parametrize("added_ms", [0.4, 0.03])
def test_compare_confirms_a_smaller_slowdown_by_the_cycle_before(capsys, profiled, tmp_path, added_ms):
    """A node 1.8x slower in B's last cycle only is flagged 'slower?' (exit 0); slower in B's last two, it is a
    regression (exit 1), if it adds at least 0.1 ms a step (``MIN_ADDED_MS``, as the run's watch): a node that adds
    0.03 ms a step stays 'slower?' (an identical run gave a ReLU's backward 0.006 -> 0.027 ms, two cycles)."""
    _, prof = profiled
    source = prof.cycles[0].directory
    node = slowest(prof.cycles[0].nodes)
    assert {n.calls for n in prof.cycles[0].nodes} == {len(prof.cycles[0].steps)}  # (each node once a step)
    even = added_ms / 0.8  # (every node's ms per call: 1.8x adds 0.8x it a step; a table as even as a quiet run's)
    for i in range(3):
        copy_cycle(source, tmp_path / "a" / f"cycle_{i:04d}", i, even_ms=even)
    for name, slow_from in (("once", 2), ("twice", 1)):
        for i in range(3):
            copy_cycle(source, tmp_path / name / f"cycle_{i:04d}", i, {node: 1.8 if i >= slow_from else 1},
                       even_ms=even)
    status, out, _ = run_cli(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "once"))
    assert status == 0 and marks(out) == ["slower?"] and "No node of B is slower than A beyond the noise." in out
    status, out, _ = run_cli(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "twice"))
    if added_ms >= 0.1:
        assert status == 1 and marks(out) == ["SLOWER"]
    else:
        assert status == 0 and marks(out) == ["slower?"] and "at least 0.1 ms a step" in " ".join(out.split())


def test_compare_cycle_directories_and_choices(capsys, steady_and_slow, profiled):
    steady, slow, _ = steady_and_slow
    status, out, _ = run_cli(capsys, "compare", str(steady / "cycle_0000"), str(slow / "cycle_0004"))
    assert status == 1 and "fewer than 3 cycles" in out
    status, out, _ = run_cli(capsys, "compare", str(steady), str(slow), "--cycle", "2")
    assert status == 0 and "training cycle 2 (steps 20-22)" in out
    status, out, _ = run_cli(capsys, "compare", str(steady), str(slow), "--top", "2")
    assert "smaller change(s) not shown" in out and len(rows_of(out)) == 2
    status, out, _ = run_cli(capsys, "compare", str(steady), str(slow), "--all")
    assert "not shown" not in out
    root, _ = profiled
    status, out, _ = run_cli(capsys, "compare", str(root), str(root), "--stage", "val")
    assert status == 0 and "validation cycle 0" in out
    assert rows_of(out) and all(row[1] == "forward" for row in rows_of(out))  # no backward in validation


def test_compare_real_runs(capsys, profiled):
    root, prof = profiled
    status, out, _ = run_cli(capsys, "compare", str(root), str(root.parent.parent))
    assert status == (1 if "SLOWER" in marks(out) else 0)
    assert "4 training cycles (0-3)" in out and f"B: {last_sound(prof.cycles).directory}" in out  # (as compare picks B)
    assert_narrow(out)


def lightning_run(root: Path, batch_size: int) -> Path:
    """A real Lightning fit at ``batch_size``, three profiled cycles of 3 steps; its cycles' directory."""
    torch.manual_seed(0)
    callback = FXProfilerCallback(wait=0, warmup=1, active=3, repeat=3, module="model", torch_profiler=False,
                                  pictures=False)
    trainer = make_trainer(root, [callback], max_steps=12, logger=False)
    trainer.fit(LitClassifier(), image_loader(samples=12 * batch_size, batch_size=batch_size))
    assert len(callback.cycles) == 3
    run = callback.cycles[0].directory.parent
    for summary in run.glob(f"*/{SUMMARY}"):  # CycleReport.batch_size, where this engine does not record it yet
        entry = json.loads(summary.read_text().splitlines()[-1])
        entry["batch_size"] = entry.get("batch_size") or batch_size
        assert entry["batch_size"] == batch_size
        summary.write_text(json.dumps(entry) + "\n")
    return run


def totals(out: str, title: str) -> dict[str, list[str]]:
    """The rows of the totals table headed ``title`` ("per step", "per sample"): what -> [A, B, delta, ratio]."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title + " "))
    rows = {}
    for line in lines[start + 1:start + 4]:
        name, _, numbers = line.partition(")")
        rows[name + ")"] = numbers.split()
    return rows


@notices("the Trainer has no logger")
def test_compare_runs_of_different_batch_sizes_per_sample(capsys, tmp_path):
    """Batch 8 against batch 16: the per-step totals are ~2x and say nothing about the model; the per-sample totals
    (each cycle's ms per step over its batch size, in us) are printed too, and named the comparable ones."""
    small, large = lightning_run(tmp_path / "b8", 8), lightning_run(tmp_path / "b16", 16)
    a_cycles, now = load_run(small), last_sound(load_run(large))  # (compare's B: a cycle under load is passed over)
    capsys.readouterr()  # what the callback printed while training
    status, out, err = run_cli(capsys, "compare", str(small), str(large))
    assert err == "" and status == (1 if "SLOWER" in marks(out, nodes_only=False) else 0)
    assert f"training cycle {now.index} (steps {now.steps[0]}-{now.steps[-1]}, 16 samples per step)" in out
    step, sample = totals(out, "per step"), totals(out, "per sample")
    assert list(step) == list(sample) == ["forward (nodes)", "backward (nodes)", "step (wall)"]
    expected = {"forward (nodes)": lambda c: c.forward_ms_per_step, "backward (nodes)": lambda c: c.backward_ms_per_step,
                "step (wall)": lambda c: c.step_wall_ms}
    for name, value in expected.items():
        a_us = statistics.median(value(c) / (8 / 1000) for c in a_cycles)  # the CLI's own arithmetic, to the last bit
        b_us = value(now) / (16 / 1000)
        assert sample[name][:2] == [ms_text(a_us), ms_text(b_us)], name
        assert sample[name][3] == f"{b_us / a_us:.2f}x", name
        assert step[name][:2] == [ms_text(statistics.median(value(c) for c in a_cycles)), ms_text(value(now))], name
    assert "A and B ran different batch sizes (A 8, B 16 samples per step)" in out
    assert "do 2x A's work, so the per-sample ratios are the comparable ones" in " ".join(out.split())
    assert_narrow(out)

    # the same batch size, or one not recorded: per step only
    status, out, _ = run_cli(capsys, "compare", str(small), str(small))
    assert "per step " in out and "per sample" not in out and "different batch sizes" not in out
    for summary in large.glob(f"*/{SUMMARY}"):
        entry = json.loads(summary.read_text())
        summary.write_text(json.dumps({k: v for k, v in entry.items() if k != "batch_size"}) + "\n")
    status, out, _ = run_cli(capsys, "compare", str(small), str(large))
    assert "per step " in out and "per sample" not in out and "16 samples per step" not in out


# ------------------------------------------------------------------ fxprof report


def test_report_of_a_real_run(capsys, profiled):
    root, prof = profiled
    status, out, err = run_cli(capsys, "report", str(root))
    assert err == ""
    assert out.startswith(f"Run: {root}\n4 training cycle(s); 1 validation cycle(s) too (--stage val)\n")
    table = out.splitlines()
    header = next(i for i, line in enumerate(table) if line.lstrip().startswith("cycle  steps"))
    assert [line.split()[:2] for line in table[header + 1: header + 5]] == [["0", "1-3"], ["1", "5-7"], ["2", "9-11"],
                                                                          ["3", "13-15"]]
    last = last_sound(prof.cycles)  # (the cycle report reads its slowest layers from: cycle 3 unless load distorted it)
    assert f"Trend of the 6 slowest layers of cycle {last.index}" in out and f"[1] {last.nodes[0].layer}  (node {last.nodes[0].name})" in out
    assert status == (1 if "Regressions, each cycle" in out else 0)
    if last.advice:
        assert f"Advice stored with cycle {last.index}" in out
    words = " ".join(out.split())  # (wrapped to the terminal's width)
    assert last.forward_wall_ms is not None and last.backward_wall_ms is not None
    assert (f"Time no row owns in cycle {last.index}: forward {UNOWNED_FORWARD} {last.unowned()[UNOWNED_FORWARD][0]:.3f} ms (the "
            f"rows: {100 * last.forward_ms_per_step / last.forward_wall_ms:.0f}% of the measured "
            f"{last.forward_wall_ms:.3f} ms); backward ") in words
    assert_narrow(out)
    status, out, _ = run_cli(capsys, "report", str(root), "--stage", "val", "--last", "1", "--layers", "2")
    assert "1 validation cycle(s); 4 training cycle(s) too (--stage train)" in out and "[3]" not in out


def test_report_finds_the_regression_of_a_slower_cycle(capsys, steady_and_slow):
    steady, slow, node = steady_and_slow
    status, out, _ = run_cli(capsys, "report", str(steady))
    assert status == 0 and "No regression beyond the noise in 5 cycle(s)" in out
    status, out, _ = run_cli(capsys, "report", str(slow))
    assert status == 1
    (line,) = [line for line in out.splitlines() if line.startswith("  cycle 4")]
    assert line.split()[2:4] == [node, "forward"] and "3.50x" in line
    (row,) = [line for line in out.splitlines() if line.split()[:2] == ["4", "40-42"]]
    assert row.split()[-1] == "1"  # one regression in the cycles table


def test_report_waits_for_confirmation_of_a_slowdown_the_step_does_not_show(capsys, steady_and_slow):
    """One node 3.5x slower in the last cycle while the step took as long as before: what load delaying some calls
    looks like. Flagged, not confirmed: exit 0, and the report says the next cycle decides."""
    steady, _, node = steady_and_slow
    status, out, _ = run_cli(capsys, "report", str(steady.parent / "blip"))
    assert status == 0 and "No regression beyond the noise" in out
    (line,) = [line for line in out.splitlines() if line.startswith("  cycle 4")]
    assert node in line and "not yet confirmed" in out


def test_report_without_summaries(capsys, steady_and_slow):
    steady, _, _ = steady_and_slow
    for summary in steady.glob(f"*/{SUMMARY}"):
        summary.unlink()
    status, out, _ = run_cli(capsys, "report", str(steady))
    assert status == 0 and "?" in out  # no step numbers; the totals come from the module tree
    assert "Advice" not in out


# ------------------------------------------------------------------ exit status 2


def test_bad_input_exits_2_with_a_message(capsys, tmp_path, steady_and_slow, profiled):
    steady, slow, _ = steady_and_slow
    (tmp_path / "empty").mkdir()
    cases = [
        (["report", str(tmp_path / "missing")], "no such directory"),
        (["report", str(tmp_path / "empty")], "no cycle directory found"),
        (["compare", str(steady), str(tmp_path / "empty")], "B: "),
        (["report", str(steady.parent)], "holds the cycles of 3 runs"),
        (["compare", str(steady), str(slow), "--cycle", "9"], "has no training cycle 9"),
        (["compare", str(steady), str(slow / "cycle_0004"), "--cycle", "1"], "--cycle picks a cycle of a run"),
        (["compare", str(steady), str(slow), "--top", "0"], "--top must be at least 1"),
        (["report", str(steady), "--stage", "val"], "no validation cycle"),
        ([], "the following arguments are required"),
        (["compare", str(steady)], "the following arguments are required"),
        (["frobnicate"], "invalid choice"),
    ]
    for argv, message in cases:
        status, _, err = run_cli(capsys, *argv)
        assert status == 2 and message in err and "Traceback" not in err, argv
    edit_nodes(slow / "cycle_0004" / "fx_nodes.csv", slowest(load_cycle(slow / "cycle_0003").nodes),
               {"calls": lambda row: "many"})
    status, _, err = run_cli(capsys, "compare", str(steady), str(slow))
    assert status == 2 and "fx_nodes.csv, line" in err and "column calls" in err
    (slow / "cycle_0004" / "fx_nodes.csv").write_bytes(bytes(range(256)) * 8)  # binary garbage
    status, _, err = run_cli(capsys, "report", str(slow))
    assert status == 2 and "fx_nodes.csv: not a CSV file" in err and "Traceback" not in err


def test_help_names_the_exit_status():
    result = subprocess.run([sys.executable, "-m", "fxprof_lightning", "--help"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0
    assert "compare" in result.stdout and "report" in result.stdout
    assert "exit status:" in result.stdout and "1  confirmed regressions found" in result.stdout


def test_shorten_cuts_long_names_in_the_middle():
    name = "model.layers.11.self_attn.rotary_emb.inv_freq_expanded_float"
    short = shorten(name, 30)
    assert len(short) == 30 and short.startswith("model.layers.1") and short.endswith("d_float") and "..." in short
    assert shorten("fc", 30) == "fc"
