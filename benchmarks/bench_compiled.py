"""Per-layer times of torch.compile'd models (Inductor, CPU): how much of the step they cover, and what recording costs.

    .venv/bin/python benchmarks/bench_compiled.py --threads 1           # about 3-5 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_compiled.py --threads 1 --quick   # a smoke run

For torchvision's ResNet18 (batch 8, 3x64x64) and a small transformer encoder (2 layers, width
128, 4 heads, sequence 64, batch 8), each compiled twice in this process, once with the settings
the callback makes before a compiled module's first call (``compiled.CompiledKernels``) and once
with Inductor's defaults:

1. Coverage: steps recorded by torch.profiler (CPU), the per-layer times ``KernelTimer`` reads from
   them, summed over rows, over the forward and the backward wall time of the same steps (measured
   around ``model(x)`` and ``loss.backward()``). Goal 0.9-1.1. The rest is Python, Dynamo's guards
   and AOTAutograd's wrappers around the kernels; in backward also the loss's own backward and the
   accumulation of gradients into ``.grad``, so backward is also shown against the compiled graph's
   backward alone (the ``CompiledFunctionBackward`` events).
2. Recorded-step overhead: a step under torch.profiler over a step without it, both of the model
   compiled with the callback's settings, interleaved step by step (paired per round).
3. Idle cost of the settings: a step of the model compiled with them over a step of the model
   compiled without them, no profiler (each C++ kernel checks whether a profiler range is wanted).

Results are medians of per-round paired ratios with a ~95 % confidence interval of the median.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: kineto reads it once (6: not even USDT lines)

import torch
import torchvision
from run_info import closing_lines, cpu_stall_us, package_state, parse_args, quiet_stderr
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity

from fxprof_lightning.capture.compiled import CompiledKernels, KernelTimer


class SmallTransformer(nn.Module):
    def __init__(self, vocab: int = 1000, width: int = 128, heads: int = 4, layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def workloads() -> list[tuple[str, callable, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("ResNet18", lambda: torchvision.models.resnet18(num_classes=10), torch.randn(8, 3, 64, 64, generator=generator),
         torch.randint(0, 10, (8,), generator=generator)),
        ("transformer", SmallTransformer, torch.randint(0, 1000, (8, 64), generator=generator),
         torch.randint(0, 10, (8,), generator=generator)),
    ]


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """One training step (no optimizer): forward and backward wall time in ns."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter_ns()
    out = model(x)
    middle = time.perf_counter_ns()
    F.cross_entropy(out, y).backward()
    return middle - start, time.perf_counter_ns() - middle


def compiled(make: callable, settings: CompiledKernels | None) -> nn.Module:
    """``torch.compile(make())``; with ``settings``, made before its first call (as the callback does). That
    model also gets ``cpp.enable_kernel_profile`` as a compile option: the same setting, and a backend unequal to
    the plain model's, so Dynamo compiles it anew instead of reusing the plain model's graphs (with
    ``inline_inbuilt_nn_modules``, the default, two instances of a class share them)."""
    torch.manual_seed(0)
    if settings is None:
        return torch.compile(make())
    model = torch.compile(make(), options={"cpp.enable_kernel_profile": True})
    settings.start()
    return model


def estimate(values: list[float]) -> str:
    ordered = sorted(values)
    n, half = len(ordered), 0.98 * math.sqrt(len(ordered))
    low, high = ordered[max(math.floor(n / 2 - half), 0)], ordered[min(math.ceil(n / 2 + half), n - 1)]
    return f"{statistics.median(values):.3f} [{low:.3f}-{high:.3f}]"


def measure(name: str, make: callable, x: torch.Tensor, y: torch.Tensor, rounds: int) -> list[str]:
    settings = CompiledKernels()
    torch._dynamo.reset()
    plain = compiled(make, None)
    step(plain, x, y)  # compiles with Inductor's defaults
    profiled = compiled(make, settings)
    step(profiled, x, y)  # compiles with the callback's settings
    settings.stop()
    for _ in range(3):
        step(plain, x, y), step(profiled, x, y)

    coverage_fwd, coverage_bwd, coverage_graph_bwd, recorded, idle = [], [], [], [], []
    for r in range(rounds):
        times = {}
        for variant in random.Random(r).sample(["plain", "settings", "recorded"], 3):
            if variant == "recorded":
                with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
                    fwd, bwd = step(profiled, x, y)
                events = [(e.name(), e.start_ns(), e.duration_ns(), e.start_thread_id(), e.sequence_nr())
                          for e in prof.profiler.kineto_results.events()]
                timer = KernelTimer(settings)
                timer.read(events)
                coverage_fwd.append(sum(map(sum, timer.fwd)) / fwd)
                coverage_bwd.append(sum(map(sum, timer.bwd)) / bwd)
                graph_bwd = sum(duration for event, _, duration, _, _ in events if event == "CompiledFunctionBackward")
                coverage_graph_bwd.append(sum(map(sum, timer.bwd)) / graph_bwd)
                rows = len(timer.nodes)
            else:
                fwd, bwd = step(plain if variant == "plain" else profiled, x, y)
            times[variant] = fwd + bwd
        recorded.append(times["recorded"] / times["settings"])
        idle.append(times["settings"] / times["plain"])
    return [
        f"{name}: {rows} rows, {rounds} rounds, step {statistics.median(times.values()) / 1e6:.1f} ms",
        f"  1. sum of per-layer forward times / forward wall time    {estimate(coverage_fwd)}   goal 0.9-1.1",
        f"     sum of per-layer backward times / backward wall time  {estimate(coverage_bwd)}   goal 0.9-1.1",
        f"     the same / the compiled backward (CompiledFunctionBackward, without the loss's backward and gradient "
        f"accumulation) {estimate(coverage_graph_bwd)}",
        f"  2. recorded step (torch.profiler) / step without it       {estimate(recorded)}",
        f"  3. step compiled with the callback's settings / without   {estimate(idle)}   (idle cost)",
    ]


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    began, stall = time.perf_counter(), cpu_stall_us()
    print("fxprof_lightning: per-layer times of compiled models (Inductor, CPU)")
    print(f"date      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine   {platform.platform()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"versions  python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}")
    print(f"package   {package_state()}")
    for name, make, x, y in workloads():
        with quiet_stderr():  # compile warnings
            lines = measure(name, make, x, y, rounds=5 if args.quick else 40)
        print("\n".join(lines), flush=True)
    print("\n".join(closing_lines(stall, began)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
