"""Per-cycle results: the node, module and range statistics of a cycle (``CycleReport``). They are made from the
timers' samples by ``engine.statistics``; their Markdown and CSV forms are drawn by ``outputs.tables``."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CycleReport", "ModuleStats", "NodeStats", "RangeStats", "last_sound", "layer_label"]

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


def shorten(text: str, width: int, ellipsis: str = "...") -> str:
    """``text`` cut in the middle to at most ``width`` characters, keeping its start and end.

    >>> shorten("layers.10.attention.self.query", 20)
    'layers.10...lf.query'
    >>> shorten("layers.10.attention.self.query", 12, "…")
    'layers…query'
    """
    if len(text) <= width:
        return text
    keep = width - len(ellipsis)
    return text[: (keep + 1) // 2] + ellipsis + text[len(text) - keep // 2:]


@dataclass(frozen=True)
class NodeStats:
    """Forward and backward time of one node over a cycle's recorded steps, with its costs.

    ``mean_ms``/``median_ms``/``min_ms``/``max_ms`` are per forward call; ``total_ms`` is the
    sum over the cycle and ``pct`` its share of the summed forward time of all nodes. The
    ``bwd_*`` fields are the same for the backward of the autograd nodes the node created
    (``bwd_calls`` counts the calls whose backward ran). ``fwd_flops``/``bwd_flops`` are per
    call (a multiply-add is 2 FLOPs), ``*_gflops_per_s`` divide them by the mean times,
    ``out_bytes`` is the size of the node's output tensors. ``mem_delta_bytes`` and
    ``mem_peak_bytes`` (CUDA only, else None) are the mean change of allocated memory and
    the mean peak above the starting point (the peak is never measured per node: that would reset the
    user's peak statistics). On CUDA with the profiler's trace, the times are device times: the summed
    durations of the kernels, memcpys and memsets each node call launched (``gpu_trace``), and
    ``device_span_ms``/``device_idle_ms`` the mean span of a forward call's GPU work and the gaps in it. ``source``:
    for an op outside every submodule, the user's function and line that ran it (``stack_rows (train.py:12)``). ``mad_ms``/``bwd_mad_ms`` are the median absolute
    deviations of the per-call samples (the robust spread that regression checks use). ``saved_bytes``: the bytes of
    the activations the node's autograd nodes keep for backward, per call, each storage counted once in the step
    (parameters not included; None where unknown or not measured; ``timing.saved_memory``).
    ``fwd_bytes`` estimates the bytes one forward call moves (its input and output tensors and the
    parameters it reads, each once); ``fwd_gbytes_per_s`` divides it by ``mean_ms``,
    ``intensity`` is ``fwd_flops / fwd_bytes``, ``bound`` is ``"compute"`` or ``"memory"`` (the
    roofline's side, from the device's peaks) and ``pct_of_peak`` the achieved share of what the
    roofline allows at that intensity (see ``roofline``). With several ranks (see ``merge_ranks``) the
    figures are means over ranks, ``min_ms``/``max_ms`` extremes over ranks, and
    ``slowest_rank``/``slowest_rank_ms`` name the rank with the highest ``mean_ms``.
    """

    name: str
    op: str
    target: str
    module_path: str
    calls: int
    mean_ms: float
    median_ms: float
    min_ms: float
    max_ms: float
    total_ms: float
    pct: float
    bwd_calls: int = 0
    bwd_mean_ms: float = 0.0
    bwd_median_ms: float = 0.0
    bwd_min_ms: float = 0.0
    bwd_max_ms: float = 0.0
    bwd_total_ms: float = 0.0
    bwd_pct: float = 0.0
    fwd_flops: int | None = None
    bwd_flops: int | None = None
    fwd_gflops_per_s: float | None = None
    bwd_gflops_per_s: float | None = None
    out_bytes: int | None = None
    mem_delta_bytes: float | None = None
    mem_peak_bytes: float | None = None
    slowest_rank: int = 0
    slowest_rank_ms: float = 0.0
    mad_ms: float = 0.0
    bwd_mad_ms: float = 0.0
    fwd_bytes: int | None = None
    fwd_gbytes_per_s: float | None = None
    intensity: float | None = None
    bound: str = ""
    pct_of_peak: float | None = None
    device_span_ms: float | None = None
    device_idle_ms: float | None = None
    source: str = ""
    layer: str = ""  # the row as the user's code names it (``layer_label``)
    saved_bytes: float | None = None  # bytes autograd keeps for the node's backward, per call (docs/memory.md)


# Python's operators as the user writes them (the rows of ``x + y`` name ``operator.add``).
OPERATORS = {"operator.add": "x + y", "operator.iadd": "x += y", "operator.sub": "x - y", "operator.isub": "x -= y",
             "operator.mul": "x * y", "operator.imul": "x *= y", "operator.truediv": "x / y", "operator.itruediv": "x /= y",
             "operator.floordiv": "x // y", "operator.matmul": "x @ y", "operator.pow": "x ** y", "operator.neg": "-x",
             "operator.getitem": "x[i]", "operator.setitem": "x[i] = y", "operator.and_": "x & y",
             "operator.or_": "x | y", "operator.eq": "x == y", "operator.lt": "x < y", "operator.gt": "x > y"}


def layer_label(node: NodeStats, type_name: Callable[[str], str]) -> str:
    """A row as the user's code names it: a layer by its path and type, an op by its function and where it runs
    (the layer around it, or the user's function and line outside every submodule).

    >>> types = {"": "Net", "0": "Linear", "block": "Block"}.get
    >>> row = NodeStats("model_0", "call_module", "0", "0", 1, *[0.0] * 6)
    >>> layer_label(row, types), layer_label(replace(row, op="call_function", target="torch.nn.functional.relu",
    ...                                                   module_path="block"), types)
    ('0 (Linear)', 'F.relu in block (Block)')
    >>> layer_label(replace(row, op="call_function", target="operator.add", module_path="", source="f (train.py:3)"), types)
    'x + y in f (train.py:3)'
    >>> layer_label(replace(row, op="fsdp2", target="all-gather", module_path="block"), types)
    'FSDP2 all-gather of block (Block)'
    """
    kind = type_name(node.module_path) if node.op not in ("step", "unowned") else ""
    where = f"{node.module_path or '(root)'} ({kind})" if kind else node.module_path
    if node.op in ("call_module", "module"):
        return where or node.name
    if node.op == "fsdp2":  # FSDP2's collectives of a module (``capture.fsdp_rows``)
        return f"FSDP2 {node.target} of {where or '(root)'}"
    if node.op == "recompute":
        return f"{where}: recompute in backward" if where else node.name
    if node.op not in ("call_function", "call_method"):  # a row between graphs, of the step, of unowned time
        return node.name
    function = OPERATORS.get(node.target) or node.target.replace("torch.nn.functional.", "F.")
    function = f"x.{function}()" if node.op == "call_method" else function
    if node.source:
        return f"{function} in {node.source}"
    return f"{function} in {where}" if node.module_path else function


@dataclass(frozen=True)
class ModuleStats:
    """A module's times per recorded step: ``self_*`` from its own nodes, ``total_*`` with its submodules. Its memory,
    with its submodules (None where not measured): ``saved_bytes_per_step`` autograd keeps for backward per step (its nodes'),
    and the bytes of its parameters, of their gradients (one per trainable parameter, of its size: what they take
    once backward made them) and of the optimizer's state for them (``optimizer_bytes``: SGD's momentum, Adam's
    moments).

    What a checkpoint of the module would keep (``analysis.memory_plan``), per call, None where unknown: ``input_bytes``
    its input (the output of the row that ran just before its first row), ``input_held`` whether that row saved it for
    its own backward (it is then held whether or not the module is checkpointed); ``output_bytes`` the output of its
    last row, ``output_held`` whether that row saved it (checkpointed, the row after it that saves it holds it)."""

    path: str
    type_name: str
    depth: int
    calls_per_step: float
    self_fwd_ms: float
    total_fwd_ms: float
    self_bwd_ms: float
    total_bwd_ms: float
    saved_bytes_per_step: float | None = None
    param_bytes: int | None = None
    grad_bytes: int | None = None
    optimizer_bytes: int | None = None
    input_bytes: int | None = None
    input_held: bool = False
    output_bytes: int | None = None
    output_held: bool = False


@dataclass(frozen=True)
class RangeStats:
    """A range that a library opens in the trace (FSDP2's ``FSDP::all_gather (blocks.0)``...), per recorded step.

    ``module`` is the module the range names ('' for the root), ``ms_per_step`` the mean over ranks.
    """

    name: str
    module: str
    calls_per_step: float
    ms_per_step: float


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
            (flagged in the sound cycle before too, or beyond what noise can explain; ``regressions.Verdict``).
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

    # The report's views, drawn by ``outputs.tables``: kept here as the public API (docs/outputs.md), each one call,
    # imported when asked so that the vocabulary imports no room at load time.

    def to_markdown(self, top_k: int | None = None) -> str:
        """The cycle as Markdown: header, node table (slowest first, ``top_k`` rows at most), trust line,
        regressions, advice and FSDP ranges (``outputs.tables.markdown``)."""
        from fxprof_lightning.outputs import tables
        return tables.markdown(self, top_k)

    def modules_to_text(self, depth: int | None = None) -> str:
        """The module tree, indented like torchprof's, as a Markdown code block (``outputs.tables.modules_text``)."""
        from fxprof_lightning.outputs import tables
        return tables.modules_text(self, depth)

    def to_csv(self) -> str:
        """All node statistics as CSV, one row per node, slowest first (``outputs.tables.nodes_csv``)."""
        from fxprof_lightning.outputs import tables
        return tables.nodes_csv(self)

    def modules_to_csv(self) -> str:
        """The module tree as CSV, depth first (``outputs.tables.modules_csv``)."""
        from fxprof_lightning.outputs import tables
        return tables.modules_csv(self)

    def ranges_to_csv(self) -> str:
        """The FSDP ranges as CSV, slowest first (``outputs.tables.ranges_csv``)."""
        from fxprof_lightning.outputs import tables
        return tables.ranges_csv(self)

    def step_to_csv(self) -> str:
        """The step's phases and the time no row owns as CSV (``outputs.tables.step_csv``)."""
        from fxprof_lightning.outputs import tables
        return tables.step_csv(self)


def last_sound(cycles: Sequence[CycleReport]) -> CycleReport:
    """The cycle the slowest layers, the step's split and the advice are read from: the last one whose numbers can be
    trusted (complete, with node rows, not distorted by other load), else the last one. Under load, a run's last
    cycle may be inflated ~150x; its slowest layer is then load's, not the model's."""
    return next((c for c in reversed(cycles) if c.nodes and not c.partial and not c.distortion), cycles[-1])
