"""Per-cycle results: what one cycle recorded (``CycleReport``), with its rows (``rows``: node, module and range
statistics, made from the timers' samples by ``engine.statistics``), the figures of its recorded steps, and how it
reads: as Markdown (the text the loggers and the console show), its module tree as text, and its tables as the CSV
files of the cycle's directory (``layout``: ``fx_nodes.csv``, ``fx_modules.csv``, ``fsdp_ranges.csv``,
``fx_step.csv``). The record is complete when the engine hands it out; every view only reads it."""

from __future__ import annotations

import csv
import io
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fxprof_lightning.rows import ModuleStats, NodeStats, RangeStats, layer_label, shorten

__all__ = ["CycleReport", "CycleViews", "ModuleStats", "NodeStats", "RangeStats", "cpu_per_wall", "cycle_views",
           "describe_phases", "last_sound", "layer_label", "markdown", "memory_line", "modules_csv", "modules_text",
           "nodes_csv", "ranges_csv", "shorten", "step_csv", "step_spread", "waited_share"]

NS_PER_MS = 1e6
# The rows of ``CycleReport.unowned``: time of the measured forward and backward that no row owns.
UNOWNED_FORWARD = "(between the rows: code between graphs, guards, the call, the clock)"
UNOWNED_OUTSIDE = "(autograd nodes no row made: the loss, ops between graphs)"
UNOWNED_ENGINE = "(the autograd engine: between its nodes, its start and end, hooks)"


def describe_phases(phases: dict[str, float]) -> str:
    """The step's phases in one line, largest first, with their shares.

    >>> describe_phases({"data": 30.0, "training_step": 50.0, "backward": 20.0, "other": 0.0})
    '100.0 ms per step (measured, mean): training_step 50.0 ms (50%), data 30.0 ms (30%), backward 20.0 ms (20%)'
    """
    total = sum(phases.values()) or 1.0
    parts = [f"{name} {ms:.1f} ms ({100 * ms / total:.0f}%)" for name, ms in sorted(phases.items(), key=lambda p: -p[1])
             if ms >= 0.0005 * total]
    return f"{total:.1f} ms per step (measured, mean): " + ", ".join(parts)


