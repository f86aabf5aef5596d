"""``FxNodeTimer``: ``NodeTimer`` over one graph traced by torch.fx (``torch.fx.symbolic_trace``), installed as the
module's forward. The package captures with Dynamo (``capture.dynamo``); this timer times a traced graph alone, for
the tests of the timing code and the benchmarks that measure it without Dynamo's call around it."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from fxprof_lightning.timing.autograd_walk import sequence_nr_now
from fxprof_lightning.timing.flops import NodeCosts, count_costs, input_signature
from fxprof_lightning.timing.forward_swap import put_forward
from fxprof_lightning.timing.node_timing import NodeTimer

if TYPE_CHECKING:
    from fxprof_lightning.nodes import Capture

__all__ = ["FxNodeTimer"]


class FxNodeTimer(NodeTimer):
    """An instrumented copy of a traced module that records each node's forward and backward time.

    Args:
        traced: the ``GraphModule`` from ``symbolic_trace``.
        The rest as ``NodeTimer``.

    Example:
        >>> timer = FxNodeTimer(fx.symbolic_trace(model))
        >>> events = BackwardEvents(); events.start()
        >>> timer.install(model); model(x).sum().backward(); timer.uninstall(model)
        >>> timer.add_backward(events.stop())
        >>> timer.samples.nodes[0].name, timer.samples.fwd[0], timer.samples.bwd_ns(0)
    """

    def __init__(self, traced: fx.GraphModule, annotate: bool = False, backward: bool = True, device: str = "cpu",
                 trace_ranges: bool = False) -> None:
        super().__init__(annotate=annotate, backward=backward, device=device, trace_ranges=trace_ranges)
        self._traced = traced
        self._costs: dict[tuple, NodeCosts | None] = {}  # per input signature (``costs``)
        self.graph_module = self._instrument(traced, annotate, hooked=self._cuda)
        self._hooked_graph_module = self.graph_module if self._cuda else None  # built when first needed

    def install(self, module: nn.Module, backward_hooks: bool = False) -> None:
        """Make ``module(...)`` run the instrumented graph until ``uninstall`` (calls in the other
        train/eval mode than the graph's run the module's own forward).

        ``backward_hooks``: time backward with hooks (as on CUDA) rather than from profiler events.
        """
        if id(module) in self._saved_forward:
            return
        if backward_hooks and self._hooked_graph_module is None:
            self._hooked_graph_module = self._instrument(self._traced, self._annotate, hooked=True)
        self._root, self._hooks_now = module, backward_hooks
        own_forward, graph_forward = module.forward, (self._hooked_graph_module if backward_hooks else self.graph_module).forward
        training = self._traced.training

        def forward(*args: Any, **kwargs: Any) -> Any:
            # The graph holds the mode it was traced in (dropout, batch norm): a call in the other mode
            # (an evaluation inside a training step of a plain loop) runs the module's own forward.
            if module.training is not training:
                return own_forward(*args, **kwargs)
            if self._cuda:
                return graph_forward(*args, **kwargs)
            start, first = time.perf_counter_ns(), sequence_nr_now()
            if self._trace_ranges:
                self.samples.call_starts.append(start)
            with self.saved.noting_hooks(self.reads_saved()):
                out = graph_forward(*args, **kwargs)
            self.samples.forward_walls_ns.append(time.perf_counter_ns() - start)
            self.saved.read(out, first, self._root, self.reads_saved())
            return out

        self._saved_forward[id(module)] = put_forward(module, forward)

    def costs(self, training: bool) -> NodeCosts | None:
        """FLOPs and output sizes per node for the first call's inputs since ``reset``, counted once per input
        signature in an untimed meta-device pass (None when nothing can be counted; ``costs_error`` says why
        counting failed)."""
        inputs = self.samples.forward_inputs
        if self._traced is None or inputs is None:
            return None
        key = input_signature(inputs, training)
        if key not in self._costs:
            try:
                self._costs[key] = count_costs(self._traced, inputs, training)
                if self._costs[key].failed:
                    self.costs_error = f"for {self._costs[key].failed}"
            except Exception as error:  # the graph cannot go to the meta device: no FLOPs, timing goes on
                self.costs_error = f"for the whole graph ({type(error).__name__}: {error})"
                self._costs[key] = None
        return self._costs[key]

    def describe(self, capture: Capture) -> Capture:
        """A cycle report's own copy of how the module was captured, with what the timer learnt meanwhile: the
        module calls of the graph that time a module with children whole are named in ``leaves`` (torch.fx keeps
        ``torch.nn`` modules such as ``nn.MultiheadAttention`` or ``nn.Transformer`` as one call)."""
        leaves = dict(capture.leaves)
        if self._traced is not None:
            for node in self._traced.graph.nodes:
                if node.op != "call_module" or node.target in leaves:
                    continue
                module = self._traced.get_submodule(node.target)
                if next(module.children(), None) is not None:
                    leaves[node.target] = (f"{type(module).__name__} has submodules: torch.fx calls a torch.nn module "
                                           "as one node (a leaf by default); capture='dynamo' opens it")
        return replace(capture, leaves=leaves)
