"""What measuring memory costs a recorded step (issue 42), side by side in one process: ``Profiler(memory=True)``
against ``memory=False``.

    .venv/bin/python benchmarks/bench_memory.py --threads 1          # 30 rounds, about 3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_memory.py --threads 1 --quick  # 2 rounds, numbers are rough
    .venv/bin/python benchmarks/bench_memory.py --threads 1 --no-backward-timing  # backward_timing=False in both

Workload: torchvision ResNet18 (10 classes), batch 8 of 3x64x64, SGD with momentum, CPU, a plain loop with
``Profiler(wait=1, warmup=1, active=3, torch_profiler=False, pictures=False, sinks=[])``, 15 steps (three cycles) per
run, the two configurations alternated over rounds in a shuffled order, each run a fresh model (same seed, same data).
Prints the median recorded step of each configuration (``CycleReport.step_ms``, every cycle's), the median over
rounds of the per-round ratio memory/none with the median's distribution-free ~95% interval and the range, and the one-off read per cycle (the walk of the
autograd nodes, timed around ``read_saved_bytes``; it runs in each cycle's warm-up step, not in a recorded one), and
what the cycle's optimizer watch adds to each optimizer step (``hook_cost``).
Issue 42's goal: a recorded step at most 3% dearer with memory measured. With ``--no-backward-timing`` both
configurations time no backward: the forward's autograd sequence ranges are then logged for the saved bytes alone.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import warnings

import torch
import torchvision
from run_info import closing_lines, cpu_stall_us, median_ci, package_state, parse_args

from fxprof_lightning import Profiler
from fxprof_lightning.timing import saved_memory
from fxprof_lightning.timing.state_memory import OptimizerWatch

READS: list[float] = []  # seconds of each read of the saved bytes


def _timed_read(read):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return read(*args, **kwargs)
        finally:
            READS.append(time.perf_counter() - started)

    return timed


def run(memory: bool, steps: int = 15, backward: bool = True) -> list[float]:
    """The recorded steps' wall times (ms) of one run."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 64, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator))
               for _ in range(steps)]
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Profiler(model, wait=1, warmup=1, active=3, dirpath=out, torch_profiler=False, pictures=False, sinks=[],
                      memory=memory, backward_timing=backward) as prof:
            for x, y in batches:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                prof.step()
    assert all((n.saved_bytes is not None) == memory for c in prof.cycles for n in c.nodes)
    return [ms for cycle in prof.cycles for ms in cycle.step_ms]


def hook_cost(steps: int = 20000, rounds: int = 5) -> float:
    """Microseconds that the cycle's optimizer watch (``OptimizerWatch``: torch.optim's global post-step hook) adds to
    an optimizer step: a one-parameter SGD stepped with and without it, alternated, median of the differences."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    parameter.grad = torch.zeros(1)
    optimizer = torch.optim.SGD([parameter], lr=0.0)
    differences = []
    for _ in range(rounds):
        seconds = {}
        for watched in (False, True):
            watch = OptimizerWatch() if watched else None
            started = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            seconds[watched] = time.perf_counter() - started
            if watch is not None:
                watch.close()
        differences.append((seconds[True] - seconds[False]) / steps * 1e6)
    return statistics.median(differences)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda parser: parser.add_argument(
        "--no-backward-timing", action="store_true", help="backward_timing=False in both configurations"))
    backward = not args.no_backward_timing
    rounds = 2 if args.quick else 30
    stall, started = cpu_stall_us(), time.perf_counter()
    print(f"torch {torch.__version__}, {package_state()}")
    saved_memory.read_saved_bytes = _timed_read(saved_memory.read_saved_bytes)
    run(True, backward=backward)  # warms torch and Dynamo up (its numbers are left out)
    READS.clear()
    steps: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    for _ in range(rounds):
        order = [True, False]
        random.shuffle(order)
        medians = {}
        for memory in order:
            times = run(memory, backward=backward)
            steps[memory] += times
            medians[memory] = statistics.median(times)
        ratios.append(medians[True] / medians[False])
    print(f"ResNet18, batch 8, 3x64x64, CPU, {torch.get_num_threads()} thread(s), {rounds} rounds, "
          f"backward_timing={backward}")
    print(f"recorded step, median: memory=False {statistics.median(steps[False]):.2f} ms, "
          f"memory=True {statistics.median(steps[True]):.2f} ms")
    low, high = median_ci(ratios)
    print(f"memory/none per round: median {statistics.median(ratios):.3f} [~95% interval {low:.3f}-{high:.3f}] "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"the read per cycle (in its warm-up step): median {1e3 * statistics.median(READS):.2f} ms over {len(READS)}")
    print(f"the optimizer watch, per optimizer step (in every step of a cycle): {hook_cost():.2f} us")
    print(*closing_lines(stall, started), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
