"""Activation checkpointing in Dynamo's graphs: each checkpointed region opened (its ops timed as rows of their own,
run by ``torch.utils.checkpoint`` as eager runs it) or inlined (for counting FLOPs), and its recompute in backward
logged to a row of its own."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxprof_lightning import torch_api
from fxprof_lightning.nodes import NESTS, ROW, NodeInfo, is_timed, mark_untimed
from fxprof_lightning.timing.autograd_walk import sequence_nr_now
from fxprof_lightning.timing.node_timing import NodeTimer

__all__ = ["checkpointed_bodies", "inline_checkpoints", "open_checkpoints", "recompute_log", "separate_copy"]


def separate_copy(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``graph_module`` (and of its checkpointed regions) whose nodes' ``meta`` can be changed apart."""
    copied = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph), class_name=type(graph_module).__name__)
    for node in copied.graph.nodes:
        if _is_checkpoint(node):
            setattr(copied, node.args[0].target, separate_copy(getattr(graph_module, node.args[0].target)))
    return copied


@dataclass
class _RecomputeLog:
    """What a checkpointed region's recompute reports to (``open_checkpoints``): the row ``<region>_recompute`` of
    ``timer``, whose backward time it is, taken out of the backward time of the autograd node that asked for it
    (``recomputed``: the timer's note of one, folded after the backward events). ``row`` None: backward timed by
    hooks, where a recompute is in the time of the node whose hook ran before it."""

    timer: NodeTimer
    recomputed: Callable[..., None]
    row: int | None
    first: fx.Node | None = None  # the region's first timed node, whose row keeps a reentrant region's inputs

    def add(self, sequence_nr: int, ns: int, autograd: tuple[int, int]) -> None:
        """A recompute for the autograd node ``sequence_nr`` took ``ns``; ``autograd``: the sequence numbers
        ``[first, end)`` of the autograd nodes it created (a reentrant region's own backward; else empty)."""
        if self.row is not None:
            self.recomputed(self.row, sequence_nr, ns, *autograd)

    def created(self, first: int, end: int) -> None:
        """A reentrant region ran in forward and created the autograd nodes ``[first, end)`` (its own): what they
        keep for backward (the region's inputs) is its first row's, as a non-reentrant region's inputs are."""
        if self.row is not None and self.first is not None:
            timer, row = self.timer, self.timer.samples.row(self.first)
            if timer.reads_saved():  # (made outside every row: the region's rows ran without autograd)
                timer.saved.regions = (*timer.saved.regions, (first, end, row))

    def run_timed(self, timed: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a region's timed graph for a reentrant recompute: the autograd nodes it creates are timed as the
        rows that created them; the forward samples it logs are forgotten."""
        mark = self.timer.samples.mark()
        try:
            return timed(*args, **kwargs)
        finally:
            self.timer.samples.drop_forward_since(mark)


def recompute_log(timer: NodeTimer, recomputed: Callable[..., None], hooked: bool, body: fx.GraphModule) -> _RecomputeLog:
    """The ``_RecomputeLog`` of a checkpointed region's graph: its row is named after the modules all its ops are in
    (none where backward is timed by hooks)."""
    if hooked:
        return _RecomputeLog(timer, recomputed, None)
    stacks = [info.module_stack for node in body.graph.nodes if (info := node.meta.get(ROW)) is not None]
    common = [parts[0] for parts in zip(*stacks) if len(set(parts)) == 1] if stacks else []
    path = common[-1].partition("@")[0] if common else ""
    name = f"{path.replace('.', '_')}_recompute" if path else "checkpoint_recompute"
    row = timer.samples.row_of(NodeInfo(name, "recompute", "torch.utils.checkpoint (recompute in backward)", path, tuple(common)))
    return _RecomputeLog(timer, recomputed, row, next((node for node in body.graph.nodes if is_timed(node)), None))


def _is_checkpoint(node: fx.Node) -> bool:
    op = torch_api.tag_activation_checkpoint
    return op is not None and node.op == "call_function" and node.target is op


def checkpointed_bodies(graph_module: fx.GraphModule) -> list[fx.GraphModule]:
    """The graphs of the checkpointed regions in a Dynamo graph, nested ones too."""
    bodies = [getattr(graph_module, node.args[0].target) for node in graph_module.graph.nodes if _is_checkpoint(node)]
    return [graph for body in bodies for graph in (body, *checkpointed_bodies(body))]


def open_checkpoints(graph_module: fx.GraphModule, instrumented: Callable[[fx.GraphModule], fx.GraphModule],
                     recompute_log: Callable[[fx.GraphModule], _RecomputeLog] | None = None) -> fx.GraphModule:
    """A copy of ``graph_module`` in which each checkpointed region (Dynamo's ``tag_activation_checkpoint``) runs as
    eager runs it, ``torch.utils.checkpoint.checkpoint`` with the caller's arguments (``use_reentrant``,
    ``preserve_rng_state``, ``context_fn``...), over the region's graph ``instrumented`` (its ops timed, as rows of
    their own) in forward, and over the graph as captured when backward recomputes it (a reentrant region: over the
    timed graph, see ``_checkpoint``). ``recompute_log(body)`` gives the log each recompute reports to.

    Dynamo's own eager implementation of that op is not the eager program: it checkpoints with
    ``preserve_rng_state=False`` and a selective-checkpointing policy, so dropout inside a region draws other
    numbers in the recompute, and the tensors saved for backward differ.
    """
    if not any(_is_checkpoint(node) for node in graph_module.graph.nodes):
        return graph_module
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.set_codegen(graph_module.graph._codegen)
    output = graph.graph_copy(graph_module.graph, copies)
    graph.output(output)
    bodies = []
    for node in graph.nodes:
        if not _is_checkpoint(node):
            continue
        bodies.append(node.args[0])
        body = getattr(graph_module, node.args[0].target)
        checkpoint_kwargs, body_kwargs = torch_api.tag_activation_checkpoint.divide_kwargs(node.kwargs)
        if "_checkpoint_context_fn" in body.meta:
            checkpoint_kwargs["context_fn"] = body.meta["_checkpoint_context_fn"]
        operands = node.args[1:]
        state = [i for i, operand in enumerate(operands) if _is_module_state(operand)]
        node.target = _checkpoint(instrumented(body), body, checkpoint_kwargs, state,
                                  recompute_log(body) if recompute_log is not None else None)
        node.args, node.kwargs = operands, body_kwargs
        node.meta[NESTS] = True
        mark_untimed(node)
    _erase_unused(graph, bodies)
    return fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)


def inline_checkpoints(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``graph_module`` with each checkpointed region's ops in place of the region (no checkpointing), for
    counting FLOPs and bytes per row (``flops.count_costs``): the same rows in the same order as the timed graph."""
    if not any(_is_checkpoint(node) for node in graph_module.graph.nodes):
        return graph_module
    graph = fx.Graph()
    graph.set_codegen(graph_module.graph._codegen)
    copies: dict[fx.Node, Any] = {}
    bodies = [node.args[0] for node in graph_module.graph.nodes if _is_checkpoint(node)]
    for node in graph_module.graph.nodes:
        if not _is_checkpoint(node):
            copies[node] = graph.node_copy(node, lambda n: copies[n])
            continue
        body = inline_checkpoints(getattr(graph_module, node.args[0].target))
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inputs = dict(zip(placeholders, fx.map_arg(node.args[1:], lambda n: copies[n]), strict=True))
        copies[node] = graph.graph_copy(body.graph, inputs)  # the region's outputs: a tuple, as the op returns
    _erase_unused(graph, [copies[body] for body in bodies])
    return fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)


