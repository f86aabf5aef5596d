"""One torch.profiler session per cycle, written where the TensorBoard plugin and Perfetto read it.

A fresh ``torch.profiler.profile`` is created for each cycle and lives only over that
cycle's warm-up and recorded steps, so nothing of the profiler runs between cycles. Its
schedule numbers steps like the training run, so the trace's ``ProfilerStep#N`` ranges
carry the same step numbers as the logged scalars. The trace file appears under its final
name in one ``os.replace``: the plugin never sees a partial file. kineto's routine log lines
about starting and stopping the session are kept off the console (``quiet.quiet_kineto``).
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction

from fxprof_lightning.node_timing import backward_durations
from fxprof_lightning.quiet import quiet_kineto

__all__ = ["CycleTrace", "check_profiler_kwargs"]

OWNED_KWARGS = ("schedule", "on_trace_ready")
# Ranges that torch's FSDP2 opens around its work, named after the module: "FSDP::all_gather (blocks.0)".
RANGE_PREFIXES = ("FSDP::",)


def check_profiler_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``kwargs`` for ``torch.profiler.profile``, or ``ValueError`` naming what is wrong."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"profiler_kwargs must be a dict of torch.profiler.profile arguments, got {type(kwargs).__name__}")
    owned = sorted(set(kwargs) & set(OWNED_KWARGS))
    if owned:
        raise ValueError(
            f"profiler_kwargs may not set {', '.join(owned)}: FXProfilerCallback owns the schedule and writes "
            "the traces; use its skip_first/wait/warmup/active/repeat and dirpath arguments instead"
        )
    accepted = set(inspect.signature(torch.profiler.profile).parameters) - {"self", *OWNED_KWARGS}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"profiler_kwargs has unknown torch.profiler.profile arguments {unknown}; accepted: {sorted(accepted)}"
        )
    return dict(kwargs)


class CycleTrace:
    """torch.profiler over the traced steps of one cycle.

    Create it at the start of the cycle's first traced step, call ``step()`` at the end of
    every traced step and ``stop()`` after the last one (or to cut the cycle short: what was
    recorded so far is written then).

    Args:
        actions: the cycle's steps and what the schedule does at each (WARMUP, RECORD, RECORD_AND_SAVE).
        directory: where the trace file goes (it must exist).
        worker: worker name, the part of the file name before the time stamp (``rank0``).
        use_gzip: write ``.pt.trace.json.gz`` instead of ``.pt.trace.json``.
        profiler_kwargs: further ``torch.profiler.profile`` arguments (checked by ``check_profiler_kwargs``).
        backward_events: keep the autograd node times of the trace in ``backward_events`` (for node timing).
    """

    def __init__(
        self,
        actions: dict[int, ProfilerAction],
        directory: Path,
        worker: str,
        use_gzip: bool = True,
        profiler_kwargs: dict[str, Any] | None = None,
        backward_events: bool = False,
    ) -> None:
        self.paths: list[Path] = []
        self.errors: list[str] = []
        self.backward_events: list[tuple[int, int]] = []  # (sequence number, ns) per autograd node run (NodeTimer.add_backward)
        self.ranges: dict[str, list[int]] = {}  # ns of each run of a communication range (FSDP::all_gather (blocks.0), ...)
        self._collect_backward = backward_events
        self._directory = directory
        self._worker = worker
        self._suffix = ".pt.trace.json.gz" if use_gzip else ".pt.trace.json"
        self._profiler = torch.profiler.profile(
            schedule=lambda step: actions.get(step, ProfilerAction.NONE),
            on_trace_ready=self._write,
            **(profiler_kwargs or {}),
        )
        first = min(actions)
        with quiet_kineto():
            if first > 0:
                # Enter the cycle through step() so the profiler's step number is the training step.
                self._profiler.step_num = first - 1
                self._profiler.start()
                self._profiler.step()
            else:
                self._profiler.start()

    def step(self) -> None:
        """End the current step (after the cycle's last step this writes the trace)."""
        with quiet_kineto():
            self._profiler.step()

    def stop(self) -> None:
        """Stop profiling; a cycle cut short is written with what it recorded."""
        with quiet_kineto():
            self._profiler.stop()

    def _write(self, profiler: torch.profiler.profile) -> None:
        events = profiler.profiler.kineto_results.events()
        if self._collect_backward:
            self.backward_events += backward_durations(events)
        for event in events:
            if event.name().startswith(RANGE_PREFIXES):
                self.ranges.setdefault(event.name(), []).append(event.duration_ns())
        stamp = time.time_ns()
        final = self._directory / f"{self._worker}.{stamp}{self._suffix}"
        # A name the plugin's pattern (...pt.trace.json[.gz]) does not match, same extension for gzip.
        partial = self._directory / f".{self._worker}.{stamp}.partial{'.json.gz' if self._suffix.endswith('.gz') else '.json'}"
        try:
            profiler.export_chrome_trace(str(partial))
            os.replace(partial, final)
        except Exception as error:  # a trace that cannot be written must not stop training
            for leftover in self._directory.glob(f"{partial.name}*"):  # the exporter may add its own .tmp
                leftover.unlink(missing_ok=True)
            self.errors.append(f"could not write the trace {final}: {type(error).__name__}: {error}")
            return
        self.paths.append(final)
