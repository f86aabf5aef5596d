"""What the Dynamo capture costs: capture time (Dynamo + the check against eager), and the per-call cost of its guards.

    .venv/bin/python benchmarks/bench_capture.py [--quick] [--threads N]

Per model: the seconds of the first (capturing) call of ``DynamoTimer`` (Dynamo's trace, the eager and the graph
call compared forward and backward, the call itself); then, no_grad
and with grad, what a timed call adds to the graph it runs (``guard_cost_us``: measured inside each call, at several
Python stack depths), with the guard check and the stance alone, and ``DynamoTimer``'s own check of the guards before
each timed call (``entry``, ``entry_check_us``). Then, side by side in one process (calls alternated), what
``DynamoTimer``'s timed call adds around its rows (``timer_call_us``: the call's wall time less its rows' forward
times) when the capture is one graph of the forward's own frame: ``one``, the guards asked once (``EntryGuards.fitting``)
and the code Dynamo made for that state run directly; ``two``, ``EntryGuards`` asked and then the call through Dynamo,
which asks them again (as every call did before, and as a capture with graph breaks still does). Models: an MLP of 100 blocks of Linear, LayerNorm
and GELU (300 modules) and torchvision's ResNet18.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torchvision
from torch import nn
from torch._dynamo import external_utils

sys.path.insert(0, str(Path(__file__).parent))
from run_info import parse_args

from fxprof_lightning.capture.dynamo import DynamoTimer
from fxprof_lightning.capture.dynamo_ways import GUARD_SETTINGS

T = TypeVar("T")

# Python stack depths the guard cost is measured at (``guard_cost_us``).
DEPTHS = (0, 13, 29, 47, 71, 97, 131, 173)


def mlp300() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU()) for _ in range(100)])


def _at_depth(depth: int, call: Callable[[], T]) -> T:
    """``call()`` under ``depth`` extra Python frames."""
    return call() if depth <= 0 else _at_depth(depth - 1, call)


def guard_cost_us(model: nn.Module, x: torch.Tensor, rounds: int, grad: bool) -> dict[str, float]:
    """What a timed call adds to the captured graph it runs, in median us per call, and its parts.

    ``added``: a call through Dynamo's cache with the ``eager_on_recompile`` stance (as ``DynamoTimer`` runs timed
    calls, captured with its ``GUARD_SETTINGS``) less the graph's own time, read by the backend inside the same call:
    Dynamo's guards, the transformed bytecode that gathers the parameters and buffers as graph inputs, the stance.
    Each round calls at several Python stack depths (``DEPTHS``): CPython 3.11 allocates frames in 16 KiB chunks and
    frees a chunk as soon as the frame at its start returns, so at an unlucky depth every Python call inside the graph
    maps and unmaps a fresh chunk (about 20 us each: ``F.layer_norm`` 100 times makes MLP-300's graph 2x slower). The
    in-call difference keeps that out of ``added``; ``worst``: the median at the worst depth.
    ``guard``: the guard manager's ``check`` alone, on the call's frame locals. ``stance``: entering and leaving the
    stance alone. ``graph``: the graph's own time inside the call.
    """
    inner: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        def run(*args: object) -> object:
            start = time.perf_counter_ns()
            out = gm.forward(*args)
            inner.append(time.perf_counter_ns() - start)
            return out

        return run

    compiled = torch._dynamo.optimize(backend, isolate_recompiles=True)(model.forward)
    mode = contextlib.nullcontext() if grad else torch.no_grad()
    with torch._dynamo.config.patch(GUARD_SETTINGS), mode:
        compiled(x)
    region = compiled._isolate_recompiles_id
    entries = torch._dynamo.eval_frame._get_cache_entries_for_region(type(model).forward, region)
    if entries:  # the module's own forward is the frame Dynamo compiled
        code = type(model).forward.__code__
        frame_locals = dict(zip(code.co_varnames[:code.co_argcount], (model, x)))
    else:  # a torch.nn module's forward (Sequential): Dynamo compiled its wrapper frame ``wrap_inline``
        entries = torch._dynamo.eval_frame._get_cache_entries_for_region(external_utils.wrap_inline(len), region)
        frame_locals = {"args": (x,), "kwargs": {}, "fn": model.forward}
    (entry,) = entries

    def call() -> tuple[int, int]:
        before = len(inner)
        start = time.perf_counter_ns()
        with torch.compiler.set_stance("eager_on_recompile"):
            out = compiled(x)
        end = time.perf_counter_ns()
        del out  # freed after the clock read (with grad, freeing the autograd graph is no cost of the call)
        if len(inner) != before + 1:
            raise RuntimeError("the call missed the guards: it did not run the captured graph")
        return end - start - inner[-1], inner[-1]

    added: dict[int, list[int]] = {depth: [] for depth in DEPTHS}
    graph, guard, stance = [], [], []
    with mode:
        if not entry.guard_manager.check(frame_locals):
            raise RuntimeError("the guard check fails on the call's frame locals")
        for _ in range(rounds):
            for depth in DEPTHS:
                over, own = _at_depth(depth, call)
                added[depth].append(over)
                graph.append(own)
            for _ in range(len(DEPTHS)):
                start = time.perf_counter_ns()
                entry.guard_manager.check(frame_locals)
                middle = time.perf_counter_ns()
                with torch.compiler.set_stance("eager_on_recompile"):
                    pass
                end = time.perf_counter_ns()
                guard.append(middle - start)
                stance.append(end - middle)
    inner.clear()
    torch._dynamo.reset()

    def us(values: list[int]) -> float:
        return statistics.median(values) / 1e3

    return {"added": us([v for values in added.values() for v in values]),
            "worst": max(us(values) for values in added.values()),
            "guard": us(guard), "stance": us(stance), "graph": us(graph)}


def capture_seconds(model: nn.Module, x: torch.Tensor) -> tuple[float, int]:
    """(Dynamo capture call s, Dynamo rows)."""
    timer = DynamoTimer(True)
    timer.install(model)
    model(x).sum().backward()
    timer.uninstall(model)
    model.zero_grad()
    return timer.capture_s[0], len(timer.samples.nodes)


def entry_check_us(model: nn.Module, x: torch.Tensor, grad: bool, calls: int = 400) -> float:
    """Median us of ``DynamoTimer``'s own guard check before a timed call (``_EntryGuards.check``: which captured
    state the call is in, so that a call in a new state is captured on that call), on a call that fits."""
    timer = DynamoTimer(model.training, backward=False)
    timer.install(model)
    try:
        with torch.set_grad_enabled(grad):
            model(x)  # captured
            samples = []
            for _ in range(calls):
                start = time.perf_counter_ns()
                timer._entry.check((x,), {})
                samples.append(time.perf_counter_ns() - start)
    finally:
        timer.uninstall(model)
    return statistics.median(samples) / 1e3


def timer_call_us(model: nn.Module, x: torch.Tensor, grad: bool, calls: int) -> dict[str, float]:
    """What ``DynamoTimer``'s timed call adds around its rows (its wall time less the rows' forward times), median us
    per call, the guards asked once and Dynamo's code run directly (``one``) and ``EntryGuards`` then Dynamo
    (``two``), alternated call by call; ``saved``: the median of the paired differences."""
    timer = DynamoTimer(model.training, backward=False)
    timer.install(model)
    walls: list[tuple[bool, int]] = []
    try:
        with torch.set_grad_enabled(grad):
            model(x)  # captured
            if not timer._one_frame:
                raise RuntimeError("the capture is not one graph of the forward's own frame")
            timer.reset()
            for i in range(calls):
                for one in ((True, False) if i % 2 else (False, True)):
                    timer._one_frame = one
                    start = time.perf_counter_ns()
                    out = model(x)
                    walls.append((one, time.perf_counter_ns() - start))
                    del out
        fwd = timer.samples.fwd
    finally:
        timer.uninstall(model)
    rows = [samples for samples in fwd if len(samples) == len(walls)]
    added = [(one, wall - sum(samples[k] for samples in rows)) for k, (one, wall) in enumerate(walls)]
    ones = [ns for one, ns in added if one]
    twos = [ns for one, ns in added if not one]
    return {"one": statistics.median(ones) / 1e3, "two": statistics.median(twos) / 1e3,
            "saved": statistics.median(b - a for a, b in zip(ones, twos, strict=True)) / 1e3}


def main() -> None:
    args = parse_args(__doc__)
    rounds = 5 if args.quick else 50
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds x {len(DEPTHS)} stack depths")
    print(f"{'model':<12} {'modules':>7} {'rows':>5} {'dynamo capture s':>17}")
    models = [("MLP-300", mlp300(), torch.randn(8, 32)),
              ("ResNet18", torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 64, 64))]
    for name, model, x in models:
        modules = sum(1 for _ in model.modules()) - 1
        dynamo_s, rows = capture_seconds(model, x)
        torch._dynamo.reset()
        print(f"{name:<12} {modules:>7} {rows:>5} {dynamo_s:>17.2f}")
    print("\nPer timed call, median us: added = the call less its graph (guards, input gathering, stance); worst: at the "
          "worst stack depth; guard: the guard check alone; stance: the stance alone; graph: the graph inside the call")
    print(f"{'model':<12} {'grad':>7} {'added':>8} {'worst':>8} {'guard':>8} {'stance':>7} {'graph':>9} {'entry':>7}")
    for name, model, x in models:
        for grad in (False, True):
            cost = guard_cost_us(model, x, rounds, grad)
            torch._dynamo.reset()
            entry = entry_check_us(model, x, grad)
            print(f"{name:<12} {'enabled' if grad else 'no_grad':>7} {cost['added']:>8.1f} {cost['worst']:>8.1f} "
                  f"{cost['guard']:>8.1f} {cost['stance']:>7.1f} {cost['graph']:>9.1f} {entry:>7.1f}")
    print("\nDynamoTimer's timed call around its rows, median us per call (calls alternated): one = the guards asked "
          "once, Dynamo's code run directly; two = EntryGuards, then through Dynamo; saved = the median paired difference")
    print(f"{'model':<12} {'grad':>7} {'one':>8} {'two':>8} {'saved':>8}")
    for name, model, x in models:
        for grad in (False, True):
            torch._dynamo.reset()
            call = timer_call_us(model, x, grad, 50 if args.quick else 400)
            print(f"{name:<12} {'enabled' if grad else 'no_grad':>7} {call['one']:>8.1f} {call['two']:>8.1f} "
                  f"{call['saved']:>8.1f}")


if __name__ == "__main__":
    main()
