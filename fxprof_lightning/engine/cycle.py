"""``Cycle``: one cycle in progress, from its first traced step to its report.

It owns where the cycle writes, its ``torch.profiler`` session (``CycleTrace``), its timer and what the timer
is given: the steps it recorded, their wall and CPU times, phases and batch sizes, and where backward times come
from (``BackwardSource``, chosen at each recorded training step). The engine (``engine.Engine``) decides when a cycle
opens and closes.
"""

from __future__ import annotations

import collections
import contextlib
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.analysis.trust import threads_waited_ns, waited_ms
from fxprof_lightning.capture.timers import Timer
from fxprof_lightning.engine.statistics import summarize_modules, summarize_nodes, summarize_ranges
from fxprof_lightning.nodes import Capture, NodeInfo
from fxprof_lightning.report import CycleReport, NodeStats, layer_label
from fxprof_lightning.timing.autograd_walk import sequence_nr_now
from fxprof_lightning.timing.backward_events import BackwardEvents
from fxprof_lightning.timing.gpu_trace import node_device_times
from fxprof_lightning.timing.gpu_trace import summary as device_summary
from fxprof_lightning.timing.state_memory import OptimizerWatch
from fxprof_lightning.timing.torch_trace import CycleTrace, ModuleCalls

__all__ = ["BackwardSource", "Cycle"]

# Where a cycle's backward times come from:
TRACE = "trace"  # the cycle's torch.profiler trace
EVENTS = "events"  # a profiler session of the backward scope alone (``BackwardEvents``)
HOOKS = "hooks"  # hooks on the autograd nodes (another profiler runs: no events can be had)
TIMER = "timer"  # the timer's own way (CUDA events, a compiled module's kernels), or none


@dataclass
class BackwardSource:
    """Where a cycle's backward times come from (``kind``: ``TRACE``, ``EVENTS``, ``HOOKS`` or ``TIMER``), and with
    ``EVENTS`` the profiler session of the backward scope alone (``events``)."""

    kind: str = TIMER
    events: BackwardEvents | None = None

    def choose(self, trace: CycleTrace | None, timer: Timer | None, warn: Callable[[str], None]) -> None:
        """Decided at each recorded training step for its timer: the trace when there is one; else profiler events
        of the backward scope alone (a session started at the cycle's first recorded step), unless another profiler
        is running (then hooks); timers that do not use events (CUDA without a profiler, compiled modules) have
        their own way."""
        if trace is not None:
            self.kind = TRACE
        elif timer is None or not timer.traits.uses_backward_events:
            self.kind = TIMER
        else:
            if self.events is None:
                self.events = BackwardEvents()
                if not self.events.start() and torch_api.missing_for_backward_events() is None:
                    warn(f"another profiler is running, so this cycle's backward times {timer.traits.without_events}")
            self.kind = EVENTS if self.events.running else HOOKS

    def stop(self, warn: Callable[[str], None]) -> list[tuple[int, int]] | None:
        """End the backward scope's session: its events (None without one)."""
        events = self.events.stop() if self.events is not None else None
        if self.events is not None and self.events.lost:
            warn("another profiler started while this cycle recorded and took over the profiler session, "
                 "so the cycle's nodes get no backward times")
        return events


