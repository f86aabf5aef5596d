"""Per-layer time of a ``torch.compile``'d module, from the kernels Inductor generated for it (CPU).

torch.fx cannot trace a compiled module, and its ops no longer run one by one: Inductor fuses
them into kernels. What the recorded steps ran is read from the cycle's torch.profiler trace, and
each kernel is traced back to the model's modules with what Inductor knows at compile time:

1. ``cpp.enable_kernel_profile``: every generated C++ kernel opens a profiler range named after
   it (``graph_0_cpp_fused_relu_1``); extern kernels and fallbacks run as aten ops
   (``aten::convolution``). All are direct children of the ``## Call CompiledFxGraph ##`` range
   of the graph that ran, forward (under ``CompiledFunction``) or backward (under
   ``CompiledFunctionBackward``).
2. Provenance tracking: for each compiled graph, the kernels in the order the graph calls them,
   each with the post-grad FX nodes it was made from. torch 2.14+ keeps them per graph
   (``trace.provenance_tracking_to_timeline``, ``torch._inductor.debug.get_kernel_information_jsons``);
   2.11-2.13 keep one record of all kernels (``trace.provenance_tracking_level``; kernels named
   ``name:handle``, handles in the order of code generation), and a graph's kernels are those added
   to it after the graph's post-grad pass, up to the next graph's. torch 2.6 and 2.8 record none
   (2.9 and 2.10 not checked), and a compiled module there gets its trace alone
   (``missing_for_kernels``).
3. A post-grad pass (``post_grad_custom_post_pass``, chained before the user's own) notes the
   module of each post-grad node: ``nn_module_stack`` in forward graphs, ``fwd_nn_module_stack``
   (the forward op's) in backward graphs.

A kernel made from the nodes of one module is that module's; a kernel fused from nodes of several
modules is shown against the fused group (a row ``conv + bn``, placed under the modules' common
ancestor in the module tree), not split: how its time divides among the modules is not measured.
Ops at the top level of the forward (``torch.relu(x)`` outside any submodule) form rows named
after the kernel. Ops Dynamo left between graphs (graph breaks) run eagerly and are not
attributed; the graph breaks are listed.

The settings are made at the start of the run, before the module compiles (compilation happens at
its first call), and taken back at the end: they add a profiler range check to each C++ kernel
(inactive without a profiler), and turn off Inductor's FX graph cache and AOTAutograd's cache
while they hold (a cached graph would skip the post-grad pass), so the module compiles as on a
cold start. They change no generated computation. Graphs compiled before them (an earlier run in the same process)
have no record: the cycle that finds them says so and drops their cache entries, so they compile again at their next
call and the next cycle has their rows.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.nodes import NodeInfo
from fxprof_lightning.timing.readings import Uninterrupted

if TYPE_CHECKING:
    from fxprof_lightning.nodes import Capture

__all__ = ["MECHANISM", "CompiledKernels", "KernelTimer", "is_compiled"]

MECHANISM = ("per-layer time from the compiled graphs' kernels in the torch.profiler trace: Inductor's provenance "
             "tracking (kernel -> post-grad nodes), the post-grad nodes' nn_module_stack (node -> module) and "
             "C++ kernel ranges (cpp.enable_kernel_profile)")
CALL = "## Call CompiledFxGraph"
FORWARD, BACKWARD = "CompiledFunction", "CompiledFunctionBackward"
REGION = "Torch-Compiled Region: "
TOP = ""  # module path of ops outside any submodule


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: ``torch.compile(module)`` or ``module.compile()``."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def missing_for_kernels() -> str | None:
    """What this torch's Inductor lacks for per-layer times from kernels (None: nothing; torch 2.11 has all of it)."""
    if torch_api.inductor_config is None or torch_api.functorch_config is None or torch_api.CompileContext is None:
        return "torch._inductor (or torch._functorch, torch._guards)"
    if _timeline():
        return None if torch_api.get_kernel_information_jsons is not None else "debug.get_kernel_information_jsons"
    if not torch_api.PROVENANCE_LEVEL:
        return "trace.provenance_tracking_level"
    return None


