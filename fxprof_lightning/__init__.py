"""fxprof-lightning: per-layer timing of sampled PyTorch training steps.

``Profiler`` for any training loop (plain PyTorch, Fabric, FSDP2); ``FXProfilerCallback`` for a
Lightning ``Trainer``. Options: docs/usage.md#options. Every name is imported when first used, so the
``fxprof`` command (which reads files) starts without torch, and ``Profiler`` without Lightning.
"""

import importlib
from typing import Any

__all__ = ["ConsoleSink", "CsvSink", "CycleReport", "FXProfilerCallback", "FxprofWarning", "NodeStats", "PictureSink",
           "Profiler", "Schedule", "TensorBoardSink"]
__version__ = "0.1.0"

_HOMES = {"Profiler": "engine.profiler", "FXProfilerCallback": "callback", "CycleReport": "report",
          "NodeStats": "report", "Schedule": "schedule", "ConsoleSink": "outputs.sinks", "CsvSink": "outputs.sinks",
          "PictureSink": "outputs.sinks", "TensorBoardSink": "outputs.sinks"}


class FxprofWarning(UserWarning):
    """Every warning of this package: what was not profiled and why, what could not be written. Training goes on.

    Filter them as one, e.g. ``warnings.filterwarnings("ignore", category=FxprofWarning)``, or make them errors in a
    test suite (``filterwarnings = ["error::fxprof_lightning.FxprofWarning"]``).
    """


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"fxprof_lightning.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'fxprof_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
