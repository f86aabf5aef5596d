"""A cycle's rows: the statistics of a node (``NodeStats``), a module (``ModuleStats``) and a library's range in the
trace (``RangeStats``) over its recorded steps, and a row's name as the user's code names it (``layer_label``). The
cycle that holds them is ``report.CycleReport``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["OPERATORS", "ModuleStats", "NodeStats", "RangeStats", "layer_label", "shorten"]


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
    (parameters not included; None where unknown or not measured; ``timing.saved_memory``). ``saved_held_bytes``: the
    activation bytes a forward call keeps for backward once the node's last call in it has run, its own and those of
    the nodes before it (the forward's saved activations building up to their peak at its end; None where unknown).
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
    saved_held_bytes: float | None = None  # bytes kept for backward once the node has run in a forward call (its and before)


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