def _timeline() -> bool:
    """Whether Inductor keeps each compiled graph's kernels itself (2.14+), or their record is read at each post-grad
    pass (``torch_api.kernel_provenance``, 2.11-2.13)."""
    return hasattr(torch_api.inductor_config.trace, "provenance_tracking_to_timeline")


@dataclass
class _Kernel:
    """One kernel call of a compiled graph: the event name it has in the trace, and the calls of the model's code it
    came from, as (module path, function): ``("encoder.linear1", "linear")``, ``("", "relu")`` at the top level."""

    event: str
    origins: frozenset[tuple[str, str]]
    ops: str  # what it computes: "relu", "aten::addmm"

    @property
    def paths(self) -> frozenset[str]:
        return frozenset(path for path, _ in self.origins)


class _ModulePass:
    """Post-grad pass: notes each node's origin, (module path, function), per (compile id, backward) graph; then runs
    ``previous``. The function is the call Dynamo saw in the model's code (``source_fn_stack``: ``linear``,
    ``layer_norm``, ``multi_head_attention_forward``, ``add``); a backward node has its forward op's."""

    def __init__(self, graphs: dict[tuple[str, bool], dict[str, tuple[str, str]]], previous: Any,
                 records: list[tuple[tuple[str, bool], dict[str, list[str]], int]] | None = None) -> None:
        self.graphs, self.previous, self.records = graphs, previous, records

    def __call__(self, graph: torch.fx.Graph) -> None:
        compile_id = torch_api.CompileContext.current_compile_id()
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        origins: dict[str, tuple[str, str]] = {}
        prefix = "fwd_" if backward else ""
        for node in graph.nodes:
            if node.op != "call_function" or node.target is torch.ops.aten.copy_.default:
                continue  # buffer write-backs (batch-norm statistics) belong to no layer's compute
            stack = node.meta.get(f"{prefix}nn_module_stack") or node.meta.get("nn_module_stack")
            functions = node.meta.get(f"{prefix}source_fn_stack") or node.meta.get("source_fn_stack")
            function = functions[-1][0] if functions else getattr(node.target, "__name__", str(node.target)).split(".")[0]
            origins[node.name] = (module_path(list(stack.values())[-1][0]) if stack else TOP, re.sub(r"_\d+$", "", function))
        self.graphs[(str(compile_id), backward)] = origins
        if self.records is not None:  # 2.11-2.13: the graph's kernels are those added to this record from now on
            self.records.append(((str(compile_id), backward), *torch_api.kernel_provenance()))
        else:
            # Inductor keeps the kernels of each graph under its compile id, and keeps the first it saw: compile ids
            # start again after torch._dynamo.reset(), so an entry of an earlier graph with this id is dropped.
            torch_api.get_kernel_information_jsons().pop(str((f"{REGION}{compile_id}", backward)), None)
        if self.previous is not None:
            self.previous(graph)

    def uuid(self) -> Any:  # a custom pass must say what it is for Inductor's caches (which are off meanwhile)
        return "fxprof_lightning.capture.compiled._ModulePass"


def module_path(source: str) -> str:
    """``"L['self'].layer1[0].conv1"`` (Dynamo's name of a module) as ``"layer1.0.conv1"``."""
    path = re.sub(r"^L\['self'\]", "", source)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\._modules\.", ".", path)
    return path.strip(".")


