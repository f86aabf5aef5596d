"""Timing a graph traced on an example safely (``GuardedNodeTimer``): a call the graph does not fit runs the
module's own forward, and the graph is given up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture.leaves import HOST_RANDOM, FunctionApply, short_error
from fxprof_lightning.timing import random_states
from fxprof_lightning.timing.node_timing import NodeTimer

__all__ = ["GuardedNodeTimer"]


class GuardedNodeTimer(NodeTimer):
    """``NodeTimer`` for a graph traced on an example: a call the graph does not fit runs the module's own forward.

    ``install`` makes ``module.forward`` a wrapper that saves the random state (CPU, and CUDA on
    CUDA; NumPy's and Python's too when the graph draws host random numbers) and runs the instrumented graph. If the graph raises (a guard failed: the call takes
    another path than the example; or any other error), the wrapper restores the random state
    and the grad mode, discards everything the timer recorded (``reset``), runs the module's own forward with the
    same arguments and returns its result; ``mismatch`` then says why, ``on_mismatch`` is told,
    and later calls run the module's own forward without the graph. ``uninstall`` gives the
    module its own forward back, as ``NodeTimer`` does.

    Residual risk: work the graph did before the failing guard is not undone, except the random
    state. A module that changes a buffer in place ahead of a guard (batch-norm running
    statistics) would see that update twice; forward hooks of submodules that ran before the
    guard run twice. HuggingFace models put their guards ahead of such work, or have none.

    Args:
        traced: the graph from ``trace_on_example``.
        annotate, backward, device, trace_ranges: as for ``NodeTimer``.
        on_mismatch: called once, with the reason, when a call does not fit the graph.
    """

    def __init__(self, traced: fx.GraphModule, annotate: bool = False, backward: bool = True, device: str = "cpu",
                 on_mismatch: Callable[[str], None] | None = None, trace_ranges: bool = False) -> None:
        super().__init__(traced, annotate=annotate, backward=backward, device=device, trace_ranges=trace_ranges)
        self.mismatch: str | None = None
        self._on_mismatch = on_mismatch
        # NumPy's state costs ~30 us to save: only for a graph that draws host random numbers.
        # Also for a leaf of the model's own code or a custom autograd Function, which may draw them.
        self._host_random = any(node.meta.get(HOST_RANDOM) or isinstance(node.target, FunctionApply)
                                or (node.op == "call_module"
                                    and not type(traced.get_submodule(node.target)).__module__.startswith("torch."))
                                for node in traced.graph.nodes)

    def install(self, module: nn.Module, **options: Any) -> None:
        """``NodeTimer.install`` (same ``options``), with the graph's forward inside the guarded wrapper."""
        if id(module) in self._saved_forward:
            return
        own_forward = module.forward
        super().install(module, **options)
        graph_forward = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.mismatch is None and module.training is self._traced.training:  # only the graph's errors are caught
                random_state = random_states.save(cuda=self.on_cuda, host=self._host_random, every_device=False)
                grad_mode = torch.is_grad_enabled()
                try:
                    return graph_forward(*args, **kwargs)
                except Exception as error:  # the graph does not fit this call: it must not cost the user anything
                    random_states.restore(random_state)
                    torch_api.set_grad_enabled(grad_mode)  # a guard inside a no_grad block
                    self._stop_using_graph(short_error(error))
            return own_forward(*args, **kwargs)

        module.forward = forward

    def _stop_using_graph(self, reason: str) -> None:
        self.mismatch = reason
        self.reset()
        if self._on_mismatch is not None:
            with contextlib.suppress(Exception):  # a warning turned into an error must not reach training
                self._on_mismatch(reason)
