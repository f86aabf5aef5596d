"""End to end: the traces FXProfilerCallback writes, as a real TensorBoard shows them.

One module-scoped fixture trains ``LitClassifier`` twice with the callback (under the same
``TensorBoardLogger`` root, so ``logs/version_0`` and ``logs/version_1``):

* version_0: ``skip_first=1, wait=1, warmup=1, active=2, repeat=2`` over 10 steps, default
  torch.profiler settings -> cycles recording steps [3, 4] and [7, 8];
* version_1: the same schedule with ``repeat=1`` and ``profile_memory``, ``with_stack``,
  ``record_shapes`` -> one cycle recording steps [3, 4].

It then starts ``tensorboard --logdir <logger root>`` (the command the callback prints) as a
subprocess with the installed torch-tb-profiler plugin and checks, through the plugin's HTTP
API (``/data/plugin/pytorch_profiler/...``), what a user would see:

* the PyTorch Profiler tab is enabled and every cycle directory is a run that loaded
  (non-empty views: Overview, Operator, Trace, Module; Memory with the memory/stack run);
* each run has worker ``rank0`` and one span (one trace file per cycle);
* the Overview's step table lists exactly the cycle's recorded training steps (warm-up
  steps are discarded by torch.profiler), numbered like the training run;
* the Operator table holds the model's aten operators, once per recorded step;
* the Trace holds one ``user_annotation`` range per FX node of ``SmallNet`` per recorded
  step, inside the ``ProfilerStep#N`` ranges;
* the Module view of every run shows SmallNet's module tree, from the module ranges written around the node
  ranges (the default Dynamo capture inlines the submodules: the Python tracer sees only SmallNet's own call),
  each module call once (the stack run's own SmallNet calls are not doubled);
* the Memory view of the memory/stack run shows CPU memory.

TensorBoard's output goes to a log file that is only used in failure messages.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer

from fxprof_lightning import CycleReport, FXProfilerCallback

PLUGIN = "/data/plugin/pytorch_profiler"
LOAD_DEADLINE_S = 120
# The timed FX nodes of helpers.SmallNet: modules, a functional call and a tensor method.
SMALLNET_NODES = {"conv", "bn", "relu", "mean", "drop", "head"}
SCHEDULE = {"skip_first": 1, "wait": 1, "warmup": 1, "active": 2}
MEMORY_KWARGS = {"profile_memory": True, "with_stack": True, "record_shapes": True}


@dataclass
class Run:
    """One cycle as TensorBoard should list it."""

    name: str  # run name: the cycle directory relative to the logdir
    cycle: CycleReport
    memory: bool  # recorded with MEMORY_KWARGS
    span: str = ""  # filled in from the spans endpoint


@dataclass
class Served:
    base: str  # http://127.0.0.1:PORT
    runs: list[Run]
    log: Path  # TensorBoard's stdout and stderr


# --------------------------------------------------------------------------- HTTP helpers


def get(base: str, path: str, **params: str) -> tuple[int, dict[str, str], bytes]:
    """GET ``base + path?params`` from the local server: status, headers, body (gunzipped)."""
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            status, headers, body = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        status, headers, body = error.code, dict(error.headers), error.read()
    if headers.get("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return status, headers, body


def get_json(base: str, path: str, **params: str):
    status, _, body = get(base, path, **params)
    assert status == 200, f"GET {path} {params} -> HTTP {status}: {body[:500]!r}"
    return json.loads(body)


def profile_params(run: Run) -> dict[str, str]:
    return {"run": run.name, "worker": "rank0", "span": run.span}


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


# --------------------------------------------------------------------------- the fixture


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(root: Path, repeat: int, max_steps: int, profiler_kwargs: dict | None) -> tuple[Path, list[CycleReport]]:
    torch.manual_seed(0)
    cb = FXProfilerCallback(**SCHEDULE, repeat=repeat, module="model", profiler_kwargs=profiler_kwargs)
    trainer = make_trainer(root, [cb], max_steps=max_steps)
    trainer.fit(LitClassifier(), image_loader())
    assert cb.cycles and all(c.trace_paths for c in cb.cycles), f"no traces written: {cb.cycles}"
    return Path(trainer.logger.root_dir), cb.cycles


def wait_for_runs(base: str, expected: set[str], server: subprocess.Popen, log: Path) -> None:
    """Poll ``runs`` until every expected run is listed and the plugin has stopped loading."""
    deadline = time.monotonic() + LOAD_DEADLINE_S
    last = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"TensorBoard exited with {server.returncode}:\n{log_tail(log)}")
        try:
            last = get_json(base, f"{PLUGIN}/runs")
        except (urllib.error.URLError, ConnectionError, AssertionError):
            pass  # not serving yet
        else:
            if expected <= set(last["runs"]) and not last["loading"]:
                return
        time.sleep(0.5)
    pytest.fail(f"runs {sorted(expected)} not loaded after {LOAD_DEADLINE_S} s; last answer {last}\n{log_tail(log)}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tb_plugin")
    logdir, plain = train(root, repeat=2, max_steps=10, profiler_kwargs=None)
    logdir_again, memory = train(root, repeat=1, max_steps=6, profiler_kwargs=MEMORY_KWARGS)
    assert logdir == logdir_again
    runs = [Run(c.directory.relative_to(logdir).as_posix(), c, False) for c in plain]
    runs += [Run(c.directory.relative_to(logdir).as_posix(), c, True) for c in memory]

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = root / "tensorboard.log"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--load_fast=false"]
    with open(log, "wb") as out:
        # Own process group: the plugin parses traces in child processes; teardown ends them all.
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_runs(base, {r.name for r in runs}, server, log)
        for run in runs:
            # A run whose trace files all failed to parse is still listed, with no views and no spans.
            views = get_json(base, f"{PLUGIN}/views", run=run.name)
            assert views, f"{run.name}: no views, the plugin could not parse its trace\n{log_tail(log)}"
            spans = get_json(base, f"{PLUGIN}/spans", run=run.name, worker="rank0")
            assert spans is not None and len(spans) == 1, f"{run.name}: one trace file per cycle, spans {spans}"
            run.span = spans[0]
        yield Served(base, runs, log)
    finally:
        stop(server)


def stop(server: subprocess.Popen) -> None:
    """End TensorBoard and whatever is left of its process group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(server.pid, sig)
        try:
            server.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------- the checks