class CompiledKernels:
    """The Inductor settings attribution needs, made by ``start`` (before the module compiles) and taken back
    by ``stop``; the module path of each post-grad node of every graph compiled meanwhile."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[str, bool], dict[str, tuple[str, str]]] = {}
        # 2.11-2.13: at each post-grad pass, the graph, Inductor's kernel record then in use and its last handle
        self.records: list[tuple[tuple[str, bool], dict[str, list[str]], int]] = []
        self._saved: dict[str, Any] | None = None
        self.breaks_before: dict[str, int] = {}  # Dynamo's graph break counts when first started (``graph_breaks``)

    def start(self) -> None:
        inductor_config, functorch_config = torch_api.inductor_config, torch_api.functorch_config
        if self._saved is not None:
            return
        if not self.graphs:  # (graphs compiled in an earlier run are kept, and their breaks with them)
            self.breaks_before = graph_breaks()
        provenance = "provenance_tracking_to_timeline" if _timeline() else "provenance_tracking_level"
        self._saved = {
            "enable_kernel_profile": inductor_config.cpp.enable_kernel_profile,
            provenance: getattr(inductor_config.trace, provenance),
            "fx_graph_cache": inductor_config.fx_graph_cache,
            "enable_autograd_cache": functorch_config.enable_autograd_cache,
            "post_grad_custom_post_pass": inductor_config.post_grad_custom_post_pass,
        }
        inductor_config.cpp.enable_kernel_profile = True
        # 2.11-2.13: level 2 ("basic") records each kernel's post-grad nodes, and no pre-grad stack traces
        setattr(inductor_config.trace, provenance, True if provenance == "provenance_tracking_to_timeline" else 2)
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
        inductor_config.post_grad_custom_post_pass = _ModulePass(self.graphs, self._saved["post_grad_custom_post_pass"],
                                                                 None if _timeline() else self.records)

    def stop(self) -> None:
        inductor_config, functorch_config = torch_api.inductor_config, torch_api.functorch_config
        if self._saved is None:
            return
        saved, self._saved = self._saved, None
        inductor_config.cpp.enable_kernel_profile = saved["enable_kernel_profile"]
        for provenance in ("provenance_tracking_to_timeline", "provenance_tracking_level"):
            if provenance in saved:
                setattr(inductor_config.trace, provenance, saved[provenance])
        inductor_config.fx_graph_cache = saved["fx_graph_cache"]
        functorch_config.enable_autograd_cache = saved["enable_autograd_cache"]
        inductor_config.post_grad_custom_post_pass = saved["post_grad_custom_post_pass"]

    def kernels(self) -> dict[tuple[str, bool], list[_Kernel]]:
        """Per compiled graph (compile id, backward), its kernels in call order."""
        result = {}
        for key, kernels in self._post_grad_nodes().items():
            origins = self.graphs.get(key, {})
            ordered = sorted(kernels.items(), key=lambda item: _handle(item[0]))
            result[key] = [_kernel(name.rsplit(":", 1)[0], nodes, origins) for name, nodes in ordered]
        return result

    def _post_grad_nodes(self) -> dict[tuple[str, bool], dict[str, list[str]]]:
        """Per compiled graph, its kernels (``"name:handle"``) and the post-grad nodes of each."""
        if _timeline():
            found = {}
            for region, kernels in torch_api.get_kernel_information_jsons().items():
                match = re.fullmatch(rf"\('{REGION}(.+)', (True|False)\)", region)
                if match is not None:
                    found[(match.group(1), match.group(2) == "True")] = {
                        name: info.get("post_grad_nodes", []) for name, info in kernels.items()}
            return found
        # 2.11-2.13: a graph's kernels are those its code generation added to the record in use at its post-grad
        # pass: handles after the one given then, up to the next graph's pass with the same record (a later pass
        # of the same graph, after torch._dynamo.reset(), replaces it).
        found = {}
        for index, (key, record, first) in enumerate(self.records):
            last = min((start for _, other, start in self.records[index + 1:] if other is record and start >= first),
                       default=None)
            found[key] = {name: nodes for name, nodes in record.items()
                          if first < _handle(name) and (last is None or _handle(name) <= last)}
        return found


def _handle(kernel: str) -> int:
    """The debug handle Inductor gave a kernel (``"cpp_fused_relu_1:3"``: 3)."""
    return int(kernel.rsplit(":", 1)[1])


def _kernel(name: str, post_grad_nodes: list[str], origins: dict[str, tuple[str, str]]) -> _Kernel:
    if name.startswith(("extern_kernels.", "torch.ops.aten.")):  # one op, run by aten
        op = name.removeprefix("extern_kernels.") if name.startswith("extern_kernels.") else name.split(".")[3]
        event = ops = "aten::" + op
        # Its provenance may list the nodes that feed it too: the node of the op itself is its own.
        own = [n for n in post_grad_nodes if re.fullmatch(rf"{re.escape(op)}(_\d+)?", n)]
        post_grad_nodes = own or post_grad_nodes
    else:
        event = name  # the trace has it with a graph_N_ prefix
        ops = re.sub(r"_\d+$", "", re.sub(r"^(cpp|triton)_(fused_|poi_|red_|per_)*", "", name))
    found = frozenset(origins[n] for n in post_grad_nodes if n in origins)
    return _Kernel(event, found or frozenset({(TOP, ops)}), ops)


@dataclass
class _Event:
    name: str
    start: int
    end: int
    thread: int
    sequence_nr: int = -1


@dataclass
class KernelTimer(Uninterrupted):
    """The rows and samples of a compiled module, read from a cycle's trace events (``read``).

    It has the interface of ``NodeSamples`` that ``readings.collected_of`` reads: ``nodes``, ``fwd``, ``bwd_ns``; nothing is
    installed on the module (``install`` only counts steps), so training runs exactly as compiled.
    """

    kernels: CompiledKernels
    nodes: list[NodeInfo] = field(default_factory=list)
    fwd: list[list[int]] = field(default_factory=list)
    bwd: list[list[int]] = field(default_factory=list)
    fused: dict[str, list[str]] = field(default_factory=dict)  # row name -> the kernels fused across its modules
    unattributed_ns: int = 0  # kernels of the graphs' calls that matched no known kernel
    unknown_graphs: set[str] = field(default_factory=set)  # compile ids of graphs that ran with no kernel record
    calls: int = 0
    graph_calls: int = 0  # calls of compiled graphs in the last events read (0: no Inductor kernels ran)
    mem_delta: list[list[int]] = field(default_factory=list)
    mem_peak: list[list[int]] = field(default_factory=list)
    forward_inputs: Any = None
    uses_backward_events = False
    trace_ranges = False
    # ``timers.Timer``:
    mismatch = None
    untimed = None
    usable = True
    costs_error = None
    backward_outside_ns = 0  # (no backward events: rows come from the trace's kernels)
    forward_walls_ns: tuple[int, ...] = ()  # (not measured)
    reads_trace_events = True  # the trace keeps its events for ``collect``
    device_times_from_trace = False
    without_events = ""

    def collect(self, backward: Any, trace_events: list[tuple[str, int, int, int, int]]) -> str | None:
        """The rows and samples from the cycle's trace events (``read``); says so when no compiled graph ran. Graphs
        compiled before the profiler started (an earlier run in this process) have no kernel record: they are
        compiled again at their next call, so the next cycle has their rows."""
        self.read(trace_events)
        if self.unknown_graphs:
            torch_api.forget_compiles(self.unknown_graphs, shared=True)
        if not self.nodes and self.unknown_graphs:
            return (f"the module's compiled graphs ({', '.join(sorted(self.unknown_graphs))}) were compiled before the "
                    "profiler started (an earlier run in this process), without Inductor's record of which layer each "
                    "kernel comes from, so this cycle has no per-layer times (the trace is written); they compile again "
                    "at their next call, and the next cycle has them")
        if not self.graph_calls:
            return ("the module is torch.compile'd, but no Inductor-compiled graph ran in the recorded steps (another "
                    "backend?), so its layers have no times; the torch.profiler trace is written")
        return None

    def node_ranges(self) -> None:
        """The kernels are in the trace already."""

    def costs(self, training: bool) -> None:
        """Not counted for compiled modules."""

    def describe(self, capture: Capture) -> Capture:
        return replace(capture, fused=dict(self.fused), graph_breaks=graph_breaks(self.kernels.breaks_before))

    def refusal(self, capture: Capture) -> str:
        return capture.error

    def install(self, module: nn.Module, backward_hooks: bool = False) -> None:
        self.calls += 1

    def uninstall(self, module: nn.Module) -> None:
        pass

    def reset(self) -> None:
        """Nothing to forget: ``read`` makes the rows and samples afresh from each cycle's events."""

    def add_backward(self, events: Any) -> None:
        pass

    def resolve(self) -> None:
        pass

    def bwd_ns(self, index: int) -> list[int]:
        return self.bwd[index]

    def read(self, events: list[tuple[str, int, int, int, int]]) -> None:
        """Rows and samples from a cycle's events ``(name, start ns, duration ns, thread, sequence number)``: one
        sample per row and call of a graph with kernels of the row (0 where none of them ran in the call)."""
        self.nodes, self.fwd, self.bwd, self.fused, self.unattributed_ns = [], [], [], {}, 0
        kernels = self.kernels.kernels()
        timeline = sorted((_Event(name, start, start + duration, thread, sequence_nr)
                           for name, start, duration, thread, sequence_nr in events), key=lambda e: (e.thread, e.start, -e.end))
        rows: dict[Any, int] = {}  # row key (``_row_key``) -> index
        members: list[set[tuple[str, str]]] = []  # per row, the origins of its kernels
        fused_kernels: list[list[str]] = []  # per row, its kernels made from several origins
        samples: dict[bool, list[tuple[int, dict[int, int]]]] = {False: [], True: []}  # (graph, ns per row) per call
        rows_of_graph: dict[int, set[int]] = {}  # the rows each graph's kernels went to (id of its kernel list)
        starts = [(e.thread, e.start) for e in timeline]
        known = {compile_id for compile_id, _ in self.kernels.graphs}  # the graphs our post-grad pass saw
        calls = _calls(timeline)
        self.unknown_graphs = {region for _, region, _ in calls if region is not None and region not in known}
        for call, region, backward in calls:
            children = _children(timeline, starts, call)
            if region in self.unknown_graphs:
                self.unattributed_ns += sum(c.end - c.start for c in children)
                continue
            graph = kernels.get((region, backward)) if region is not None else None
            if graph is None:  # a graph not found by its id: the one whose kernels match the call's children best
                candidates = [k for (_, is_backward), k in kernels.items() if is_backward == backward]
                graph = max(candidates, key=lambda k: len(_align(children, k)), default=[])
            sample: dict[int, int] = {}
            matched = _align(children, graph)
            for child, kernel in matched:
                key = _row_key(kernel)
                if key not in rows:
                    rows[key] = len(members)
                    members.append(set())
                    fused_kernels.append([])
                members[rows[key]] |= kernel.origins
                if len(kernel.origins) > 1 and kernel.ops not in fused_kernels[rows[key]]:
                    fused_kernels[rows[key]].append(kernel.ops)
                sample[rows[key]] = sample.get(rows[key], 0) + child.end - child.start
            self.unattributed_ns += sum(c.end - c.start for c in children) - sum(c.end - c.start for c, _ in matched)
            samples[backward].append((id(graph), sample))
            rows_of_graph.setdefault(id(graph), set()).update(sample)
        self.nodes = _rows(members)
        self.fused = {info.name: kernels for info, kernels in zip(self.nodes, fused_kernels, strict=True) if kernels}
        # A row's samples: one per call of each graph with kernels of the row (0 in a call where none ran). A row
        # of backward kernels only gets zeros for forward, as many as its backward samples (the report lists rows
        # that ran forward).
        self.fwd, self.bwd = ([[s.get(i, 0) for g, s in samples[direction] if i in rows_of_graph[g]] for i in range(len(members))]
                              for direction in (False, True))
        self.fwd = [forward or [0] * len(backward) for forward, backward in zip(self.fwd, self.bwd, strict=True)]
        self.mem_delta, self.mem_peak = [[] for _ in self.nodes], [[] for _ in self.nodes]
        self.graph_calls = len(samples[False]) + len(samples[True])