@dataclass
class CycleReport:
    """What one profiling cycle recorded.

    Attributes:
        index: 0-based cycle number in the schedule.
        steps: the recorded (active) step numbers.
        nodes: per-node statistics, slowest (forward + backward) first (empty without node timing).
        modules: the module tree, depth first (empty without node timing).
        trace_paths: torch.profiler trace files written for this cycle.
        directory: the cycle's output directory.
        partial: True when the report holds only some of the cycle's recorded steps (training stopped
            inside it, or this run resumed inside it).
        ranks: how many ranks' node tables were merged into ``nodes``.
        stage: ``"train"`` or ``"val"``.
        capture: how the module was captured (``capture.Capture``: method, leaf modules and why), or None.
        backward_wall_ms: measured wall time of ``backward`` per recorded step (training), or None.
        backward_outside_ms: per recorded step, the backward time of autograd nodes that no node call created
            (the loss or ops outside the timed module, between its captured graphs), or None.
        forward_wall_ms: per recorded step, the host wall time of the timed module's calls whole (its rows, the code
            between its captured graphs, Dynamo's guards and call, the clock reads), or None where not measured
            (module hooks, compiled models, CUDA). ``unowned`` gives what no row owns.
        ranges: FSDP2's ranges in the trace (all-gather, reduce-scatter... per module), slowest first.
        step_ms: wall time of each recorded step (from its start to the next step's start), rank 0's.
        step_cpu_ms: this process's CPU time (all threads) over each recorded step.
        step_wait_ms: where Linux keeps scheduler statistics, the time this process's threads waited for a core in each
            recorded step (summed over the threads).
        regressions: nodes slower than in the earlier cycles beyond the noise (``regressions.Regression``), confirmed
            (flagged in the sound cycle before too, or beyond what noise can explain; ``watch.Verdict``).
        unconfirmed: nodes flagged for the first time: the next sound cycle confirms them or not.
        advice: what to try, one sentence each, most useful first (``advice``).
        distortion: why the cycle's numbers look distorted by other load (``trust.distortion``), or None.
        tracked: the nodes whose series the run logs as scalars: the first cycle's ``top_k`` slowest, then each
            later cycle's slowest from that cycle on (``history.StageHistory.analyse``).
        device: where the trace's GPU time went (``gpu_trace.summary``: kernels, device_ms, in_nodes_ms,
            outside_ms, unlaunched, orphan_flows) when the node times are device times from the trace, else None.
        phases: where the whole step went, ms per recorded step by phase (``step_phases.PHASES``: data,
            training_step, zero_grad, backward, optimizer, callbacks, fxprof, other), adding up to the step's wall
            time from the end of the step before; Lightning only (from its profiler's actions), else empty.
        peaks: the roofline's peaks and where they come from (measured, cached, given, spec sheet), or None.
        batch_size: samples per recorded step (the batch's leading dimension), or None where it was not recorded;
            ``fxprof compare`` divides the totals by it when two runs' batch sizes differ.
        dropped_steps: recorded steps the cycle did not count, step -> why: a capture ran in them (Dynamo captured the
            module again, or a call missed its guards and ran untimed), so their times are not those of training.
            The cycle recorded as many later steps in their place, where the schedule left them idle, up to twice
            ``active`` steps in all (``steps`` lists the steps it counts).
        capture_s: seconds spent capturing the module (and checking each capture against eager) in the cycle's
            warm-up and dropped steps: the cost of the capture, in no step, phase or node time.
        trigger: why the cycle ran: ``schedule``; ``request: <reason>`` (``python -m fxprof_lightning trigger``); or
            ``anomaly: <figures>`` (the step time jumped between cycles; ``follow``). A cycle out of the schedule is
            ``label`` ``3-t1`` (the first before scheduled cycle 3), in ``cycle_0003-t1``.
        cost_s: what the cycle cost the run, in seconds: the wall time from its first step to its report written
            (capture, timing, trace export, analysis, pictures, files), less as many idle steps (their median);
            None until the sinks have written the cycle (it is in the run's ``fxprof_cycles.jsonl``, not in
            ``cycle.jsonl``).
        memory_note: why some nodes have no saved bytes (``NodeStats.saved_bytes`` None: a ``saved_tensors_hooks`` of
            the user's packed what they saved), or None.
        untimed: why the cycle has no node row (the module's forward did not run in its recorded steps, naming the
            modules it has), or None; the end summary says it (such a cycle writes no files).
        checkpoint_plan: the blocks whose recomputation in backward saves most memory per millisecond, with the
            predicted saving and cost (``memory_plan.CheckpointPlan``), or None where it does not pay (docs/memory.md).
        pictures: PNG images by tag (``fxprof/slowest_layers``...), rendered once for every sink that wants them
            and emptied when the sinks are done (the PNG files stay in ``directory``).
    """

    index: int
    steps: list[int]
    nodes: list[NodeStats] = field(default_factory=list)
    modules: list[ModuleStats] = field(default_factory=list)
    trace_paths: list[Path] = field(default_factory=list)
    directory: Path | None = None
    partial: bool = False
    ranks: int = 1
    stage: str = "train"
    capture: Any = None
    backward_wall_ms: float | None = None
    backward_outside_ms: float | None = None
    forward_wall_ms: float | None = None
    ranges: list[RangeStats] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    step_cpu_ms: list[float] = field(default_factory=list)
    step_wait_ms: list[float] = field(default_factory=list)
    regressions: list[Any] = field(default_factory=list)
    unconfirmed: list[Any] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    distortion: str | None = None
    tracked: list[str] = field(default_factory=list)
    pictures: dict[str, bytes] = field(default_factory=dict, repr=False)
    device: dict[str, float] | None = None
    peaks: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    batch_size: int | None = None
    dropped_steps: dict[int, str] = field(default_factory=dict)
    capture_s: float = 0.0
    trigger: str = "schedule"
    cost_s: float | None = None
    memory_note: str | None = None
    checkpoint_plan: Any = None
    untimed: str | None = None

    @property
    def label(self) -> str:
        """The cycle's name in text: its index, with ``-tN`` for a cycle out of the schedule (its directory's).

        >>> CycleReport(3, [5], directory=Path("fxprof/cycle_0003-t1")).label
        '3-t1'
        """
        found = re.search(r"-t(\d+)", self.directory.name) if self.directory is not None else None
        return f"{self.index}-t{found[1]}" if found else str(self.index)

    @property
    def forward_ms_per_step(self) -> float:
        """Summed node forward time per recorded step."""
        return sum(n.total_ms for n in self.nodes) / max(len(self.steps), 1)

    @property
    def backward_ms_per_step(self) -> float:
        """Summed node backward time per recorded step."""
        return sum(n.bwd_total_ms for n in self.nodes) / max(len(self.steps), 1)

    @property
    def step_wall_ms(self) -> float | None:
        """The step's wall time, ms per recorded step (mean), in every view: its phases summed (each step from the end
        of the one before, the wait for its batch included: ``step_phases``), else its timed part (``step_ms``: from
        the step's start to its end)."""
        if self.phases:
            return sum(self.phases.values())
        return statistics.fmean(self.step_ms) if self.step_ms else None

    @property
    def step_spread(self) -> float | None:
        """``step_spread`` of the recorded steps."""
        return step_spread(self.step_ms)

    @property
    def cpu_per_wall(self) -> float | None:
        """``cpu_per_wall`` of the recorded steps."""
        return cpu_per_wall(self.step_ms, self.step_cpu_ms)

    @property
    def waited_share(self) -> float | None:
        """``waited_share`` of the recorded steps."""
        return waited_share(self.step_ms, self.step_wait_ms)

    @property
    def whole_share(self) -> float:
        """Percent of node time (forward and backward) in rows that time a block whole: a torch function Dynamo's
        capture kept as one call (named in ``capture.leaves`` with why), every module under module hooks."""
        if self.capture is None or not self.nodes:
            return 0.0
        leaves = self.capture.leaves
        whole = (n for n in self.nodes if self.capture.method == "module_hooks"
                 or (n.op == "call_module" and n.target in leaves)
                 or (n.op in ("call_function", "call_method")  # the reason of a function kept whole names it first
                     and leaves.get(n.module_path, "").startswith(f"{n.target} ")))
        grand = sum(n.total_ms + n.bwd_total_ms for n in self.nodes) or 1.0
        return 100.0 * sum(n.total_ms + n.bwd_total_ms for n in whole) / grand

    def to_summary(self) -> dict[str, Any]:
        """The cycle apart from its tables, as JSON-ready values (``cycle.jsonl`` in the cycle's directory)."""
        return {
            "index": self.index, "stage": self.stage, "steps": self.steps, "partial": self.partial, "ranks": self.ranks,
            "forward_ms_per_step": self.forward_ms_per_step, "backward_ms_per_step": self.backward_ms_per_step,
            "backward_wall_ms": self.backward_wall_ms, "backward_outside_ms": self.backward_outside_ms,
            "forward_wall_ms": self.forward_wall_ms, "step_ms": self.step_ms, "step_cpu_ms": self.step_cpu_ms,
            "step_wait_ms": self.step_wait_ms,
            "capture": self.capture.describe() if self.capture is not None else None,
            "regressions": [asdict(r) for r in self.regressions],
            "unconfirmed": [asdict(r) for r in self.unconfirmed], "advice": self.advice,
            "distortion": self.distortion, "tracked": self.tracked,
            "trace_files": [p.name for p in self.trace_paths], "device": self.device, "peaks": self.peaks, "phases": self.phases,
            "batch_size": self.batch_size, "dropped_steps": {str(step): why for step, why in self.dropped_steps.items()},
            "capture_s": self.capture_s, "trigger": self.trigger,
            "dynamo_messages": list(getattr(self.capture, "dynamo_messages", None) or []),
            "checkpoint_plan": asdict(self.checkpoint_plan) if self.checkpoint_plan is not None else None,
        }

    def dropped_text(self) -> str:
        """The steps the cycle dropped and the capture time, in a few words ('' when none and no capture).

        >>> CycleReport(0, [5, 7, 8], dropped_steps={6: "captured (a guard failed)"}, capture_s=0.25).dropped_text()
        'step 6 dropped (captured (a guard failed)), steps 5, 7, 8 counted; capture 0.25 s'
        """
        text = ""
        if self.dropped_steps:
            dropped = sorted(self.dropped_steps)
            whys = "; ".join(dict.fromkeys(self.dropped_steps.values()))
            text = (f"step{'s' * (len(dropped) > 1)} {', '.join(map(str, dropped))} dropped ({whys}), "
                    f"step{'s' * (len(self.steps) != 1)} {', '.join(map(str, self.steps)) or 'none'} counted")
        if self.capture_s:
            text += f"{'; ' if text else ''}capture {self.capture_s:.2f} s"
        return text

    def backward_account(self) -> str:
        """Where the measured backward went: the nodes' share, autograd nodes no node call created, and the rest
        (the autograd engine between nodes, hooks)."""
        wall, nodes = self.backward_wall_ms, self.backward_ms_per_step
        text = f"the nodes' backward times cover {100 * nodes / wall:.0f}% of the measured backward"
        if self.backward_outside_ms is not None:
            rest = max(wall - nodes - self.backward_outside_ms, 0.0)
            text += (f"; autograd nodes no node call created (the loss or ops outside the timed module, between its "
                     f"captured graphs) {100 * self.backward_outside_ms / wall:.0f}%, the rest (the autograd engine "
                     f"between nodes, hooks) {100 * rest / wall:.0f}%")
        return text

    def unowned(self) -> dict[str, tuple[float | None, float | None]]:
        """Time per recorded step that no row owns, by where it went: name -> (forward ms, backward ms), None where a
        row has no side. With the rows it makes the measured forward (``forward_wall_ms``) and backward
        (``backward_wall_ms``); the backward rows no node call created are measured, the rest is what remains."""
        rows: dict[str, tuple[float | None, float | None]] = {}
        if self.forward_wall_ms and self.nodes:
            rows[UNOWNED_FORWARD] = (max(self.forward_wall_ms - self.forward_ms_per_step, 0.0), None)
        if self.backward_wall_ms and self.backward_ms_per_step:
            if self.backward_outside_ms is not None:
                rows[UNOWNED_OUTSIDE] = (None, self.backward_outside_ms)
            rest = self.backward_wall_ms - self.backward_ms_per_step - (self.backward_outside_ms or 0.0)
            rows[UNOWNED_ENGINE] = (None, max(rest, 0.0))
        return rows

    # The report's views (docs/outputs.md), drawn by the functions below.

    def views(self, top_k: int | None = None, module_depth: int | None = None) -> CycleViews:
        """The views a sink writes, drawn at once (``CycleViews``): one call gives a sink all it writes."""
        return cycle_views(self, top_k, module_depth)

    def to_markdown(self, top_k: int | None = None) -> str:
        """The cycle as Markdown: header, node table (slowest first, ``top_k`` rows at most), trust line,
        regressions, advice and FSDP ranges (``markdown``)."""
        return markdown(self, top_k)

    def modules_to_text(self, depth: int | None = None) -> str:
        """The module tree, indented like torchprof's, as a Markdown code block (``modules_text``)."""
        return modules_text(self, depth)

    def to_csv(self) -> str:
        """All node statistics as CSV, one row per node, slowest first (``nodes_csv``)."""
        return nodes_csv(self)

    def modules_to_csv(self) -> str:
        """The module tree as CSV, depth first (``modules_csv``)."""
        return modules_csv(self)

    def ranges_to_csv(self) -> str:
        """The FSDP ranges as CSV, slowest first (``ranges_csv``)."""
        return ranges_csv(self)

    def step_to_csv(self) -> str:
        """The step's phases and the time no row owns as CSV (``step_csv``)."""
        return step_csv(self)


