"""The checkpointing plan applied (issue 42, item 3): its predicted saving and cost against a measured run.

    .venv/bin/python benchmarks/bench_memory_plan.py --threads 1          # 5 rounds per model, a few minutes
    .venv/bin/python benchmarks/bench_memory_plan.py --threads 1 --quick  # 1 round, numbers are rough

Workload: the models of ``tests/test_memory_plan.py`` (a ResNet-like stack of basic blocks, batch 16 of 3x32x32; a
GPT-like stack of 4 pre-norm blocks, batch 8 of 64 tokens; torchvision's ResNet18, batch 16 of 3x112x112), AdamW,
CPU, the test's plain loop (``profile``) with ``Profiler(wait=1, warmup=1, active=8, torch_profiler=False,
pictures=False, sinks=[])``. Each round profiles the
model as it is, takes its plan (``CycleReport.checkpoint_plan``), wraps the blocks the plan names in non-reentrant
``torch.utils.checkpoint`` and profiles that (same seed, same data). Prints per model: the plan, the measured drop of
the saved bytes per step against the predicted (exact: bytes are deterministic) and, as the median over rounds of the
per-round ratio measured/predicted, the backward time of the recompute rows (their median per call), the added
backward time of all rows (``backward_ms_per_step``) and of the recorded step (median ``step_ms``). Issue 42's goal: both within 15% of the prediction.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from run_info import closing_lines, cpu_stall_us, package_state, parse_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_memory_plan import MODELS, apply_plan, profile  # (the test's models and loop, found from here)


def _saved(cycle) -> float:
    return next(m for m in cycle.modules if m.path == "").saved_bytes_per_step


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds = 1 if args.quick else 5
    started, stall = time.perf_counter(), cpu_stall_us()
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {package_state()}, CPU, {torch.get_num_threads()} thread(s), {rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (make, make_input) in MODELS.items():
            backward, step, bytes_ratio, recompute = [], [], [], []
            for r in range(rounds):
                torch.manual_seed(0)
                before = profile(make(), make_input, f"{tmp}/{name}{r}b", steps=10, active=8)
                plan = before.checkpoint_plan
                if plan is None:
                    print(f"{name}: no plan")
                    break
                torch.manual_seed(0)
                after = profile(apply_plan(make(), plan), make_input, f"{tmp}/{name}{r}a", steps=10, active=8)
                bytes_ratio.append((_saved(before) - _saved(after)) / plan.saved_bytes)
                backward.append((after.backward_ms_per_step - before.backward_ms_per_step) / plan.cost_ms)
                rows = [n for n in after.nodes if n.op == "recompute"]
                recompute.append(sum(n.bwd_median_ms * n.bwd_calls for n in rows) / len(after.steps) / plan.cost_ms)
                step.append((statistics.median(after.step_ms) - statistics.median(before.step_ms)) / plan.cost_ms)
            else:
                print(f"{name}: {plan.text()}")
                print(f"  saved bytes, measured/predicted: {statistics.median(bytes_ratio):.3f}")
                print(f"  the recompute rows' backward (medians), measured/predicted: median "
                      f"{statistics.median(recompute):.2f} (range {min(recompute):.2f}-{max(recompute):.2f})")
                print(f"  added backward of the rows, measured/predicted: median {statistics.median(backward):.2f} "
                      f"(range {min(backward):.2f}-{max(backward):.2f})")
                print(f"  added recorded step, measured/predicted: median {statistics.median(step):.2f} "
                      f"(range {min(step):.2f}-{max(step):.2f})")
    print(*closing_lines(stall, started), sep="\n")


if __name__ == "__main__":
    main()
