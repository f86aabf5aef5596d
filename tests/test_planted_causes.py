"""Planted causes with a known answer: the slowdown is flagged and named by the function and line that brings it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import notices
from torch import nn

from fxprof_lightning import CsvSink, Profiler
from fxprof_lightning.analysis import trust

STEP = {"now": 0}  # a step counter the model's helper reads: Dynamo guards on its value, which changes every step
SLOW_FROM = 30


def work(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    repeats = 6 if STEP["now"] >= SLOW_FROM else 1  # the layer's work grows 6x from step 30
    for _ in range(repeats):
        x = torch.tanh(x @ w)
    return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, 512), nn.Linear(512, 4)
        self.w = nn.Parameter(torch.randn(512, 512) / 23)  # the helper's work: ms per call, far above the noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(work(torch.relu(self.inp(x)), self.w))


def train(profiled: bool) -> tuple[Net, Profiler | None]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(256, 64)
    prof = Profiler(model, wait=0, warmup=1, active=3, repeat=12, pictures=False, sinks=[]) if profiled else None
    if prof is not None:
        prof.start()
    for step in range(48):
        STEP["now"] = step
        model(data).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    return model, prof


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 8),
                    reason="torch 2.6: the eagerly run helper's row is flagged after the slowdown too, but it varies "
                           "0.9-6 ms from cycle to cycle before it (not understood), so its 6x is no clear known answer")
@notices("counted no step")
def test_a_helper_that_reads_a_step_counter_is_run_eagerly_and_its_slowdown_named_by_its_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain, _ = train(profiled=False)
    model, prof = train(profiled=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))
    # Dynamo guarded on STEP["now"] at every call: after three captures in a row, ``work`` runs eagerly, between
    # graphs, and the capture goes on (no module hooks timing the model whole).
    last = prof.cycles[-1]
    assert last.capture.method == "dynamo", last.capture.describe()
    assert any(f"work (test_planted_causes.py:{work.__code__.co_firstlineno}) runs eagerly" in r
               for r in last.capture.recaptures)
    line = f"Net.forward (test_planted_causes.py:{Net.forward.__code__.co_firstlineno + 1}): return self.out(work("
    assert any(n.name.startswith(line) for n in last.nodes), [n.name for n in last.nodes]
    def row_ms(cycle) -> float:
        return next(n.mean_ms for n in cycle.nodes if n.name.startswith(line))

    before = [c for c in prof.cycles if c.steps[-1] < SLOW_FROM and c.nodes and not c.distortion]
    after = [c for c in prof.cycles if c.steps[0] > SLOW_FROM and not c.distortion]
    if len(before) < 3 or not after:  # the watch needs 3 sound cycles before; another process left too few
        pytest.skip(f"too few cycles not distorted by other load to judge: {[c.distortion for c in prof.cycles]}")
    assert min(map(row_ms, after)) > 3 * max(map(row_ms, before))  # 6x the work
    # Flagged by that line in the first sound cycles after (a busy machine may leave the next ones distorted)
    flagged = {r.node for c in after[:3] for r in (*c.regressions, *c.unconfirmed)}
    assert any(node.startswith(line) for node in flagged), (flagged, [c.distortion for c in prof.cycles])
    # and it stays flagged while it lasts: the baseline does not take the slower level in
    reported = [any(r.node.startswith(line) for r in c.regressions) for c in after]
    assert True in reported and all(reported[reported.index(True):]), reported
    assert not any(c.regressions for c in before), [(c.index, c.regressions) for c in before]


SLOW = {"on": False}  # a Python flag: from the step it is set, a helper sleeps 30 ms


def maybe_slow(x: torch.Tensor) -> torch.Tensor:
    if SLOW["on"]:
        time.sleep(0.03)  # Dynamo captures again; the sleep breaks its graph: a row of its own, new
    return x


class SlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        x = maybe_slow(x)
        return self.out(x)


def run_slow_net(directory, slow_from: int | None, load_from: int | None = None) -> Profiler:
    """``slow_from``: the step from which the helper sleeps; ``load_from``: the step from which other processes keep
    every core busy (to the end of the run)."""
    torch.manual_seed(0)
    model = SlowNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 64)
    SLOW["on"], load = False, []
    try:
        with Profiler(model, dirpath=directory, wait=0, warmup=1, active=3, repeat=10, pictures=False,
                      sinks=[CsvSink()]) as prof:
            for step in range(40):
                SLOW["on"] = slow_from is not None and step >= slow_from
                if step == load_from:
                    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count())]
                model(data).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                prof.step()
    finally:
        SLOW["on"] = False
        for process in load:
            process.kill()
            process.wait()
    return prof


@notices("counted no step")
def test_load_from_other_processes_is_told_from_work_and_flags_nothing(tmp_path):
    """An identical run whose cores other processes take from step 17 on: the cycles that waited for cores say so
    (this process's threads waited, ``/proc/self/task/*/schedstat``), and nothing is flagged. In a CI run, another
    process made each of two matmuls wait 8 ms a call in every later cycle, the other rows unchanged: four rows were
    "regressions" of an identical run, since no rule read the threads' wait."""
    if trust.threads_waited_ns() is None:
        pytest.skip("this machine does not say how long a thread waited for a core (/proc/self/task/*/schedstat)")
    prof = run_slow_net(tmp_path, slow_from=None, load_from=17)
    assert not any(c.regressions for c in prof.cycles), [(c.index, c.regressions) for c in prof.cycles]
    loaded = [c.distortion for c in prof.cycles if c.steps[0] >= 17]
    assert any(why and "its threads waited for a core" in why for why in loaded), loaded
    # The slowest layers and the step are read from the last cycle not distorted (the load lasts to the end)
    sound = [c.index for c in prof.cycles if not c.distortion]
    out = subprocess.run([sys.executable, "-m", "fxprof_lightning", "report", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert f"slowest layers of cycle {sound[-1]}, ms per call" in out.stdout, (sound, out.stdout)
    assert f"The whole step in cycle {sound[-1]}:" in out.stdout, out.stdout
    compared = subprocess.run([sys.executable, "-m", "fxprof_lightning", "compare", str(tmp_path), str(tmp_path)],
                              capture_output=True, text=True, timeout=120, check=False)  # (so does compare's B)
    assert f"training cycle {sound[-1]} (steps" in compared.stdout, compared.stdout


@notices("counted no step")
def test_a_slowdown_that_arrives_with_new_code_is_compared_and_named(tmp_path):
    """The helper's 30 ms sleep arrives as a row that did not exist (a graph break): the watch and ``compare`` flag it
    as new, by its line, where they said "only in B" and "no node slower beyond the noise"."""
    line = f"SlowNet.forward (test_planted_causes.py:{SlowNet.forward.__code__.co_firstlineno + 2}): x = maybe_slow(x)"
    before = run_slow_net(tmp_path / "a", slow_from=None)
    after = run_slow_net(tmp_path / "b", slow_from=17)  # cycle 4 (steps 17-19) is the first slow one
    assert not any(c.regressions for c in before.cycles), [(c.index, c.regressions) for c in before.cycles]
    sound = [c for c in after.cycles if c.steps[0] > 17 and not c.distortion]
    if len(sound) < 2:
        pytest.skip(f"too few cycles not distorted by other load to judge: {[c.distortion for c in after.cycles]}")
    flagged = {(r.node, r.ratio) for c in sound[:2] for r in (*c.regressions, *c.unconfirmed)}
    assert any(node.startswith(line) and ratio == float("inf") for node, ratio in flagged), flagged
    # B: the last sound cycle (compare takes a run's last cycle, which another process may have distorted: then the
    # step line says so and does not count, as a CI run showed)
    out = subprocess.run([sys.executable, "-m", "fxprof_lightning", "compare", str(tmp_path / "a"),
                          str(tmp_path / "b" / f"cycle_{sound[-1].index:04d}")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1, out.stdout + out.stderr  # a regression found
    new = [row for row in out.stdout.splitlines() if row.startswith("SlowNet.forward (") and "maybe_slow(x)" in row]
    assert new and " new " in new[0] and new[0].endswith("SLOWER"), out.stdout  # (the name shortened in the middle)
    # the step as a whole, and the row that added most to it
    step = " ".join(out.stdout.split("STEP SLOWER: ", 1)[-1].split("\n\n", 1)[0].split())
    assert step.startswith("B's step took") and "most added by SlowNet.forward (" in step, out.stdout
    # the other way round, the row is gone: compared to nothing, faster
    back = subprocess.run([sys.executable, "-m", "fxprof_lightning", "compare", str(tmp_path / "b"),
                           str(tmp_path / "a" / "cycle_0009")], capture_output=True, text=True, timeout=120, check=False)
    gone = [row for row in back.stdout.splitlines() if row.startswith("SlowNet.forward (") and "maybe_slow(x)" in row]
    assert back.returncode == 0 and gone and " gone " in gone[0] and gone[0].endswith("faster"), back.stdout


def run_batches(directory, batch: int) -> Profiler:
    torch.manual_seed(0)
    model = nn.Sequential(*(layer for _ in range(4) for layer in (nn.Linear(256, 256), nn.ReLU())))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(batch, 256)
    with Profiler(model, dirpath=directory, wait=0, warmup=1, active=3, repeat=4, pictures=False,
                  sinks=[CsvSink()]) as prof:
        for _ in range(16):
            model(data).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    return prof


def test_a_slowdown_shared_by_every_row_is_flagged_as_the_step_too(tmp_path):
    """Every layer slower (8x the batch): ``compare`` discounts the change the rows share from each row (the rows that
    grew more than the others stay flagged); the step as a whole is flagged with what it added, and ``compare`` exits 1."""
    runs = [run_batches(tmp_path / "a", 64), run_batches(tmp_path / "b", 512)]
    if any(c.distortion for run in runs for c in run.cycles):
        pytest.skip(f"cycles distorted by other load: {[c.distortion for run in runs for c in run.cycles]}")
    out = subprocess.run([sys.executable, "-m", "fxprof_lightning", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "\nSTEP SLOWER: B's step took " in out.stdout, out.stdout


def test_a_weight_bandwidth_bound_mlp_at_a_tiny_batch_is_told_to_take_a_larger_batch():
    """Eight Linear(1024, 1024) at a batch of 2: 1 FLOP per weight byte read, each layer 12 % of the node time and
    together nearly all of it. Every cycle says a larger batch, in one piece of advice for the layers together (the
    rule asked 20 % of one layer: no advice at all, a hidden check of issue 40)."""
    torch.manual_seed(0)
    layers = [part for _ in range(8) for part in (nn.Linear(1024, 1024), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 1024), torch.randint(0, 10, (2,))
    with Profiler(model, wait=1, warmup=1, active=3, repeat=3, pictures=False, sinks=[]) as prof:
        for _ in range(16):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    assert len(prof.cycles) == 3
    for cycle in prof.cycles:
        assert any("a larger batch" in a for a in cycle.advice[:2]), (cycle.index, cycle.advice)
