"""The overhead benchmark still runs end to end (its numbers are for people, not for assertions)."""

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
