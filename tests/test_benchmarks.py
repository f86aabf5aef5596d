"""The overhead benchmark still runs end to end (its numbers are for people, not for assertions)."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_overhead.py"


def test_overhead_benchmark_quick_run_prints_every_measurement():
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for row in ("1  idle:", "2  ResNet18: step with FX timing", "2  MLP-199", "3  ResNet18: tutorial ProfilingInterpreter",
                "4  ResNet18: node times under torch.profiler", "5  ResNet18 ours / profiler range"):
        assert row in run.stdout, run.stdout[-3000:]


def test_idle_benchmark_quick_run_prints_every_hook_and_the_total():
    script = Path(__file__).parents[1] / "benchmarks" / "bench_idle.py"
    run = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for hook in ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_train_batch_end"):
        assert re.search(rf"^  {hook} +[\d.]+ +[\d.]+ +-?[\d.]+$", run.stdout, re.MULTILINE), run.stdout
    assert re.search(r"all hooks, added +-?[\d.]+ us/step", run.stdout), run.stdout
