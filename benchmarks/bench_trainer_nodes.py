"""What node timing costs per row inside a Trainer's recorded step, against the floor measured in the same process.

    .venv/bin/python benchmarks/bench_trainer_nodes.py --threads 1          # full run, about 3-4 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_trainer_nodes.py --threads 1 --quick  # smoke run (2 rounds, numbers are rough)

Workload: ``bench_overhead``'s MLP-199 (66 x [Linear(64, 64), ReLU, residual add] and a head: 199 rows), batch 32,
SGD, CPU, in real ``lightning.pytorch.Trainer`` fits through ``FXProfilerCallback(module="model")`` with node timing
only (``torch_profiler=False``, ``pictures=False``), ``skip_first=10`` and cycles of ``wait=4, warmup=1, active=5``.
A timing callback first in the list stamps every ``on_train_batch_start``; a step is the period to the next stamp
(the whole loop: Lightning, the loss, backward, the optimizer, every hook). Within one fit, from its third cycle on:
the idle steps are the first three wait steps of each cycle, the recorded ones the three interior recorded steps
(not the cycle's first, nor its last, which closes it). Per fit: (median recorded step - median idle step) / rows,
what a recorded step pays per row where the user pays it (Dynamo's call and guards, the clock reads, the backward
events, the saved bytes, the step's phases, all of it).

Variants, one fit each per round in a shuffled order: the defaults; ``backward_timing=False`` (no backward events);
``memory=False`` (no saved bytes read). The floor, in each round too: ``bench_overhead``'s (the traced graph with one
``perf_counter_ns()`` and one autograd sequence number per node boundary, and a C++ callback for the backward scope
storing sequence numbers and two timestamps per autograd node), steps of the same model outside the Trainer
interleaved with eager ones: the floor per row over eager. Printed: each variant's per-row cost, the floor's and
``defaults - floor`` paired by round (median, distribution-free ~95 % interval). Goal (issue 41): at most 0.5 us.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import (
    ResidualMLP,
    Rounds,
    Variant,
    Workload,
    estimate,
    floor_extension,
    floor_variant,
    judge,
    run_interleaved,
    shuffled,
)
from run_info import closing_lines, cpu_stall_us, package_state, parse_args

from fxprof_lightning import FXProfilerCallback

SKIP, WAIT, WARMUP, ACTIVE = 10, 4, 1, 5
CYCLE = WAIT + WARMUP + ACTIVE
IDLE, RECORDED = (0, 1, 2), (WAIT + WARMUP + 1, WAIT + WARMUP + 2, WAIT + WARMUP + 3)  # positions in a cycle
BATCH = 32
VARIANTS = {"defaults": {}, "backward_timing=False": {"backward_timing": False}, "memory=False": {"memory": False}}
GOAL_US = 0.5


class Lit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ResidualMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Stamps(pl.Callback):
    """Every ``on_train_batch_start``'s ``perf_counter_ns`` (first in the list: a step holds every hook)."""

    def __init__(self) -> None:
        self.ns: list[int] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.ns.append(time.perf_counter_ns())


def per_row_us(options: dict, cycles: int) -> tuple[float, float, float, int]:
    """One fit: (us per row, median idle step ms, median recorded step ms, rows)."""
    torch.manual_seed(0)
    steps = SKIP + cycles * CYCLE
    data = TensorDataset(torch.randn(BATCH * steps, 64), torch.randint(0, 10, (BATCH * steps,)))
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as directory:
        profiler = FXProfilerCallback(module="model", dirpath=directory, skip_first=SKIP, wait=WAIT, warmup=WARMUP,
                                      active=ACTIVE, repeat=0, torch_profiler=False, pictures=False, **options)
        trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[stamps, profiler], accelerator="cpu")
        with contextlib.redirect_stdout(io.StringIO()):  # (the cycles' console lines)
            trainer.fit(Lit(), DataLoader(data, batch_size=BATCH))
    rows = len(profiler.cycles[-1].nodes)
    periods = [(b - a) / 1e3 for a, b in zip(stamps.ns, stamps.ns[1:])]
    idle, recorded = [], []
    for step, us in enumerate(periods):
        if step >= SKIP + 2 * CYCLE:  # (the first cycle holds the capture, the second the first analysis)
            position = (step - SKIP) % CYCLE
            (idle if position in IDLE else recorded if position in RECORDED else []).append(us)
    idle_us, recorded_us = statistics.median(idle), statistics.median(recorded)
    return (recorded_us - idle_us) / rows, idle_us / 1e3, recorded_us / 1e3, rows


def floor_per_row_us(extension: object, steps: int) -> float:
    """The floor's steps against eager ones, interleaved, outside the Trainer: median (floor - eager) / rows, in us."""
    torch.manual_seed(0)
    model = ResidualMLP()
    work = Workload("MLP-199", model, torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,)))
    floor = floor_variant(model, extension)
    times = run_interleaved([Variant("eager", model), floor], work, Rounds(steps, steps, 0), warmup=3)
    rows = sum(1 for node in torch.fx.symbolic_trace(model).graph.nodes if node.op.startswith("call_"))
    return statistics.median((f - e) / 1e3 / rows for f, e in zip(times["floor"], times["eager"], strict=True))


def main() -> None:
    args = parse_args(__doc__)
    rounds, cycles, floor_steps = (2, 4, 20) if args.quick else (24, 20, 60)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    stall, began = cpu_stall_us(), time.perf_counter()
    print(f"{package_state()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds")
    extension, missing = floor_extension()
    if extension is None:
        print(f"no floor: its C++ extension did not build ({missing})")
    costs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    floors: list[float] = []
    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in shuffled(list(VARIANTS), r):
            cost, idle_ms, recorded_ms, rows = per_row_us(VARIANTS[name], cycles)
            costs[name].append(cost)
            steps[name].append((idle_ms, recorded_ms))
        if extension is not None:
            floors.append(floor_per_row_us(extension, floor_steps))
    print(f"\nMLP-199 in a Trainer, node timing only ({rows} rows), us per row added to a recorded step over an idle "
          "one (median over fits, ~95 % interval):")
    for name, values in costs.items():
        idle = statistics.median(i for i, _ in steps[name])
        recorded = statistics.median(s for _, s in steps[name])
        print(f"  {name:<24} {estimate(values, 2, ' us')}   (idle {idle:.2f} ms, recorded {recorded:.2f} ms)")
    if floors:
        print(f"  {'floor (outside Trainer)':<24} {estimate(floors, 2, ' us')}")
        gap = [ours - floor for ours, floor in zip(costs["defaults"], floors, strict=True)]
        print(f"  {'defaults - floor':<24} {estimate(gap, 2, ' us')}   goal <= {GOAL_US} us: {judge(gap, GOAL_US)}")
    print("", *closing_lines(stall, began), sep="\n")


if __name__ == "__main__":
    main()