@dataclass(frozen=True)
class CycleViews:
    """A cycle's views as the sinks write them (``CycleReport.views``): the node table as Markdown (``to_markdown``,
    ``top_k`` rows), the module tree as text (``modules_to_text``, ``module_depth`` levels; None without modules),
    the node and module tables as CSV (``to_csv``, ``modules_to_csv``; None without modules) and the rest of the
    report as JSON-ready values (``to_summary``)."""

    markdown: str
    modules_text: str | None
    nodes_csv: str
    modules_csv: str | None
    summary: dict[str, Any]


def cycle_views(report: CycleReport, top_k: int | None = None, module_depth: int | None = None) -> CycleViews:
    """``CycleReport.views``."""
    return CycleViews(markdown(report, top_k), modules_text(report, module_depth) if report.modules else None,
                      nodes_csv(report), modules_csv(report) if report.modules else None, report.to_summary())


def last_sound(cycles: Sequence[CycleReport]) -> CycleReport:
    """The cycle the slowest layers, the step's split and the advice are read from: the last one whose numbers can be
    trusted (complete, with node rows, not distorted by other load), else the last one. Under load, a run's last
    cycle may be inflated ~150x; its slowest layer is then load's, not the model's."""
    return next((c for c in reversed(cycles) if c.nodes and not c.partial and not c.distortion), cycles[-1])

