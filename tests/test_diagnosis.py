"""Known answers on real runs: a planted slowdown is found where it is, and a steady run raises no flag.

The plain-loop ``Profiler`` trains a small MLP whose middle block (``Heavy``, a torch.fx leaf: its forward branches on
a tensor's value) does ``work`` rounds of a 256-wide matmul. Cycles of 4 steps (1 warm-up, 3 recorded); from the
fifth cycle on, one run raises ``work`` from 1 to 12: that block takes ~12x its time and the step several times its
own. The analysis must name that block in that direction, without calling the cycle distorted; the same run without
the change must flag nothing in any cycle.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from fxprof_lightning import Profiler


class Heavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256) / 16)
        self.work = 1

    def forward(self, x):
        if x.sum() > -1e30:  # data-dependent: torch.fx keeps this module whole (a leaf)
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
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 32)
    with Profiler(model, dirpath=tmp_path, wait=0, warmup=1, active=3, repeat=7, capture="fx") as prof:
        for step in range(28):
            if step == slow_from_step:
                model.heavy.work = 12
            model(data).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    assert len(prof.cycles) == 7 and prof.cycles[0].capture.leaves == {"heavy": prof.cycles[0].capture.leaves["heavy"]}
    return prof


def test_a_block_that_makes_the_step_slower_is_flagged_not_called_load(tmp_path):
    prof = run(tmp_path, slow_from_step=16)  # cycle 4 is the first slow one
    cycles = prof.cycles
    assert cycles[4].steps == [17, 18, 19]
    assert statistics.median(cycles[5].step_ms) > 2 * max(statistics.median(c.step_ms) for c in cycles[:4])
    # Never called load for the step's jump (a cycle whose steps another process delayed unevenly may still be
    # left out for its spread: that is load's signature within a cycle).
    assert not any("earlier cycles" in (c.distortion or "") for c in cycles), [c.distortion for c in cycles]
    flagged = {(r.node, r.direction) for c in cycles[4:] for r in c.regressions}
    assert ("heavy", "forward") in flagged
    assert {node for node, _ in flagged} == {"heavy"}  # nothing else
    assert all(c.regressions == [] for c in cycles[:4])


def test_a_steady_run_flags_nothing(tmp_path):
    prof = run(tmp_path, slow_from_step=None)
    assert [c.regressions for c in prof.cycles] == [[]] * 7
