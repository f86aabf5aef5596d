"""FLOPs, output sizes and bytes moved per FX node, counted in a separate, untimed pass on the meta device.

The pass runs the traced graph node by node (``torch.fx.Interpreter``, fine here: nothing
is timed) on a copy of the module whose parameters and buffers live on the ``meta`` device,
with meta inputs of the recorded shapes: no real computation, random states kept (a leaf may draw), no change
to the real model. ``torch.utils.flop_counter.FlopCounterMode`` counts each node's forward
ops; the backward of the sum of the outputs is counted per node with hooks on the autograd
nodes each node created. Convention: a multiply-add is 2 FLOPs (that of FlopCounterMode).

Bytes moved (``fwd_bytes``, for the roofline): an estimate of the memory traffic of one forward
call, the sizes of the tensors the node touches at its boundary: its input tensors (a ``get_attr``
parameter or buffer fed to a function is one of them), its output tensors, and, for a
``call_module`` node, every parameter and buffer of that module (its submodules' included). Each
tensor counts once however often it appears, and tensors sharing storage (views, an in-place op's
output, a parameter and its ``detach()``) count once, at the largest size seen, at most the
storage's size (an ``expand``ed tensor counts what it really holds). This is the compulsory traffic,
what an ideal cache would move: the real traffic is larger when tiles are re-read because they do not
fit in cache (large matmuls, convolutions), when a leaf module's intermediates between its own ops go
through memory (not counted), and smaller when an input is still in cache from the node before.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from fxprof_lightning import torch_api
from fxprof_lightning.nodes import is_timed
from fxprof_lightning.timing import random_states
from fxprof_lightning.timing.autograd_walk import autograd_nodes, sequence_nr_now, tensors_in

__all__ = ["NodeCosts", "bytes_moved", "count_costs", "input_signature"]


@dataclass(frozen=True)
class NodeCosts:
    """Per timed node, in graph order: forward and backward FLOPs, bytes of output tensors, bytes moved (None for
    a node the meta pass could not run).

    ``fwd_bytes`` estimates the bytes one forward call reads and writes (see the module docstring). ``failed``: the
    nodes whose pass failed, each with its error (the first, and how many more).
    """

    fwd_flops: list[int | None]
    bwd_flops: list[int | None]
    out_bytes: list[int | None]
    fwd_bytes: list[int | None]
    failed: str | None = None


def input_signature(inputs: tuple[Any, ...], training: bool) -> tuple:
    """What FLOPs depend on: shapes and dtypes of the inputs, and the mode."""
    return (training, *((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in inputs))


class _BackwardFlops:
    """Backward FLOPs of one node: how much the counter grows while each of its autograd nodes runs."""

    def __init__(self, counter: FlopCounterMode) -> None:
        self.counter = counter
        self.total = 0
        self._start = 0

    def pre(self, grad_outputs: Any) -> None:
        self._start = self.counter.get_total_flops()

    def post(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.total += self.counter.get_total_flops() - self._start


def _meta_device(value: Any) -> Any:
    """A constant of the graph on the meta device: a device, a tensor (a graph traced on an example holds some)."""
    if isinstance(value, torch.device):
        return torch.device("meta")
    return _to_meta(value)


def _to_meta(value: Any) -> Any:
    """A meta tensor of ``value``'s shape; a scalar (0-dim, no gradient) stays itself: code may read its value
    (Dynamo passes a float attribute that changed, such as a dropout rate, as one and calls ``.item()``)."""
    if isinstance(value, torch.Tensor) and value.device.type != "meta" and (value.dim() or value.requires_grad):
        return torch.empty(value.shape, dtype=value.dtype, device="meta").requires_grad_(value.requires_grad)
    return value


def _storage_key(tensor: torch.Tensor) -> int:
    """What identifies a tensor's memory: its storage (views and in-place outputs share it), else the tensor."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # no storage (sparse, some subclasses)
        return id(tensor)