# The figures of a cycle's recorded steps, from their wall, CPU and wait times (``analysis.trust`` judges them).

def step_spread(step_ms: list[float]) -> float | None:
    """``(max - min) / median`` of the recorded steps' wall times (None for fewer than 2 steps).

    >>> step_spread([10.0, 11.0, 12.0])
    0.18181818181818182
    """
    if len(step_ms) < 2:
        return None
    middle = statistics.median(step_ms)
    return (max(step_ms) - min(step_ms)) / middle if middle > 0 else None


def waited_share(step_ms: list[float], step_wait_ms: list[float]) -> float | None:
    """The share of the recorded steps' wall time the process's threads waited for a core (summed over them; None
    without a reading).

    >>> waited_share([10.0, 10.0], [1.0, 3.0])
    0.2
    """
    wall = sum(step_ms)
    return sum(step_wait_ms) / wall if wall > 0 and step_wait_ms and len(step_wait_ms) == len(step_ms) else None


def cpu_per_wall(step_ms: list[float], step_cpu_ms: list[float]) -> float | None:
    """The process's CPU time over the wall time of the recorded steps (None without steps)."""
    wall = sum(step_ms)
    return sum(step_cpu_ms) / wall if wall > 0 and step_cpu_ms else None


# The report's views.

def markdown(report: CycleReport, top_k: int | None = None) -> str:
    """The cycle as Markdown: header, node table (slowest first, ``top_k`` rows at most), trust line,
    regressions, advice and FSDP ranges."""
    shown = report.nodes if top_k is None else report.nodes[:top_k]
    steps = max(len(report.steps), 1)
    step_range = f"steps {report.steps[0]}-{report.steps[-1]}" if report.steps else "no recorded step"
    stage = "Validation cycle" if report.stage == "val" else "Cycle"
    over_ranks = f", mean over {report.ranks} ranks" if report.ranks > 1 else ""
    straggler = report.ranks > 1
    header = f"{stage} {report.label}{' (partial)' if report.partial else ''}, {step_range}"
    header += f" ({report.trigger})" if report.trigger != "schedule" else ""
    header += f": node rows summed, forward {report.forward_ms_per_step:.3f} ms"
    if report.backward_ms_per_step:
        header += f", backward {report.backward_ms_per_step:.3f} ms"
        if report.backward_wall_ms:
            header += f" ({report.backward_account()})"
    header += f" per step (mean) over {len(report.nodes)} nodes{over_ranks}"
    if report.capture is not None:
        header += f"; captured by {report.capture.describe()}"
        if report.capture.leaves or report.capture.method == "module_hooks":
            header += f"; {report.whole_share:.0f}% of node time in blocks timed whole"
    if report.device is not None:
        d = report.device
        header += (f". GPU time from the trace's {d['kernels']:.0f} kernels/memcpys/memsets ({d['device_ms']:.3f} ms): "
                   f"{d['in_nodes_ms']:.3f} ms launched by nodes, {d['outside_ms']:.3f} ms outside them")
        if d["unlaunched"] or d["orphan_flows"]:
            header += f", {d['unlaunched']:.0f} with no launch in the trace, {d['orphan_flows']:.0f} flows naming no launch"
    if report.peaks is not None:
        header += f". Roofline peaks: {report.peaks}"
    if report.dropped_steps or report.capture_s:
        header += f". Left out of the numbers: {report.dropped_text()}"
    grand = sum(n.total_ms + n.bwd_total_ms for n in report.nodes) or 1.0
    memory = any(n.saved_bytes is not None for n in report.nodes)
    lines = [
        header,
        "",
        "| layer | op | fwd ms/call | bwd ms/call | fwd+bwd ms/step | % of fwd+bwd | calls/step "
        "| fwd GFLOP/s | % of peak | bound | node |" + (" MB saved/step |" if memory else "")
        + (" slowest rank fwd ms/call | slowest rank |" if straggler else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|" + ("---:|" if memory else "")
        + ("---:|---:|" if straggler else ""),
    ]
    for n in shown:  # (the node's name: the key of its scalar series, and of the CSV's rows)
        row = (
            f"| {_md(n.layer or n.name)} | {n.op.removeprefix('call_')} | {n.mean_ms:.3f} | {n.bwd_mean_ms:.3f} "
            f"| {(n.total_ms + n.bwd_total_ms) / steps:.3f} | {100 * (n.total_ms + n.bwd_total_ms) / grand:.1f} "
            f"| {n.calls / steps:g} | {_num(n.fwd_gflops_per_s, '.1f')} | {_num(n.pct_of_peak, '.0f')} | {n.bound} "
            f"| {_md(n.name)} |" + (f" {_mb(n.saved_bytes, n.calls / steps)} |" if memory else "")
        )
        if straggler:
            row += f" {n.slowest_rank_ms:.3f} | {n.slowest_rank} |"
        lines.append(row)
    if len(shown) < len(report.nodes):
        lines.append(f"\n{len(report.nodes) - len(shown)} faster nodes not shown (the CSV has every node, with its target).")
    lines.append("")
    held = memory_line(report)
    if held:
        lines += [held, ""]
    if report.checkpoint_plan is not None:
        lines += [f"Checkpointing plan (predicted from the saved bytes and forward times): {report.checkpoint_plan.text()}.",
                  ""]
    unowned = report.unowned()
    if unowned:
        measured = [f"{side} {wall:.3f} ms" for side, wall in (("forward", report.forward_wall_ms),
                                                               ("backward", report.backward_wall_ms)) if wall]
        lines += [f"Time no row owns, ms per step (with the rows: the measured {' and '.join(measured)}):", "",
                  "| where | fwd ms/step | bwd ms/step |", "|---|---:|---:|"]
        lines += [f"| {name} | {_num(fwd, '.3f')} | {_num(bwd, '.3f')} |" for name, (fwd, bwd) in unowned.items()]
        lines.append("")
    if report.phases:
        total = sum(report.phases.values()) or 1.0
        lines += [f"The whole step: {total:.1f} ms per step (measured; the mean of the recorded steps), by phase:", "",
                  "| phase | ms/step | % of the step |", "|---|---:|---:|"]
        lines += [f"| {phase} | {ms:.3f} | {100 * ms / total:.0f} |"
                  for phase, ms in sorted(report.phases.items(), key=lambda item: -item[1])]
        lines.append("")
    if report.step_ms:
        trust = f"Recorded steps took {report.step_wall_ms:.1f} ms (mean)"
        spread, cpu = report.step_spread, report.cpu_per_wall
        if spread is not None:
            trust += f", spread {100 * spread:.0f}%"
        if cpu is not None:
            trust += f", {cpu:.2f} CPU s per wall s"
        wait = report.waited_share
        if wait is not None:
            trust += f", its threads waited for a core {100 * wait:.0f}% of the time"
        lines += [trust + ".", ""]
    if report.distortion:
        lines += [f"**These numbers look distorted by other load:** {report.distortion}.", ""]
    if report.regressions:
        lines += ["Regressions, slower than in the earlier cycles beyond the noise (median ms per call):", ""]
        lines += [f"- {_md(r.node)} {r.direction}: {r.baseline_ms:.3f} -> {r.now_ms:.3f} ms ({r.ratio:.2f}x, "
                  f"noise {r.noise_ms:.3f} ms)" for r in report.regressions]
        lines.append("")
    if report.advice:
        lines += ["What to try:", "", *(f"- {text}" for text in report.advice), ""]
    if report.ranges:
        lines += ["FSDP ranges in the trace (ms per step, inside the nodes above):", "",
                  "| range | module | ms per step | calls per step |", "|---|---|---:|---:|"]
        lines += [f"| {_md(r.name)} | {_md(r.module or '(root)')} | {r.ms_per_step:.3f} | {r.calls_per_step:g} |"
                  for r in report.ranges]
    return "\n".join(lines).rstrip("\n")


def modules_text(report: CycleReport, depth: int | None = None) -> str:
    """The module tree, indented like torchprof's, as a Markdown code block (ms per step)."""
    shown = [m for m in report.modules if depth is None or m.depth <= depth]
    rows = [(("  " * m.depth) + (m.path.rsplit(".", 1)[-1] or "(root)") + f" ({m.type_name})", m) for m in shown]
    width = max((len(label) for label, _ in rows), default=10)
    memory = any(m.saved_bytes_per_step is not None or m.param_bytes is not None for m in shown)
    title = "Module tree, ms per step (self: the module's own nodes; total: with its submodules)"
    title += "; MB with its submodules: saved for backward per step, parameters, gradients, optimizer state:" if memory else ":"
    lines = [title, "", "```", f"{'module':<{width}}  self fwd  total fwd   self bwd  total bwd  calls/step"
             + ("  MB saved  MB params  MB grads  MB optim" if memory else "")]
    for label, m in rows:
        lines.append(
            f"{label:<{width}}  {m.self_fwd_ms:8.3f}  {m.total_fwd_ms:9.3f}  {m.self_bwd_ms:9.3f}  {m.total_bwd_ms:9.3f}  {m.calls_per_step:10g}"
            + (f"  {_mb(m.saved_bytes_per_step):>8}  {_mb(m.param_bytes):>9}  {_mb(m.grad_bytes):>8}  {_mb(m.optimizer_bytes):>8}"
               if memory else "")
        )
    lines.append("```")
    return "\n".join(lines)


def memory_line(report: CycleReport, top: int = 5) -> str:
    """What the step holds at the end of its forward, by layer: the bytes autograd keeps for backward (all still held
    then: the forward's peak of saved activations), the layers that hold most, and the model's parameters, gradients
    and optimizer state ('' where memory was not measured)."""
    steps = max(len(report.steps), 1)
    saved = [(n, n.saved_bytes * n.calls / steps) for n in report.nodes if n.saved_bytes is not None]
    if not saved:
        return f"Saved for backward: unknown ({report.memory_note})." if report.memory_note else ""
    total = sum(b for _, b in saved)
    unknown = sum(1 for n in report.nodes if n.saved_bytes is None and n.calls)
    text = f"Held at the end of the forward: {total / 1e6:.3f} MB saved for backward per step"
    largest = [(n, b) for n, b in sorted(saved, key=lambda item: -item[1])[:top] if b > 0]
    if largest and total:
        text += " (" + ", ".join(f"{_md(n.layer or n.name)} {100 * b / total:.0f}%" for n, b in largest) + ")"
    if unknown:
        text += f", {unknown} node{'s' * (unknown > 1)} unknown" + (f" ({report.memory_note})" if report.memory_note else "")
    root = next((m for m in report.modules if m.path == "" and m.param_bytes is not None), None)
    if root is not None:
        text += f"; parameters {root.param_bytes / 1e6:.3f} MB, gradients {root.grad_bytes / 1e6:.3f} MB"
        if root.optimizer_bytes is not None:
            text += f", optimizer state {root.optimizer_bytes / 1e6:.3f} MB"
    return text + "."


def nodes_csv(report: CycleReport) -> str:
    """All node statistics as CSV, one row per node, slowest first."""
    return _csv(NodeStats, report.nodes)


def modules_csv(report: CycleReport) -> str:
    """The module tree as CSV, depth first."""
    return _csv(ModuleStats, report.modules)


def ranges_csv(report: CycleReport) -> str:
    """The FSDP ranges as CSV, slowest first."""
    return _csv(RangeStats, report.ranges)


def step_csv(report: CycleReport) -> str:
    """The rest of the step as CSV rows beside the node rows, ms per recorded step: each phase of the whole
    step (``phases``: ``kind`` phase) and each part of the timed module's forward and backward that no node row
    owns (``unowned``: ``kind`` unowned, ``side`` forward or backward)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["kind", "name", "side", "ms_per_step"])
    for name, ms in report.phases.items():
        writer.writerow(["phase", name, "", round(ms, 6)])
    for name, sides in report.unowned().items():
        for side, ms in zip(("forward", "backward"), sides):
            if ms is not None:
                writer.writerow(["unowned", name, side, round(ms, 6)])
    return buffer.getvalue()


def _csv(record_type: type, records: list) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[f.name for f in fields(record_type)], lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(record).items()})
    return buffer.getvalue()


def _mb(value: float | None, times: float = 1.0) -> str:
    """Bytes (times ``times``) as MB with three decimals; '' for None."""
    return "" if value is None else f"{value * times / 1e6:.3f}"


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _md(text: str) -> str:
    """A code span that is safe inside a Markdown table cell."""
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"