def _row_key(kernel: _Kernel) -> Any:
    """A kernel from one call of the model's code goes to that call's row; one fused across calls, to the row of
    its module paths (several kernels of the same modules share it)."""
    (origin,) = kernel.origins if len(kernel.origins) == 1 else (None,)
    return origin if origin is not None else kernel.paths


def _rows(members: list[set[tuple[str, str]]]) -> list[NodeInfo]:
    """A row per member set: a module's single call is named after the module (``fc``), a module with several
    calls gets one row per call (``encoder.self_attn: multi_head_attention_forward``), a call at the top level
    is named after its function (``relu``), and a fused row after its modules (``layer1.0 + layer1.0.bn``) or,
    within one module, after its calls (``layer1.0: add + relu``)."""
    single = [next(iter(m)) for m in members if len(m) == 1]
    calls_of: dict[str, set[str]] = {}
    for path, function in single:
        calls_of.setdefault(path, set()).add(function)
    rows = []
    for origins in members:
        paths = sorted({path for path, _ in origins})
        home = _common_ancestor(paths)
        functions = " + ".join(sorted({function for _, function in origins}))
        if len(origins) == 1:
            path, function = next(iter(origins))
            name = function if path == TOP else path if len(calls_of[path]) == 1 else f"{path}: {function}"
            rows.append(NodeInfo(name, "call_function" if path == TOP else "call_module", function, home, _stack(home)))
        elif len(paths) == 1:
            rows.append(NodeInfo(f"{paths[0]}: {functions}" if paths[0] else functions, "fused", functions, home, _stack(home)))
        else:
            rows.append(NodeInfo(" + ".join(p if p != TOP else "top level" for p in paths), "fused", functions, home, _stack(home)))
    return rows


