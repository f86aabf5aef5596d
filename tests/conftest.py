"""Pytest machinery only: the autouse seed fixture and the slow tier. Shared models live in tests/helpers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# `from helpers import ...` in the test files: tests/ on sys.path whatever pytest's import mode.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# The slow tier: files whose tests run whole trainings of thousands of steps, subprocesses or process groups.
# `pytest -m "not slow"` is the quick edit-test loop; CI runs everything.
SLOW_FILES = {"test_long_runs.py", "test_follow.py", "test_model_zoo.py", "test_benchmarks.py", "test_distributed.py", "test_fsdp2.py",
              "test_quiet.py", "test_browser.py", "test_compiled.py", "test_tensorboard_plugin.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
    return f"torch {torch.__version__}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure names the torch it failed on (CI runs the suite on several: ``.ci/run``)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("torch", f"failed on torch {torch.__version__}"))
