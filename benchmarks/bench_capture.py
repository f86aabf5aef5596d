"""What the Dynamo capture costs: capture time (Dynamo + the check against eager), and the per-call cost of its guards.

    .venv/bin/python benchmarks/bench_capture.py [--quick] [--threads N]

Per model: the seconds of the first (capturing) call of ``DynamoTimer`` (Dynamo's trace, the eager and the graph
call compared forward and backward, the call itself) against ``capture()`` of the torch.fx ladder; and the guard
cost per call: a call through Dynamo's cache with the ``eager_on_recompile`` stance, as timed calls run, against the
same captured graph called directly (both uninstrumented, interleaved, no_grad forward; median of paired
differences over the rounds). Models: an MLP of 100 blocks of Linear, LayerNorm and GELU (300 modules) and
torchvision's ResNet18.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from run_info import parse_args

from fxprof_lightning.capture.dynamo import DynamoTimer
from fxprof_lightning.capture.ladder import capture


def mlp300() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU()) for _ in range(100)])


def guard_cost_us(model: nn.Module, x: torch.Tensor, rounds: int) -> tuple[float, float]:
    """(median us per call of the guard check and stance, median us of the graph call itself)."""
    graphs, calls = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            calls.append(args)  # the graph's inputs as Dynamo passes them (parameters, buffers, x)
            return gm.forward(*args)

        return run

    compiled = torch._dynamo.optimize(backend, isolate_recompiles=True)(model.forward)
    with torch.no_grad():
        compiled(x)
        (gm,), args = graphs, calls[0]
        differences, direct = [], []
        for _ in range(rounds):
            start = time.perf_counter_ns()
            gm.forward(*args)
            middle = time.perf_counter_ns()
            with torch.compiler.set_stance("eager_on_recompile"):
                compiled(x)
            end = time.perf_counter_ns()
            calls.clear()
            direct.append(middle - start)
            differences.append((end - middle) - (middle - start))
    return statistics.median(differences) / 1e3, statistics.median(direct) / 1e3


def capture_seconds(model: nn.Module, x: torch.Tensor) -> tuple[float, float, int]:
    """(Dynamo capture call s, torch.fx ladder capture s, Dynamo rows)."""
    timer = DynamoTimer(True)
    timer.install(model)
    model(x).sum().backward()
    timer.uninstall(model)
    model.zero_grad()
    start = time.perf_counter()
    capture(model)
    return timer.capture_s[0], time.perf_counter() - start, len(timer.nodes)


def main() -> None:
    args = parse_args(__doc__)
    rounds = 50 if args.quick else 400
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds")
    print(f"{'model':<12} {'modules':>7} {'rows':>5} {'dynamo capture s':>17} {'fx capture s':>13} "
          f"{'guard us/call':>14} {'graph call us':>14}")
    for name, model, x in [("MLP-300", mlp300(), torch.randn(8, 32)),
                           ("ResNet18", torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 64, 64))]:
        modules = sum(1 for _ in model.modules()) - 1
        dynamo_s, fx_s, rows = capture_seconds(model, x)
        torch._dynamo.reset()
        guard, direct = guard_cost_us(model, x, rounds)
        print(f"{name:<12} {modules:>7} {rows:>5} {dynamo_s:>17.2f} {fx_s:>13.2f} {guard:>14.1f} {direct:>14.1f}")


if __name__ == "__main__":
    main()
