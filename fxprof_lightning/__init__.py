"""fxprof-lightning: per-layer timing of sampled PyTorch Lightning training steps.

Add ``FXProfilerCallback`` to a ``Trainer``; see the README for the options.
"""

from fxprof_lightning.callback import FXProfilerCallback
from fxprof_lightning.report import CycleReport, NodeStats
from fxprof_lightning.schedule import Schedule

__all__ = ["CycleReport", "FXProfilerCallback", "NodeStats", "Schedule"]
__version__ = "0.1.0"
