"""Known answers on real runs: a planted slowdown is found where it is, and a steady run raises no flag.

The plain-loop ``Profiler`` trains a small MLP whose middle block (``Heavy``: its forward branches on a tensor's value,
a graph break) does ``work`` rounds of a 256-wide matmul. Cycles of 4 steps (1 warm-up, 3 recorded); from the
fifth cycle on, one run raises ``work`` from 1 to 12: that block takes ~12x its time and the step several times its
own. The analysis must name that block in that direction, without calling the cycle distorted; the same run without
the change must flag nothing in any cycle.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer, notices, read_events
from torch import nn
from torch.utils.data import DataLoader

from fxprof_lightning import FXProfilerCallback, Profiler
from fxprof_lightning.engine.step_phases import PHASES
from fxprof_lightning.outputs.sinks import cycle_line


class Heavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256) / 16)
        self.work = 1

    def forward(self, x):
        if x.sum() > -1e30:  # data-dependent: Dynamo breaks the graph here
            for _ in range(self.work):
                x = torch.tanh(x @ self.w)
        return x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.heavy, self.out = nn.Linear(32, 256), Heavy(), nn.Linear(256, 4)

    def forward(self, x):
        return self.out(self.heavy(torch.relu(self.inp(x))))


def run(tmp_path, slow_from_step: int | None) -> Profiler:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two intra-op threads on 2 cores, one busy elsewhere, make steps 50x slower at random
    try:
        return _run(tmp_path, slow_from_step)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path, slow_from_step: int | None) -> Profiler:
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 32)
    with Profiler(model, dirpath=tmp_path, wait=0, warmup=1, active=3, repeat=10) as prof:
        for step in range(40):
            if step == slow_from_step:
                model.heavy.work = 12
            model(data).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    assert len(prof.cycles) == 10 and prof.cycles[0].capture.method == "dynamo"
    return prof


@notices("FLOPs not counted")
def test_a_block_that_makes_the_step_slower_is_flagged_not_called_load(tmp_path):
    prof = run(tmp_path, slow_from_step=16)  # cycle 4 is the first slow one
    cycles = prof.cycles
    assert cycles[4].steps == [18, 19]  # step 17 captured Heavy again (``work`` changed): dropped
    before, after = ([statistics.median(c.step_ms) for c in group] for group in (cycles[:4], cycles[4:]))
    assert statistics.median(after) > 2 * statistics.median(before)  # the step got much slower
    # Never called load for the step's jump (a cycle whose steps another process delayed unevenly, or whose process
    # waited for cores, may still be left out: those are load's own signatures).
    assert not any("x the earlier cycles'" in (c.distortion or "") for c in cycles), [c.distortion for c in cycles]
    flagged = {(r.node, r.direction) for c in cycles[4:] for r in c.regressions}
    assert {node for node, _ in flagged} == {"module heavy"}  # that block, in one direction or both, nothing else
    # in every sound cycle while it lasts (its new nodes stay new in the baseline: the module is what is compared)
    assert all(any(r.node == "module heavy" for r in c.regressions) for c in cycles[5:] if not c.distortion), \
        [(c.index, c.regressions, c.distortion) for c in cycles]
    assert all(c.regressions == [] for c in cycles[:4])


@notices("FLOPs not counted")
def test_a_steady_run_flags_nothing(tmp_path):
    prof = run(tmp_path, slow_from_step=None)
    assert [c.regressions for c in prof.cycles] == [[]] * 10


# The whole step -------------------------------------------------------------------------------------------------------

DATA_WAIT_S = 0.25  # far above the model's few ms, also when another process slows the model 10x


class SlowDataset(torch.utils.data.Dataset):
    """Each sample costs the loader 250 ms / batch size (a sleep: what a slow disk or decoding looks like)."""

    def __init__(self, samples: int = 64, batch_size: int = 4) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(samples, 3, 8, 8, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
        self.per_sample = DATA_WAIT_S / batch_size

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.per_sample)
        return self.x[i], self.y[i]


def test_the_whole_step_of_a_dataloader_bound_run(tmp_path):
    """Known answer: the loader waits ~250 ms per batch, the model takes a few ms. The phases add up to the step,
    the data phase holds the wait, and the advice says so first, with no advice about layers."""
    callback = FXProfilerCallback(wait=1, warmup=1, active=3, repeat=1, module="model")
    make_trainer(tmp_path, [callback], max_steps=6).fit(LitClassifier(), DataLoader(SlowDataset(), batch_size=4))
    (cycle,) = callback.cycles
    phases = cycle.phases
    events = read_events(tmp_path / "logs" / "version_0")  # what TensorBoard shows: one series per phase
    assert {f"fxprof_step/{phase}_ms" for phase in PHASES} <= set(events.Tags()["scalars"])
    assert events.Scalars("fxprof_step/data_ms")[0].value == pytest.approx(phases["data"])
    assert set(phases) == set(PHASES)
    total = sum(phases.values())
    assert phases["data"] >= 0.9 * DATA_WAIT_S * 1e3 and phases["data"] / total > 0.5, phases
    assert phases["training_step"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert cycle.advice[0].startswith("The step waits for its next batch") and "num_workers" in cycle.advice[0]
    assert not any("node time" in line for line in cycle.advice)  # node-level advice left out: not what it waits for
    assert "The whole step:" in cycle.to_markdown() and "data" in cycle.to_summary()["phases"]
    assert re.search(r"; measured step [\d.]+ ms: data \d+%", cycle_line(cycle, "FXProfilerCallback"))  # the console line
    out = subprocess.run([sys.executable, "-m", "fxprof_lightning", "report", str(cycle.directory.parent)],
                         capture_output=True, text=True, timeout=120, check=False).stdout
    assert f"The whole step in cycle {cycle.index}:" in out and "data" in out


@notices("the Trainer has no logger")
def test_the_phases_add_up_to_the_steps_wall_time(tmp_path):
    """Each recorded step's window runs from the end of the step before to its own end: the mean of the phases'
    sums equals the mean wall time between the on_train_batch_end calls of those steps (within 10 %: the first
    window starts after the profiler's own hook of the warm-up step)."""
    ends: list[float] = []

    class Ends(pl.Callback):
        def on_train_batch_end(self, *args) -> None:
            ends.append(time.perf_counter())

    callback = FXProfilerCallback(wait=1, warmup=1, active=3, repeat=1, module="model")
    make_trainer(tmp_path, [Ends(), callback], max_steps=6, logger=False).fit(  # Ends before: not our cycle writing
        LitClassifier(), DataLoader(SlowDataset(), batch_size=4))
    (cycle,) = callback.cycles
    walls = [ends[step] - ends[step - 1] for step in cycle.steps]  # steps 2-4
    assert sum(cycle.phases.values()) == pytest.approx(1e3 * statistics.fmean(walls), rel=0.1)
    assert trainer_profiler_untouched(callback)


def trainer_profiler_untouched(callback) -> bool:
    """After fit, the trainer's profiler has its own start/stop again (the clock removed itself)."""
    return callback.profiler.notes.clock is None


# Host syncs ------------------------------------------------------------------------------------------------------------


class Checked(nn.Module):
    """Reads a tensor's value at every call: a host sync on a GPU (and a graph break for Dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x = self.fc(x)
        if x.abs().max().item() > 1e9:  # a sanity check on every batch
            x = x / 2
        return x


class Kept(nn.Module):
    """Branches on a tensor's value and selects rows with a mask (an output size that depends on the values)."""

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 0
        return x + x[x > 0].sum()


class SyncedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Flatten(2))
        self.a, self.b, self.mid, self.head = Checked(), Checked(), Kept(), nn.Linear(16, 4)

    def forward(self, x):
        x = self.stem(x).mean(2)
        return self.head(self.mid(self.b(self.a(x))))