@dataclass
class Cycle:
    """The cycle in progress: where it writes, what collects its data, and what it recorded."""

    index: int
    directory: Path
    trace: CycleTrace | None
    timer: Timer | None
    capture: Capture | None
    training: bool
    backward: BackwardSource = field(default_factory=BackwardSource)
    recorded: list[int] = field(default_factory=list)
    backward_wall_ns: list[int] = field(default_factory=list)
    samples_at_step: int = 0  # the timer's call count when the step in progress began
    hooks_now: bool = False  # the step in progress times backward with hooks
    step_start: tuple[int, float, int | None] | None = None  # perf_counter_ns, process_time, CPU waited (us) at its start
    step_ms: list[float] = field(default_factory=list)
    step_cpu_ms: list[float] = field(default_factory=list)
    step_wait_ms: list[float] = field(default_factory=list)  # where Linux says: ms our threads waited for a core, per step
    device: dict[str, float] | None = None  # where the trace's GPU time went (gpu_trace.summary)
    phases: list[dict[str, int]] = field(default_factory=list)  # ns per phase of each recorded step (step_phases)
    batch_sizes: list[int] = field(default_factory=list)  # samples in each recorded step, where the driver said
    backward_outside_ns: int | None = None  # backward events no node call accounts for (``measure``)
    forward_walls_ns: list[int] = field(default_factory=list)  # each timed call whole (``measure``)
    untimed: str | None = None  # why the timer's calls ran untimed (``Progress.untimed``, kept by ``measure``)
    nodes: list[NodeInfo] = field(default_factory=list)  # the timer's rows (``measure``)
    dropped: dict[int, str] = field(default_factory=dict)  # recorded steps not counted (a capture ran in them), why
    captures_before: int = 0  # the timer's captures before the cycle (``capture_s``: those since)
    optimizers: OptimizerWatch | None = None  # notes the optimizers that step while the cycle is open (memory)
    memory_note: str | None = None  # why some nodes have no saved bytes (``measure``)
    unused: bool = False  # the module's forward did not run in the warm-up step that just ended
    _step_mark: Any = None  # where the recorded step in progress began (``_StepMark``)
    _dropped_sequences: list[tuple[int, int]] = field(default_factory=list)  # their autograd sequence numbers

    def __post_init__(self) -> None:
        self.captures_before = len(self.timer.progress.capture_s) if self.timer is not None else 0

    @property
    def capture_s(self) -> float:
        """Seconds the timer spent capturing (and checking captures) since the cycle opened: in its warm-up steps or
        in recorded steps it dropped, never in a step it counts."""
        return sum(self.timer.progress.capture_s[self.captures_before:]) if self.timer is not None else 0.0

    def steps_wanted(self, active: int) -> int:
        """How many more steps to record in place of the dropped ones: up to ``active`` counted steps, and no more
        than twice ``active`` recorded in all."""
        if not self.dropped:
            return 0
        return max(min(active - len(self.recorded), 2 * active - len(self.recorded) - len(self.dropped)), 0)

    def cut_short(self, scheduled: int) -> bool:
        """Whether the cycle recorded (counted or dropped) fewer than the ``scheduled`` steps."""
        return len(self.recorded) + len(self.dropped) < scheduled

    def no_step(self) -> str | None:
        """Why the cycle counted no step: it dropped every one (None: it counted one, or dropped none)."""
        if self.recorded or not self.dropped:
            return None
        return (f"it dropped steps {sorted(self.dropped)} ({'; '.join(dict.fromkeys(self.dropped.values()))}) and the "
                "schedule left no idle step to record in their place")

    def nothing_timed(self, stage: str, module: str, nodes: list[NodeStats] | None, children: list[str]) -> str | None:
        """Why the cycle has no node to show, for a warning (None: nothing to say); ``children``: the module's."""
        if not self.recorded:
            why = self.no_step()
            return None if why is None else f"{stage} cycle {self.index} counted no step: {why}; it has no report"
        if self.timer is None or nodes or not self.timer.progress.usable or self.timer.traits.reads_trace_events:
            return None
        why = self.untimed or ("If the training step calls a submodule instead, profile that submodule (the Lightning "
                               f"callback: module='{children[0] if children else '...'}'; its child modules are: "
                               f"{', '.join(children) or '(none)'}).")
        return (f"{module}.forward {'did not run' if self.untimed is None else 'ran untimed'} in the recorded steps "
                f"{self.recorded}, so no node was timed. {why}")

    @property
    def ran_in_step(self) -> bool:
        """Whether the module ran in the step in progress (its samples are in the timer)."""
        return self.timer is not None and self.timer.progress.calls > self.samples_at_step

    def begin_step(self, module: nn.Module, recording: bool, times_backward: bool, warn: Callable[[str], None]) -> None:
        """Install the timer for a traced step (a recorded step's first resets what warm-up measured);
        ``times_backward``: a recorded training step, whose backward is timed (``BackwardSource.choose``)."""
        if times_backward:
            self.backward.choose(self.trace, self.timer, warn)
        if self.timer is not None:
            if recording and not self.recorded:
                self.timer.reset()
            self.samples_at_step, self.hooks_now = self.timer.progress.calls, times_backward and self.backward.kind == HOOKS
            self.timer.install(module, backward_hooks=self.hooks_now)
        if recording:
            self._step_mark = _StepMark(self.timer.save_point() if self.timer is not None else None,
                                        self.timer.progress.interruptions if self.timer is not None else 0, sequence_nr_now(),
                                        len(self.step_ms), len(self.phases), len(self.batch_sizes),
                                        len(self.backward_wall_ns))
            self.step_start = (threads_waited_ns(), time.process_time(), time.perf_counter_ns())

    def end_step(self, module: nn.Module, step: int, recording: bool) -> None:
        """The step ends (``step_trace`` then ends it in the trace). A recorded step in which the timer was
        interrupted (a capture, a call that missed the guards and ran untimed) is dropped: its samples, times and
        phases are forgotten and the step is named in ``dropped`` with why."""
        if self.step_start is not None:
            waited, cpu, wall = self.step_start
            self.step_ms.append((time.perf_counter_ns() - wall) / 1e6)
            self.step_cpu_ms.append((time.process_time() - cpu) * 1e3)
            if (wait := waited_ms(waited)) is not None:
                self.step_wait_ms.append(wait)
            self.step_start = None
        if self.timer is not None:
            self.unused = not recording and not self.ran_in_step  # (a warm-up step the module's forward sat out)
            self.timer.uninstall(module)
        if recording:
            self.count_step(step)

    def count_step(self, step: int) -> None:
        """The recorded step in progress is counted, or dropped when the timer was interrupted in it."""
        mark, self._step_mark = self._step_mark, None
        progress = self.timer.progress if self.timer is not None else None
        if mark is not None and progress is not None and progress.interruptions > mark.interruptions:
            mark.forget()
            self._dropped_sequences.append((mark.sequence_nr, sequence_nr_now()))
            del self.step_ms[mark.steps:], self.step_cpu_ms[mark.steps:], self.step_wait_ms[mark.steps:], self.phases[mark.phases:]
            del self.batch_sizes[mark.batch_sizes:], self.backward_wall_ns[mark.backward_walls:]
            self.dropped[step] = progress.interrupted_by
        else:
            self.recorded.append(step)

    def step_trace(self) -> None:
        """End the step in the cycle's trace (after its last step, the trace is written)."""
        if self.trace is not None:
            self.trace.step()

    def pause(self, module: nn.Module) -> None:
        """Validation runs inside the step in progress: not timed as this cycle's."""
        if self.timer is not None:
            self.timer.uninstall(module)

    def resume(self, module: nn.Module) -> None:
        if self.timer is not None:
            self.timer.install(module, backward_hooks=self.hooks_now)

    def stop_trace(self, warn: Callable[[str], None]) -> None:
        """End the profiler session (first: its events hold the backward times) and export the trace."""
        if self.trace is not None:
            self.trace.stop()
            for error in self.trace.errors:
                warn(error)

    def measure(self, module: nn.Module, warn: Callable[[str], None]) -> list[NodeStats] | None:
        """This rank's node statistics for the cycle (None when nothing was timed); the timer is emptied."""
        timer = self.timer
        timer.uninstall(module)
        progress, traits = timer.progress, timer.traits
        self.untimed = progress.untimed
        events = self.backward.stop(warn)
        if not self.recorded or not progress.usable:  # a graph that stopped fitting kept nothing
            return None
        if events is None:
            events = self.trace.backward_events if self.trace is not None else []
        if self._dropped_sequences:  # the autograd nodes made in dropped steps: their forward samples are gone too
            events = [(nr, ns) for nr, ns in events if not any(a <= nr < b for a, b in self._dropped_sequences)]
        collected = timer.collected(events, self.trace.events if self.trace is not None else [], self.training)
        if isinstance(collected, str):
            warn(collected)
            return None
        if collected.costs_error is not None:  # said once: each failure is counted once (per graph, per input signature)
            warn(f"FLOPs not counted {collected.costs_error}")
        self.nodes = collected.nodes
        forward, backward = collected.forward, collected.backward
        device = self.trace.device if self.trace is not None and traits.device_times_from_trace else None
        if device is not None:  # a GPU model: device time per node call from the trace's kernels
            forward, backward, spans, idle = node_device_times([info.name for info in collected.nodes], device)
            self.device = device_summary(device)
        self.memory_note = collected.saved_unknown
        nodes = summarize_nodes(collected.nodes, forward, backward, collected.costs, collected.mem_delta,
                                collected.mem_peak, collected.saved, collected.held)
        if traits.uses_backward_events and self.backward.kind != HOOKS:
            self.backward_outside_ns = collected.backward_outside_ns
        if device is None:
            self.forward_walls_ns = collected.forward_walls_ns
        else:
            rows = {info.name: i for i, info in enumerate(collected.nodes)}
            nodes = [replace(n, device_span_ms=_mean_ms(spans[rows[n.name]]), device_idle_ms=_mean_ms(idle[rows[n.name]]))
                     for n in nodes]
        timer.reset()
        return nodes

    def report(self, stage: str, nodes: list[NodeStats], ranges: list[Any], ranks: int, partial: bool,
               type_name: Callable[[str], str]) -> CycleReport:
        """The cycle's report: its (gathered) node table, the trace's ranges, steps, phases, and the module tree."""
        report = CycleReport(index=self.index, steps=self.recorded, directory=self.directory, partial=partial, ranks=ranks,
                             stage=stage, nodes=nodes, capture=self.described_capture(),
                             trace_paths=list(self.trace.paths) if self.trace is not None else [],
                             step_ms=self.step_ms, step_cpu_ms=self.step_cpu_ms, step_wait_ms=self.step_wait_ms, device=self.device,
                             phases=_mean_phases(self.phases),
                             batch_size=round(statistics.mean(self.batch_sizes)) if self.batch_sizes else None,
                             dropped_steps=dict(self.dropped), capture_s=self.capture_s, memory_note=self.memory_note)
        report.ranges = summarize_ranges(ranges, len(self.recorded) + len(self.dropped))  # (the trace holds them all)
        if self.backward_wall_ns:
            report.backward_wall_ms = sum(self.backward_wall_ns) / len(self.backward_wall_ns) / 1e6
        elif "forward" in report.phases:  # a plain loop's (``loop_phases``): from the output's gradient on
            report.backward_wall_ms = report.phases.get("backward") or None
        if self.backward_outside_ns is not None and nodes:
            report.backward_outside_ms = self.backward_outside_ns / len(self.recorded) / 1e6
        if self.forward_walls_ns and nodes and ranks == 1:  # (rank 0's calls against the ranks' mean rows: no)
            report.forward_wall_ms = sum(self.forward_walls_ns) / len(self.recorded) / 1e6
        if report.nodes:
            report.modules = summarize_modules(self.nodes, report.nodes, len(self.recorded), type_name)
        report.nodes = _labelled(report.nodes, type_name)
        return report

    def stepped_optimizers(self) -> list[Any] | None:
        """The optimizers that stepped while the cycle was open, the watch removed (None where none was kept)."""
        watch, self.optimizers = self.optimizers, None
        return watch.close() if watch is not None else None

    def described_capture(self) -> Capture | None:
        """The report's own copy of how the module was captured."""
        return self.timer.describe(self.capture) if self.capture is not None and self.timer is not None else self.capture

    def node_ranges(self, type_name: Callable[[str], str]) -> tuple[list[Any], list[Any], list[Any], ModuleCalls] | None:
        """What to write into the cycle's trace (``CycleTrace.node_ranges``): the timer's node ranges, and the modules
        around the nodes for a range per module call (``type_name``: of a module path, as for ``report``)."""
        recorded = self.timer.node_ranges() if self.timer is not None else None
        if recorded is None:
            return None
        anchors, spans, backward_calls, call_starts, stacks = recorded
        paths = {"", *(key.split("@")[0] for stack in stacks.values() for key in stack)}
        return anchors, spans, backward_calls, ModuleCalls(call_starts, stacks, {path: type_name(path) for path in paths})

    def abandon(self, module: nn.Module) -> None:
        """Profiling failed: remove the timer, stop the profiler sessions (no report)."""
        self.stepped_optimizers()
        if self.timer is not None:
            self.timer.uninstall(module)
        if self.backward.events is not None:
            self.backward.events.stop()
        if self.trace is not None:
            with contextlib.suppress(Exception):  # already failing; the warning has been given
                self.trace.stop()