def _storage_bytes(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def bytes_moved(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each storage once at the largest size seen through it (at most the storage's size)."""
    largest: dict[int, int] = {}
    for t in tensors:
        size = t.numel() * t.element_size()
        storage = _storage_bytes(t)
        if storage is not None:
            size = min(size, storage)
        key = _storage_key(t)
        largest[key] = max(largest.get(key, 0), size)
    return sum(largest.values())


HOOK_DICTS = ("hooks", "hooks_with_kwargs", "hooks_always_called")  # nn.Module's dicts of hooks, by name ending


def _unsharded_copies(root: nn.Module, memo: dict[int, Any]) -> None:
    """FSDP2's modules refuse ``deepcopy``: each is copied into ``memo`` as an instance of the user's own class,
    without FSDP2's state and hooks, innermost first (its parameters are in ``memo`` already)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return
    for module in reversed(list(root.modules())):
        if not isinstance(module, FSDPModule):
            continue
        cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
        copied = memo[id(module)] = cls.__new__(cls)
        for key, value in module.__dict__.items():
            if key.startswith("__composable_api_state_key"):  # FSDP2's state
                continue
            copied.__dict__[key] = type(value)() if key.endswith(HOOK_DICTS) else copy.deepcopy(value, memo)


def count_costs(traced: fx.GraphModule, inputs: tuple[Any, ...], training: bool) -> NodeCosts:
    """FLOPs, output bytes and bytes moved of every timed node of ``traced`` for ``inputs``, node by node.

    A node the meta pass cannot run (an op without a meta kernel, code that reads a value: ``.item()``) gets None,
    and the pass goes on with a stand-in of its output when the graph knows its shape (Dynamo's ``example_value``),
    joined to its inputs so that the backward of the nodes before it is still counted; otherwise the pass ends
    there and the nodes after it get None too. Raises only when the graph cannot be put on the meta device at all.
    """
    memo: dict[int, Any] = {}
    for p in traced.parameters():  # a sharded parameter (FSDP2's DTensor) by its whole shape
        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in traced.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    _unsharded_copies(traced, memo)
    meta_module = copy.deepcopy(traced, memo).train(training)
    for module in meta_module.modules():  # a leaf's hooks (the user's, FSDP2's) must not run in this pass
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks):
            hooks.clear()
    for node in meta_module.graph.nodes:  # devices and tensors baked in as constants become meta
        node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), _meta_device)
        if node.op == "get_attr":  # a tensor the tracer kept as an attribute (``_tensor_constant0``)
            owner, _, name = node.target.rpartition(".")
            holder = meta_module.get_submodule(owner)
            value = getattr(holder, name, None)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and name not in holder._buffers:
                setattr(holder, name, _to_meta(value))
    meta_module.recompile()
    timed = [n for n in meta_module.graph.nodes if is_timed(n)]
    position = {n: i for i, n in enumerate(timed)}
    fwd: list[int | None] = [None] * len(timed)
    out_bytes: list[int | None] = [None] * len(timed)
    moved: list[int | None] = [None] * len(timed)
    backward_counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)
    backward: list[_BackwardFlops | None] = [_BackwardFlops(backward_counter) for _ in timed]
    failures: list[str] = []  # what the pass could not run, each with its error
    failed_nodes: set[str] = set()

    class Counter(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            read = tensors_in(list(args)) + tensors_in(dict(kwargs))
            if node not in position:  # (a value read on the host, ``.item()``, is not a row of its own)
                try:
                    return super().run_node(node)
                except Exception as error:
                    failures.append(_failure(node, error))
                    return _stand_in(node, read)
            i = position[node]
            if node.op == "call_module":
                module = self.fetch_attr(node.target)
                read += [*module.parameters(), *module.buffers()]
            first = sequence_nr_now()
            try:
                with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
                    output = super().run_node(node)
            except Exception as error:
                failures.append(_failure(node, error))
                failed_nodes.add(node.name)
                backward[i] = None
                return _stand_in(node, read)
            fwd[i] = counter.get_total_flops()
            out_bytes[i] = sum(t.numel() * t.element_size() for t in tensors_in(output))
            moved[i] = bytes_moved(read + tensors_in(output))
            for fn in autograd_nodes([t.grad_fn for t in tensors_in(output)], first, sequence_nr_now()):
                fn.register_prehook(backward[i].pre)
                fn.register_hook(backward[i].post)
            return output

    # Host random numbers a leaf or a node draws are put back; tensors the code makes with no device are meta too.
    with torch.enable_grad(), random_states.kept(), torch.device("meta"), float_grouped_mm_meta(), \
            torch_api.enable_python_dispatcher():
        interpreter = Counter(meta_module)
        try:
            ends = tensors_in(interpreter.run(*(_to_meta(x) for x in inputs)))
        except _NoStandIn:  # the pass ended at a node: the backward of what ran, from every value it made
            ends = tensors_in(list(interpreter.env.values()))
        loss = sum(t.float().sum() for t in ends if t.requires_grad and t.is_floating_point())
        if isinstance(loss, torch.Tensor):
            try:
                with backward_counter:
                    loss.backward()
            except Exception as error:  # an op's backward without a meta kernel: no backward FLOPs, forward kept
                failures.append(f"the backward ({type(error).__name__}: {_first_line(error)})")
                backward = [None] * len(timed)
    unreached = sum(1 for i, n in enumerate(timed) if fwd[i] is None and n.name not in failed_nodes)
    failed = "; ".join(filter(None, [
        failures[0] + (f" and {len(failures) - 1} more" if len(failures) > 1 else "") if failures else None,
        f"{unreached} node(s) after it not reached" if unreached else None]))
    return NodeCosts(fwd, [b.total if b is not None else None for b in backward], out_bytes, moved, failed or None)


def _failure(node: fx.Node, error: Exception) -> str:
    return f"{node.name} ({type(error).__name__}: {_first_line(error)})"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


class _NoStandIn(Exception):
    """A node failed in the meta pass and the graph does not say the shape of its output."""


def _stand_in(node: fx.Node, read: list[torch.Tensor]) -> Any:
    """Meta tensors shaped as ``node``'s output (from Dynamo's ``example_value``), each joined in autograd to the
    node's inputs that need a gradient (``+ 0 * sum``: the backward of the nodes before it still runs)."""
    example = node.meta.get("example_value", node.meta.get("val"))
    if example is None:
        raise _NoStandIn(node.name)
    needs_grad = [t for t in read if t.requires_grad and t.is_floating_point()]

    def one(value: Any) -> Any:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # a value read on the host
            raise _NoStandIn(node.name)
        if not isinstance(value, torch.Tensor):
            return value
        if not all(isinstance(n, int) for n in (*value.shape, *value.stride())):  # symbolic shapes
            raise _NoStandIn(node.name)
        tensor = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
        if needs_grad and tensor.is_floating_point() and value.requires_grad:
            tensor = tensor + 0 * sum(t.sum() for t in needs_grad)
        return tensor

    return fx.node.map_aggregate(example, one)


def _grouped_mm_flops(a_shape: torch.Size, b_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    """``aten._grouped_mm``: each row (or column, for a weight's gradient) of ``a`` meets one group's matrix."""
    return 2 * math.prod(a_shape) * b_shape[-1]


# FLOP formulas torch's counter lacks (``FlopCounterMode(custom_mapping=...)``: only our own counts use them).
EXTRA_FORMULAS = {op: _grouped_mm_flops for op in (torch_api.grouped_mm,) if op}


def _grouped_mm_meta(original: Callable[..., Any]) -> Callable[..., Any]:
    def meta(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if mat_a.dtype in (torch.float32, torch.float64) and mat_b.dtype == mat_a.dtype and bias is None:
            dtype = out_dtype or mat_a.dtype
            if mat_a.dim() == 2 and mat_b.dim() == 3:  # the experts' forward: each row by its group's matrix
                return mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]), dtype=dtype)
            if mat_a.dim() == 2 and mat_b.dim() == 2 and offs is not None:  # their weights' gradient: one per group
                return mat_a.new_empty((offs.shape[0], mat_a.shape[0], mat_b.shape[-1]), dtype=dtype)
        return original(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    return meta


@contextlib.contextmanager
def float_grouped_mm_meta() -> Iterator[None]:
    """Inside the block, under the Python dispatcher (Dynamo's tracing, ``count_costs``), ``aten._grouped_mm`` has a
    meta kernel for float32/float64 inputs (the MoE experts' forward and backward): torch's allows bfloat16 and
    float16 only, as the CUDA kernel does, while the CPU kernel computes float32 too. HF's MoE experts (Mixtral) call
    it on CPU in float32; without this Dynamo cannot trace them and FLOPs cannot be counted. The kernel gives the
    output's shape and dtype only. Only the op's Python kernel is swapped (no ``torch.library`` registration, which
    leaves fake tensors accepting float32 after it is destroyed), and put back after."""
    op = torch_api.grouped_mm
    kernels = getattr(getattr(op, "default", None), "py_kernels", None)
    key = torch_api.META_KEY
    if kernels is None or key is None or key not in kernels:
        yield
        return
    original = kernels[key]
    kernels[key] = _grouped_mm_meta(original)  # read under the Python dispatcher (Dynamo's tracing; ``count_costs``)
    op.default._dispatch_cache.clear()
    try:
        yield
    finally:
        kernels[key] = original
        op.default._dispatch_cache.clear()
        _forget_cached(op.default)


def _forget_cached(op: Any) -> None:
    """Drop the fake-tensor cache's entries for ``op``: made while its kernel was swapped, they would answer later
    fake calls with the same inputs (float32 ``_grouped_mm`` accepted where torch's kernel refuses it)."""
    cache = getattr(torch_api.FakeTensorMode, "cache", {})
    for cached in [cached for cached in cache if getattr(cached, "key", (None,))[0] is op]:
        del cache[cached]