def _erase_unused(graph: fx.Graph, bodies: list[fx.Node]) -> None:
    """Erase the regions' graph attributes that no node uses now. Not ``eliminate_dead_code``: it also erased ops
    whose result is unused but whose effect is not, BatchNorm's ``num_batches_tracked.add_(1)`` outside a region
    (the graph then differed from eager, and was refused)."""
    for node in dict.fromkeys(bodies):
        if not node.users:
            graph.erase_node(node)


def _is_module_state(operand: Any) -> bool:
    """Whether an operand of a checkpointed region is a parameter or buffer of a module (Dynamo passes them as
    graph inputs; eager's region reads them from its module, so ``checkpoint`` does not save them)."""
    if not isinstance(operand, fx.Node):
        return False
    name = torch_api.source_name(operand)
    return operand.op == "get_attr" or "._parameters[" in name or "._buffers[" in name


def _checkpoint(timed: fx.GraphModule, captured: fx.GraphModule, kwargs: dict[str, Any], state: list[int],
                recomputes: _RecomputeLog | None) -> Callable[..., Any]:
    """The call that replaces a checkpointed region (``open_checkpoints``). ``state``: the positions of the region's
    operands that are module parameters or buffers; they reach the region from outside ``checkpoint``'s arguments,
    as in eager, so that ``checkpoint`` saves the same inputs.

    A reentrant region (``use_reentrant=True``, or not given) runs forward without autograd and builds its graph in
    backward, when it recomputes: that recompute runs the timed graph, so that the autograd nodes it creates are
    timed as the rows that created them; the forward times it logs are dropped (they are the ``_recompute`` row's).
    """
    reentrant = kwargs.get("use_reentrant") is not False

    def checkpoint(*operands: Any, **body_kwargs: Any) -> Any:
        thread = threading.get_ident()  # autograd's sequence numbers count per thread
        held = {i: operands[i] for i in state}
        inputs = [operand for i, operand in enumerate(operands) if i not in held]

        def region(*passed: Any, **passed_kwargs: Any) -> Any:
            rest = iter(passed)
            args = [held[i] if i in held else next(rest) for i in range(len(operands))]
            if torch_api.current_graph_task_id() == -1:
                return timed(*args, **passed_kwargs)
            # Run by the autograd engine: backward recomputes the region for the node it is running (and may stop
            # it early with an exception once the saved tensors it needs are back).
            # (backward on another thread, CUDA's device thread: its nodes' numbers are another count, not opened)
            opened = reentrant and recomputes is not None and threading.get_ident() == thread
            first, start = sequence_nr_now(), time.perf_counter_ns()
            try:
                if opened:
                    return recomputes.run_timed(timed, *args, **passed_kwargs)
                return captured(*args, **passed_kwargs)
            finally:
                ns = time.perf_counter_ns() - start
                asking = torch_api.current_autograd_node()
                if recomputes is not None and asking is not None:
                    recomputes.add(torch_api.node_sequence_nr(asking), ns, (first, sequence_nr_now() if opened else first))

        first = sequence_nr_now()
        out = torch.utils.checkpoint.checkpoint(region, *inputs, **kwargs, **body_kwargs)
        if reentrant and recomputes is not None:
            recomputes.created(first, sequence_nr_now())
        return out

    return checkpoint
