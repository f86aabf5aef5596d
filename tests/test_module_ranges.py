"""The module ranges ``add_node_ranges`` writes around the node ranges (``torch_trace._module_ranges``), on small
hand-made traces: one per module call, nested by module path, named and linked as torch's Python tracer does for the
TensorBoard plugin's Module view, and none for a call the trace already holds (a ``with_stack`` trace).

The trace's clock is ``perf_counter_ns`` itself here (one anchor with no offset): a node span ``(name, start ns,
duration ns)`` lands at ``start / 1000`` microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxprof_lightning.timing.node_timing import ANCHOR
from fxprof_lightning.timing.torch_trace import ModuleCalls, add_node_ranges

THREAD = {"pid": 1, "tid": 7}
# A net whose blocks.0 is called twice per forward (``blocks.0@1``), and a node outside every submodule.
STACKS = {"a": ("blocks", "blocks.0"), "b": ("blocks", "blocks.1"), "c": ("blocks", "blocks.0@1"), "d": ()}
TYPES = {"": "Net", "blocks": "Sequential", "blocks.0": "Linear", "blocks.1": "ReLU"}
CALL_STARTS = [10_000, 50_000]  # two forward calls
SPANS = [(name, call + 1_000 * (i + 1), 800) for call in CALL_STARTS for i, name in enumerate("abcd")]


def _module(name: str, begin_ns: int, end_ns: int, python_id: int, parent: int) -> dict:
    """A module call as torch's Python tracer writes it."""
    return {"ph": "X", "cat": "python_function", "name": f"nn.Module: {name}", "ts": begin_ns / 1e3,
            "dur": (end_ns - begin_ns) / 1e3, **THREAD,
            "args": {"Python id": python_id, "Python parent id": parent, "Python module id": 0}}


def _write(tmp_path: Path, extra: list[dict]) -> tuple[Path, int]:
    """A trace with one anchor and ``extra`` events; the node ranges and module ranges written into it, and the count."""
    anchor = {"ph": "X", "cat": "user_annotation", "name": f"{ANCHOR}0", "ts": 1.0, "dur": 0.1, **THREAD}
    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": [anchor, *extra]}))
    written = add_node_ranges(path, [(0, 900, 1_200)], SPANS, modules=ModuleCalls(CALL_STARTS, STACKS, TYPES))
    return path, written


def _modules(path: Path) -> list[dict]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "python_function" and "Python module id" in e["args"]]


def _nest(events: list[dict]) -> None:
    """Every two ranges of the thread are disjoint or one holds the other."""
    spans = sorted(((e["ts"], e["ts"] + e["dur"]) for e in events), key=lambda span: (span[0], -span[1]))
    for i, (begin, end) in enumerate(spans):
        for other_begin, other_end in spans[i + 1:]:
            assert other_begin >= end or other_end <= end, ((begin, end), (other_begin, other_end))


