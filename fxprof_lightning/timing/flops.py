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

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from fxprof_lightning.nodes import is_timed
from fxprof_lightning.timing.autograd_walk import autograd_nodes, random_states_kept, sequence_nr_now, tensors_in

__all__ = ["NodeCosts", "bytes_moved", "count_costs", "input_signature"]


@dataclass(frozen=True)
class NodeCosts:
    """Per timed node, in graph order: forward and backward FLOPs, bytes of output tensors, bytes moved.

    ``fwd_bytes`` estimates the bytes one forward call reads and writes (see the module docstring).
    """

    fwd_flops: list[int]
    bwd_flops: list[int]
    out_bytes: list[int]
    fwd_bytes: list[int]


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
    return torch.device("meta") if isinstance(value, torch.device) else value


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
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


def count_costs(traced: fx.GraphModule, inputs: tuple[Any, ...], training: bool) -> NodeCosts:
    """FLOPs, output bytes and bytes moved of every timed node of ``traced`` for ``inputs``.

    Raises whatever the meta pass raises (an op without a meta kernel, data-dependent code).
    """
    memo: dict[int, Any] = {}
    for p in traced.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in traced.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    meta_module = copy.deepcopy(traced, memo).train(training)
    for module in meta_module.modules():  # a leaf's hooks (the user's, FSDP2's) must not run in this pass
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks):
            hooks.clear()
    for node in meta_module.graph.nodes:  # devices baked in as constants (a graph traced on an example) become meta
        node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), _meta_device)
    meta_module.recompile()
    timed = [n for n in meta_module.graph.nodes if is_timed(n)]
    position = {n: i for i, n in enumerate(timed)}
    fwd = [0] * len(timed)
    out_bytes = [0] * len(timed)
    moved = [0] * len(timed)
    backward_counter = FlopCounterMode(display=False)
    backward = [_BackwardFlops(backward_counter) for _ in timed]

    class Counter(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            if node not in position:
                return super().run_node(node)
            i = position[node]
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            read = tensors_in(list(args)) + tensors_in(dict(kwargs))
            if node.op == "call_module":
                module = self.fetch_attr(node.target)
                read += [*module.parameters(), *module.buffers()]
            first = sequence_nr_now()
            with FlopCounterMode(display=False) as counter:
                output = super().run_node(node)
            fwd[i] = counter.get_total_flops()
            out_bytes[i] = sum(t.numel() * t.element_size() for t in tensors_in(output))
            moved[i] = bytes_moved(read + tensors_in(output))
            for fn in autograd_nodes([t.grad_fn for t in tensors_in(output)], first, sequence_nr_now()):
                fn.register_prehook(backward[i].pre)
                fn.register_hook(backward[i].post)
            return output

    with torch.enable_grad(), random_states_kept():  # a leaf or a graph node may draw host random numbers
        outputs = tensors_in(Counter(meta_module).run(*(_to_meta(x) for x in inputs)))
        loss = sum(t.float().sum() for t in outputs if t.requires_grad and t.is_floating_point())
        if isinstance(loss, torch.Tensor):
            with backward_counter:
                loss.backward()
    return NodeCosts(fwd, [b.total for b in backward], out_bytes, moved)