@dataclass(frozen=True)
class _StepMark:
    """Where a recorded step began: the timer's samples (``forget``: its ``save_point``) and interruptions, the
    autograd sequence number, and how many step times, phases, batch sizes and backward walls had been given
    (``Cycle.count_step`` drops what came after)."""

    forget: Callable[[], None] | None
    interruptions: int
    sequence_nr: int
    steps: int
    phases: int
    batch_sizes: int
    backward_walls: int


def _labelled(nodes: list[NodeStats], type_name: Callable[[str], str]) -> list[NodeStats]:
    """The rows with their ``layer`` labels; a label two rows share (a layer called twice, two adds in one block)
    gets each row's call number from its node's name (``b_add`` #1, ``b_add_1`` #2), the same in every cycle."""
    labels = [layer_label(n, type_name) for n in nodes]
    repeated = {label for label, count in collections.Counter(labels).items() if count > 1}

    def number(name: str) -> int:
        found = re.search(r"_(\d+)$", name)
        return int(found[1]) + 1 if found else 1

    return [replace(n, layer=f"{label} #{number(n.name)}" if label in repeated else label)
            for n, label in zip(nodes, labels, strict=True)]


def _mean_phases(steps: list[dict[str, int]]) -> dict[str, float]:
    """Mean ms per step of each phase over the steps that have them."""
    return {phase: sum(step[phase] for step in steps) / len(steps) / 1e6 for phase in steps[0]} if steps else {}


def _mean_ms(ns: list[int]) -> float | None:
    return sum(ns) / len(ns) / 1e6 if ns else None