@notices("the Trainer has no logger")
def test_a_host_sync_in_the_forward_is_named_with_its_place_and_what_to_do(tmp_path):
    """Known answer: two blocks of one class call ``.item()`` and another branches on a value and masks: advice names
    those modules, the cause and the line, before any node-level finding; training is unchanged (bitwise)."""
    def fit(callbacks):
        torch.manual_seed(0)
        lit = LitClassifier(SyncedNet())
        make_trainer(tmp_path / str(len(callbacks)), callbacks, max_steps=6, logger=False).fit(lit, image_loader())
        return lit

    callback = FXProfilerCallback(wait=1, warmup=1, active=3, repeat=1, module="model")
    profiled, plain = fit([callback]), fit([])
    assert all(torch.equal(p, q) for p, q in zip(profiled.state_dict().values(), plain.state_dict().values()))
    (cycle,) = callback.cycles
    line = Checked.forward.__code__.co_firstlineno + 2
    assert cycle.capture.host_reads == {
        "a, b": f"reads a tensor's value (`.item()`, `float(t)`, `bool(t)`) at test_diagnosis.py:{line}",
        "mid": f"branches on a tensor's value (`if t ...:`) at test_diagnosis.py:{Kept.forward.__code__.co_firstlineno + 1}",
    }, cycle.capture.host_reads
    assert cycle.advice, cycle.phases
    first = cycle.advice[0]
    assert first.startswith("A host sync in the forward") and "`a, b` reads a tensor's value" in first, cycle.advice
    assert "`mid` branches on a tensor's value" in first and "On this CPU it costs little" in first
    assert sum(advice.startswith("A host sync") for advice in cycle.advice) == 1
