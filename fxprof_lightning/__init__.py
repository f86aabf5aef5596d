"""fxprof-lightning: per-layer timing of sampled PyTorch training steps.

``Profiler`` for any training loop (plain PyTorch, Fabric, FSDP2); ``FXProfilerCallback`` for a
Lightning ``Trainer``. See the README for the options.
"""

from fxprof_lightning.callback import FXProfilerCallback
from fxprof_lightning.engine import Profiler
from fxprof_lightning.report import CycleReport, NodeStats
from fxprof_lightning.schedule import Schedule
from fxprof_lightning.sinks import ConsoleSink, CsvSink, TensorBoardSink

__all__ = ["ConsoleSink", "CsvSink", "CycleReport", "FXProfilerCallback", "NodeStats", "Profiler", "Schedule", "TensorBoardSink"]
__version__ = "0.1.0"