def test_the_schedule_recorded_the_expected_cycles(served: Served):
    steps = {r.name: r.cycle.steps for r in served.runs}
    assert steps == {
        "version_0/fxprof/cycle_0000": [3, 4],
        "version_0/fxprof/cycle_0001": [7, 8],
        "version_1/fxprof/cycle_0000": [3, 4],
    }


def test_every_cycle_is_a_loaded_run_with_its_views(served: Served):
    listing = get_json(served.base, "/data/plugins_listing")
    assert listing["pytorch_profiler"]["enabled"], listing["pytorch_profiler"]

    listed = get_json(served.base, f"{PLUGIN}/runs")
    assert listed["loading"] is False
    assert sorted(listed["runs"]) == sorted(r.name for r in served.runs)

    for run in served.runs:
        views = get_json(served.base, f"{PLUGIN}/views", run=run.name)
        assert views, f"{run.name}: no views, the plugin could not parse its trace\n{log_tail(served.log)}"
        assert {"Overview", "Operator", "Trace", "Module"} <= set(views), (run.name, views)
        if run.memory:
            assert "Memory" in views, (run.name, views)
        else:
            assert "Memory" not in views, (run.name, views)  # profile_memory is off by default

        assert get_json(served.base, f"{PLUGIN}/workers", run=run.name, view="Overview") == ["rank0"]


def test_overview_steps_are_the_recorded_training_steps(served: Served):
    for run in served.runs:
        overview = get_json(served.base, f"{PLUGIN}/overview", **profile_params(run))
        shown = [row[0] for row in overview["steps"]["rows"]]
        assert shown == [str(s) for s in run.cycle.steps], (run.name, shown)
        assert overview["performance"][0]["name"] == "Average Step Time"
        assert overview["performance"][0]["value"] > 0, overview["performance"]


def test_operator_table_has_the_model_operators(served: Served):
    for run in served.runs:
        table = get_json(served.base, f"{PLUGIN}/operation/table", group_by="Operation", **profile_params(run))
        calls = {row["name"]: row["calls"] for row in table["data"]}
        for op in ("aten::conv2d", "aten::batch_norm", "aten::linear", "aten::convolution_backward"):
            # One forward and backward per recorded step; warm-up steps are not counted.
            assert calls.get(op) == len(run.cycle.steps), (run.name, op, calls.get(op))


def test_trace_has_one_range_per_fx_node_and_step(served: Served):
    for run in served.runs:
        status, headers, body = get(served.base, f"{PLUGIN}/trace", **profile_params(run))
        assert status == 200, (run.name, status, body[:500])
        assert headers.get("Content-Encoding") == "gzip", headers
        events = [e for e in json.loads(body)["traceEvents"] if e.get("cat") == "user_annotation"]

        steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")}
        assert sorted(steps) == [f"ProfilerStep#{s}" for s in run.cycle.steps], (run.name, sorted(steps))

        node_ranges = [e for e in events if e["name"] in SMALLNET_NODES]
        assert {n.name for n in run.cycle.nodes} == SMALLNET_NODES
        for name in SMALLNET_NODES:
            count = sum(e["name"] == name for e in node_ranges)
            assert count == len(run.cycle.steps), (run.name, name, count)
        for e in node_ranges:
            assert any(start <= e["ts"] <= e["ts"] + e["dur"] <= end for start, end in steps.values()), (
                f"{run.name}: range {e['name']} at {e['ts']} is outside every ProfilerStep range"
            )


def test_module_view_shows_the_module_tree(served: Served):
    for run in served.runs:
        module = get_json(served.base, f"{PLUGIN}/module", **profile_params(run))
        (root,) = module["data"]
        assert root["name"] == "SmallNet_0", (run.name, root["name"])
        children = {child["name"]: child for child in root["children"]}
        assert set(children) == {"Conv2d_0", "BatchNorm2d_0", "Dropout_0", "Linear_0"}, (run.name, set(children))
        for stats in (root, *children.values()):  # one call per recorded step: none written twice
            assert stats["occurences"] == len(run.cycle.steps), (run.name, stats["name"], stats["occurences"])
            assert stats["operators"] > 0 and stats["host_duration"] > 0, (run.name, stats)
        # Host time in microseconds: a module's calls hold their children's, and the conv's its aten::conv2d.
        assert root["host_duration"] >= sum(child["host_duration"] for child in children.values()), (run.name, root)
        conv_ms = next(n.mean_ms for n in run.cycle.nodes if n.name == "conv")
        assert children["Conv2d_0"]["avg_duration"] >= 0.9 * conv_ms * 1e3, (run.name, children["Conv2d_0"], conv_ms)


def test_memory_view_of_the_memory_run(served: Served):
    for run in (r for r in served.runs if r.memory):
        memory = get_json(served.base, f"{PLUGIN}/memory", **profile_params(run))
        assert memory["metadata"]["default_device"] == "CPU"
        operators = {row[0] for row in memory["rows"]["CPU"]}
        assert {"aten::convolution", "aten::batch_norm"} <= operators, sorted(operators)