def _common_ancestor(paths: list[str]) -> str:
    """``"blocks"`` for ``["blocks.0.bn", "blocks.1.bn"]``; the top level when one path is it."""
    if TOP in paths:
        return TOP
    split = [p.split(".") for p in paths]
    common = [parts[0] for parts in itertools.takewhile(lambda parts: len(set(parts)) == 1, zip(*split))]
    return ".".join(common)


def _stack(path: str) -> tuple[str, ...]:
    parts = path.split(".") if path else []
    return tuple(".".join(parts[:i]) for i in range(1, len(parts) + 1))


def _calls(timeline: list[_Event]) -> list[tuple[_Event, str | None, bool]]:
    """Each call of a compiled graph: the event, its compile id, backward or not.

    A forward call's compile id is its innermost ``Torch-Compiled Region`` (after a graph break, the resumed
    frame's region runs inside the first one's). A backward call's is that of the forward whose autograd node
    it runs: ``CompiledFunction`` (forward) and ``CompiledFunctionBackward`` carry the same sequence number.
    """
    regions = [e for e in timeline if e.name.startswith(REGION)]
    functions = [e for e in timeline if e.name in (FORWARD, BACKWARD)]
    found, region_of_function = [], {}
    for event in sorted((e for e in timeline if e.name.startswith(CALL)), key=lambda e: e.start):
        function = next((f for f in functions if _inside(event, f)), None)
        backward = function is not None and function.name == BACKWARD
        if backward:
            region = region_of_function.get(function.sequence_nr)
        else:
            enclosing = [r for r in regions if _inside(event, r)]
            region = max(enclosing, key=lambda r: r.start).name.removeprefix(REGION) if enclosing else None
            if function is not None:
                region_of_function[function.sequence_nr] = region
        found.append((event, region, backward))
    return found


