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


@pytest.fixture
def two_threads():
    """At most two intra-op threads, as on the CI machine: on 16 (an H200 machine, torch 2.11) the autograd engine's
    own gaps between a tiny backward's nodes are over 10% of its wall (node rows covered 0.89 of it against 0.97-1.00
    here), which is the machine's, not what a coverage test checks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    yield
    torch.set_num_threads(threads)


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