def test_a_range_per_module_call_around_its_nodes(tmp_path):
    path, written = _write(tmp_path, [])
    modules = _modules(path)
    assert written == len(SPANS) + len(modules)
    by_id = {e["args"]["Python id"]: e for e in modules}
    assert len(by_id) == len(modules)

    def tree(event: dict) -> tuple:
        children = [e for e in modules if e["args"].get("Python parent id") == event["args"]["Python id"]]
        return event["name"].removeprefix("nn.Module: "), [tree(c) for c in sorted(children, key=lambda e: e["ts"])]

    roots = sorted((e for e in modules if "Python parent id" not in e["args"]), key=lambda e: e["ts"])
    one_call = ("Net_0", [("Sequential_0", [("Linear_0", []), ("ReLU_0", []), ("Linear_0", [])])])
    assert [tree(root) for root in roots] == [one_call, one_call]
    # From the first node's start to the last one's end: the second call's blocks from a to c, its net from a to d.
    second = {(e["args"]["Module path"], e["ts"]): e for e in modules if e["ts"] >= 50}
    assert second["blocks", 51.0]["dur"] == pytest.approx(2.8) and second["", 51.0]["dur"] == pytest.approx(3.8)
    _nest(modules + [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") in STACKS])


def test_the_module_calls_of_a_with_stack_trace_are_not_written_again(tmp_path):
    # The profiled module's own calls are Python calls (Dynamo runs its submodules inside the graph), with a later
    # Python function's id above theirs; a Linear elsewhere in the model takes Linear_0.
    real = [_module("Net_0", call + 500, call + 5_500, 10 + i, 1) for i, call in enumerate(CALL_STARTS)]
    real += [_module("Linear_0", 90_000, 91_000, 20, 1),
             {"ph": "X", "cat": "python_function", "name": "f", "ts": 95.0, "dur": 1.0, **THREAD,
              "args": {"Python id": 300, "Python parent id": 1}}]
    path, _ = _write(tmp_path, real)
    ours = [e for e in _modules(path) if "Module path" in e["args"]]
    assert sorted({e["name"] for e in ours}) == ["nn.Module: Linear_1", "nn.Module: ReLU_0", "nn.Module: Sequential_0"]
    assert all(e["args"]["Python id"] > 300 for e in ours)
    sequentials = sorted((e for e in ours if e["name"].endswith("Sequential_0")), key=lambda e: e["ts"])
    assert [e["args"]["Python parent id"] for e in sequentials] == [10, 11]


def test_a_trace_holding_every_module_call_gets_none(tmp_path):
    # torch.fx calls each submodule from the graph: every module call is a Python call, inside its node's range.
    real = []
    for i, call in enumerate(CALL_STARTS):
        root = 100 * (i + 1)
        real += [_module("Net_0", call + 500, call + 5_500, root, 1),
                 _module("Sequential_0", call + 900, call + 4_000, root + 1, root)]
        real += [_module(name, call + 1_000 * (j + 1) + 100, call + 1_000 * (j + 1) + 700, root + 2 + j, root + 1)
                 for j, name in enumerate(("Linear_0", "ReLU_0", "Linear_0"))]
    path, written = _write(tmp_path, real)
    assert written == len(SPANS)
    assert len(_modules(path)) == len(real)


def test_under_torch_fx_the_inlined_modules_are_written_around_the_calls_the_trace_holds(tmp_path):
    # torch.fx inlines Sequential and calls its Linear and ReLU from the graph: only they (and Net) are Python calls.
    real = []
    for i, call in enumerate(CALL_STARTS):
        root = 100 * (i + 1)
        real.append(_module("Net_0", call + 500, call + 5_500, root, 1))
        real += [_module(name, call + 1_000 * (j + 1) + 100, call + 1_000 * (j + 1) + 700, root + 2 + j, root + 50)
                 for j, name in enumerate(("Linear_0", "ReLU_0", "Linear_0"))]
    path, _ = _write(tmp_path, real)
    modules = _modules(path)
    sequentials = sorted((e for e in modules if e["name"] == "nn.Module: Sequential_0"), key=lambda e: e["ts"])
    assert [e["args"]["Python parent id"] for e in sequentials] == [100, 200]
    inside = [e for e in modules if e["name"] in ("nn.Module: Linear_0", "nn.Module: ReLU_0")]
    assert len(inside) == 6  # the trace's own, not written again, now children of the Sequential around them
    assert sorted(e["args"]["Python parent id"] for e in inside) == [sequentials[0]["args"]["Python id"]] * 3 + [
        sequentials[1]["args"]["Python id"]] * 3


def test_a_module_called_again_later_gets_a_range_per_call_and_crossing_events_are_taken_in(tmp_path):
    # Dynamo gives both calls of a shared module the same stack when they are in two graphs; and a graph's
    # "Torch-Compiled Region" that began before its module's first node, ending inside the module, is inside the call.
    stacks = {"x": ("act",), "y1": ("body",), "y2": ("body",), "z": ("act",)}
    spans = [("x", 11_000, 800), ("y1", 12_000, 400), ("y2", 12_500, 400), ("z", 13_000, 800)]
    region = {"ph": "X", "cat": "cpu_op", "name": "Torch-Compiled Region: 1/0", "ts": 11.9, "dur": 0.55, **THREAD}
    anchor = {"ph": "X", "cat": "user_annotation", "name": f"{ANCHOR}0", "ts": 1.0, "dur": 0.1, **THREAD}
    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": [anchor, region]}))
    add_node_ranges(path, [(0, 900, 1_200)], spans,
                    modules=ModuleCalls([10_000], stacks, {"": "Net", "act": "ReLU", "body": "Linear"}))
    by_name = {}
    for e in _modules(path):
        by_name.setdefault(e["name"].removeprefix("nn.Module: "), []).append((e["ts"], e["ts"] + e["dur"]))
    assert by_name["ReLU_0"] == [(11.0, 11.8), (13.0, 13.8)]
    assert by_name["Linear_0"] == [(11.9, 12.9)]  # the region is in the body's call
    assert by_name["Net_0"] == [(11.0, 13.8)]