def _inside(inner: _Event, outer: _Event) -> bool:
    return inner.thread == outer.thread and outer.start <= inner.start and inner.end <= outer.end and inner is not outer


def _children(timeline: list[_Event], starts: list[tuple[int, int]], parent: _Event) -> list[_Event]:
    """The events directly inside ``parent`` (not inside another event inside it), in time order
    (``starts``: each event's thread and start, as ``timeline`` is sorted)."""
    first = bisect.bisect_left(starts, (parent.thread, parent.start))
    children: list[_Event] = []
    for event in itertools.islice(timeline, first, None):
        if event.thread != parent.thread or event.start > parent.end:
            break
        if event is parent or not _inside(event, parent):
            continue
        if children and event.start < children[-1].end:
            continue  # inside the previous child
        children.append(event)
    return children


def _align(children: list[_Event], kernels: list[_Kernel]) -> list[tuple[_Event, _Kernel]]:
    """Pair each child event with the next kernel, in call order, whose trace name it has."""
    pairs, position = [], 0
    for child in children:
        for index in range(position, len(kernels)):
            kernel = kernels[index]
            if child.name == kernel.event or (child.name.startswith("graph_") and child.name.endswith("_" + kernel.event)):
                pairs.append((child, kernel))
                position = index + 1
                break
    return pairs


def graph_breaks(before: dict[str, int] | None = None) -> dict[str, int]:
    """Dynamo's graph breaks in the process since ``before`` (its counts then), by reason: not those of another
    model compiled or captured earlier."""
    before = before or {}
    return {why: count - before.get(why, 0) for why, count in torch_api.graph_break_counts().items()
            if count > before.get(why, 0)}
