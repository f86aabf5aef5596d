"""The traces FXProfilerCallback writes, read by a real trace parser: HolisticTraceAnalysis (HTA).

One module-scoped fixture trains ``LitClassifier`` through a real Lightning ``Trainer`` with
``FXProfilerCallback(wait=0, warmup=1, active=2, repeat=1, torch_profiler=True)`` (so one cycle:
step 0 warm-up, steps 1 and 2 recorded, one ``rank0.<ns>.pt.trace.json.gz``), node ranges on (the
default). Then:

* HTA's ``TraceAnalysis`` parses the cycle's trace file and finds, inside each recorded
  ``ProfilerStep#N``, a ``user_annotation`` range named after every timed node of the cycle's
  report (the ``record_function`` range ``NodeTimer`` opens around the node, named ``node.name``),
  as many in all as the report counts calls;
* HTA reads the cycle's directory as its trace directory (``TraceAnalysis(trace_dir=...)``, what an
  HTA user types), so nothing else in that directory may look like a trace to it;
* the file is the Chrome trace JSON that Perfetto UI and chrome://tracing open;
* the node ranges, written into the exported trace from the node timestamps (``add_node_ranges``), hold
  their nodes' ops and nest with every event of their thread; the anchors that aligned them are gone;
  each node call also has a ``"<node> backward"`` range around its autograd node events.

Perfetto's own Python trace processor (PyPI ``perfetto``) downloads its ``trace_processor_shell``
binary on first use, which cannot work offline, so Perfetto is checked by the JSON format it reads.
"""

from __future__ import annotations

import gzip
import json
import numbers
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from helpers import LitClassifier, image_loader, make_trainer

from fxprof_lightning import CycleReport, FXProfilerCallback, FxprofWarning

hta_trace_analysis = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is not installed")

# Timed FX nodes of helpers.SmallNet.
SMALLNET_NODES = {"conv", "bn", "relu", "mean", "drop", "head"}
# Trace Event Format phases (Chrome's "Trace Event Format" document), the ones Perfetto's JSON importer knows.
PHASES = set("BEXiIbneSTpFsftPNODCMRcV") | {"(", ")"}


@dataclass
class Trained:
    cycle: CycleReport
    trace: Path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    root = tmp_path_factory.mktemp("trace_reader")
    callback = FXProfilerCallback(wait=0, warmup=1, active=2, repeat=1, torch_profiler=True, module="model")
    with pytest.warns(FxprofWarning, match="the Trainer has no logger"):
        make_trainer(root, [callback], max_steps=4, logger=False).fit(LitClassifier(), image_loader())
    assert len(callback.cycles) == 1
    cycle = callback.cycles[-1]
    assert cycle.steps == [1, 2]
    assert {n.name for n in cycle.nodes} == SMALLNET_NODES
    assert len(cycle.trace_paths) == 1 and cycle.trace_paths[0].name.endswith(".pt.trace.json.gz")
    return Trained(cycle, cycle.trace_paths[0])


def named_events(analysis) -> pd.DataFrame:
    """HTA's events of rank 0 with their names and categories as strings, and where each ends."""
    trace = analysis.t
    assert trace.get_ranks() == [0]
    df = trace.get_trace(0)
    symbols = trace.symbol_table.get_sym_table()
    return df.assign(
        name_s=df["name"].map(lambda i: symbols[i]),
        cat_s=df["cat"].map(lambda i: symbols[i]),
        stop=df["ts"] + df["dur"],  # HTA's own "end" column is not shifted when it aligns the ranks' times
    )


def test_hta_finds_every_node_range_inside_each_profiler_step(trained: Trained) -> None:
    analysis = hta_trace_analysis.TraceAnalysis(
        trace_files={0: str(trained.trace)}, trace_dir=str(trained.trace.parent), include_last_profiler_step=True
    )
    assert [int(s) for s in analysis.get_profiler_steps()] == trained.cycle.steps
    events = named_events(analysis)
    ranges = events[events["cat_s"] == "user_annotation"]
    found: dict[str, int] = dict.fromkeys(SMALLNET_NODES, 0)
    for step in trained.cycle.steps:
        steps = ranges[ranges["name_s"] == f"ProfilerStep#{step}"]
        assert len(steps) == 1, f"ProfilerStep#{step}: {len(steps)} ranges"
        begin, end = int(steps["ts"].iloc[0]), int(steps["stop"].iloc[0])
        inside = ranges[(ranges["ts"] >= begin) & (ranges["stop"] <= end)]
        assert (inside["iteration"] == step).all()  # HTA puts them in the same iteration
        for node in trained.cycle.nodes:
            mine = inside[inside["name_s"] == node.name]
            assert len(mine) >= 1, f"no range {node.name!r} inside ProfilerStep#{step}: {sorted(set(inside['name_s']))}"
            assert (mine["dur"] >= 0).all()
            found[node.name] += len(mine)
    # One range per forward call the report counts, and none outside the recorded steps.
    assert found == {n.name: n.calls for n in trained.cycle.nodes}
    assert {n: int((ranges["name_s"] == n).sum()) for n in SMALLNET_NODES} == found


