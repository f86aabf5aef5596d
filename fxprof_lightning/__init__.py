"""fxprof-lightning: per-layer timing of sampled PyTorch training steps.

``Profiler`` for any training loop (plain PyTorch, Fabric, FSDP2); ``FXProfilerCallback`` for a
Lightning ``Trainer``. See the README for the options. Lightning is imported only when the
callback is first used, so ``Profiler`` and the ``fxprof`` command start without it.
"""

from typing import Any

from fxprof_lightning.engine import Profiler
from fxprof_lightning.report import CycleReport, NodeStats
from fxprof_lightning.schedule import Schedule
from fxprof_lightning.sinks import ConsoleSink, CsvSink, PictureSink, TensorBoardSink

__all__ = ["ConsoleSink", "CsvSink", "CycleReport", "FXProfilerCallback", "NodeStats", "PictureSink", "Profiler",
           "Schedule", "TensorBoardSink"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "FXProfilerCallback":
        from fxprof_lightning.callback import FXProfilerCallback

        return FXProfilerCallback
    raise AttributeError(f"module 'fxprof_lightning' has no attribute {name!r}")