def test_hta_reads_the_cycle_directory(trained: Trained) -> None:
    """An HTA user points it at the cycle's directory: HTA takes every ``*.json``/``*.gz`` there for a rank's trace."""
    directory = trained.cycle.directory
    taken = sorted(p.name for p in directory.iterdir() if p.name.endswith((".json", ".gz")))
    assert taken == [trained.trace.name], f"HTA would parse each of these as a trace: {taken}"
    analysis = hta_trace_analysis.TraceAnalysis(trace_dir=str(directory), include_last_profiler_step=True)
    assert [int(s) for s in analysis.get_profiler_steps()] == trained.cycle.steps
    events = named_events(analysis)
    assert SMALLNET_NODES <= set(events.loc[events["cat_s"] == "user_annotation", "name_s"])


def test_trace_is_chrome_trace_json_for_perfetto(trained: Trained) -> None:
    document = json.loads(gzip.decompress(trained.trace.read_bytes()))
    assert isinstance(document, dict) and isinstance(document["traceEvents"], list)
    assert document.get("displayTimeUnit", "ms") in ("ms", "ns")
    complete = []
    for event in document["traceEvents"]:
        assert isinstance(event, dict) and event.get("ph") in PHASES, event
        if event["ph"] == "M":  # metadata: process and thread names
            assert isinstance(event["name"], str) and "pid" in event
            continue
        assert isinstance(event["ts"], numbers.Real) and not isinstance(event["ts"], bool), event
        if event["ph"] == "X":
            assert isinstance(event["name"], str) and isinstance(event["dur"], numbers.Real) and event["dur"] >= 0, event
            assert "pid" in event and "tid" in event, event
            complete.append(event)
    names = {(e["cat"], e["name"]) for e in complete if "cat" in e}
    for step in trained.cycle.steps:
        assert ("user_annotation", f"ProfilerStep#{step}") in names
    assert {("user_annotation", n) for n in SMALLNET_NODES} <= names


# Ops that only one SmallNet node runs in a training step, and that node.
OPS_OF_NODES = {"aten::conv2d": "conv", "aten::batch_norm": "bn", "aten::relu": "relu", "aten::mean": "mean",
                "aten::dropout": "drop", "aten::linear": "head"}


def test_node_ranges_hold_their_ops_and_nest(trained: Trained) -> None:
    """The ranges are placed on the profiler's clock by anchors: each node's ops lie inside its range, and no
    range cuts through another event of its thread (Perfetto and the plugin need properly nested slices)."""
    events = [e for e in json.loads(gzip.decompress(trained.trace.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    assert not [e for e in events if e["name"].startswith("fxprof_anchor")]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in SMALLNET_NODES]
    assert len({(e["pid"], e["tid"]) for e in ranges}) == 1  # the thread the forward ran on
    thread = [e for e in events if (e["pid"], e["tid"]) == (ranges[0]["pid"], ranges[0]["tid"]) and e not in ranges]
    for node_range in ranges:
        begin, end = node_range["ts"], node_range["ts"] + node_range["dur"]
        cut = [e["name"] for e in thread if e["ts"] < begin < e["ts"] + e["dur"] < end or begin < e["ts"] < end < e["ts"] + e["dur"]]
        assert not cut, f"{node_range['name']} cuts through {cut}"
    # Backward: one range per node call, around the autograd node events of its sequence numbers.
    backward = [e for e in events if e.get("cat") == "user_annotation" and e["name"].endswith(" backward")]
    assert sorted(e["name"] for e in backward) == sorted(f"{n} backward" for n in SMALLNET_NODES for _ in trained.cycle.steps)
    for node_range in backward:
        begin, end = node_range["ts"], node_range["ts"] + node_range["dur"]
        same = [e for e in events if (e["pid"], e["tid"]) == (node_range["pid"], node_range["tid"]) and e is not node_range]
        cut = [e["name"] for e in same if e["ts"] < begin < e["ts"] + e["dur"] < end or begin < e["ts"] < end < e["ts"] + e["dur"]]
        assert not cut, f"{node_range['name']} cuts through {cut}"
    for op, node in OPS_OF_NODES.items():
        runs = [e for e in thread if e["name"] == op]
        assert len(runs) == len(trained.cycle.steps), op
        holders = [r for r in ranges if r["name"] == node]
        for run in runs:
            assert any(r["ts"] <= run["ts"] and run["ts"] + run["dur"] <= r["ts"] + r["dur"] for r in holders), (op, node)
