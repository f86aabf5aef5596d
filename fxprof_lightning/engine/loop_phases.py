"""``LoopClock``: where a plain loop's recorded steps go, from the module's own calls (see ``step_phases``)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.timing.autograd_walk import tensors_in

__all__ = ["LoopClock"]


class LoopClock:
    """The phases of a plain loop's steps from the module's calls (``step_phases``: forward, backward, fxprof, other),
    from ``LoopClock(...)`` on: a forward pre-hook and two forward hooks on the module, and a hook on each call's first
    output that needs a gradient (it returns None: the gradient is untouched). ``lap()`` returns ns per phase since the last lap;
    ``ours()`` says the time since the last lap was the profiler's own (the rest of its ``step()``); ``close()``
    removes the module's hooks.

    The module's own hooks are inside the phases: the pre-hook runs before the module's other pre-hooks and the hook
    after its other hooks (FSDP2's unshard and reshard of the root are the forward's); the gradient's hook is put on
    the output before the module's other hooks put theirs (FSDP2's pre-backward all-gather of the root is the
    backward's), and the backward ends after the callbacks queued during the pass (FSDP2's reduce-scatter of the
    root, at the end of backward). A forward hook of the user's that returns another output gets that output's
    gradient hooked too (the first to arrive starts the backward)."""

    def __init__(self, module: nn.Module) -> None:
        self._handles = [module.register_forward_pre_hook(self._pre, prepend=True),
                         module.register_forward_hook(self._output, prepend=True), module.register_forward_hook(self._post)]
        self._forward = self._backward = self._ours = 0
        self._started: int | None = None  # the module call in progress
        self._hooked: torch.Tensor | None = None  # the call's output whose gradient is hooked (until the call ends)
        self._backward_from: int | None = None  # the backward pass in progress
        self._last = time.perf_counter_ns()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch_api.current_graph_task_id() == -1:  # (not a recomputation inside backward)
            self._started = time.perf_counter_ns()

    def _output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._started is not None:
            self._hook_gradient(output)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._started is None:
            return
        if self._hooked is None or not any(t is self._hooked for t in tensors_in(output)):  # (a hook replaced it)
            self._hook_gradient(output)
        self._forward += time.perf_counter_ns() - self._started
        self._started, self._hooked = None, None

    def _hook_gradient(self, output: Any) -> None:
        if torch.is_grad_enabled():
            needs_grad = next((t for t in tensors_in(output) if t.requires_grad), None)
            if needs_grad is not None:
                needs_grad.register_hook(self._gradient_arrives)
                self._hooked = needs_grad

    def _gradient_arrives(self, grad: torch.Tensor) -> None:
        if self._backward_from is None:
            self._backward_from = time.perf_counter_ns()
            torch_api.queue_callback(self._end_last)

    def _end_last(self) -> None:
        """Queued again from inside the engine's callbacks, so that it runs after those queued during the pass."""
        torch_api.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._backward += time.perf_counter_ns() - self._backward_from
        self._backward_from = None

    def ours(self) -> None:
        """The time since the last lap was the profiler's: the next lap's ``fxprof`` phase, not the loop's other."""
        now = time.perf_counter_ns()
        self._ours += now - self._last
        self._last = now

    def lap(self) -> dict[str, int]:
        now = time.perf_counter_ns()
        phases = {"forward": self._forward, "backward": self._backward, "fxprof": self._ours}
        phases["other"] = max(now - self._last - self._forward - self._backward, 0)
        self._forward = self._backward = self._ours = 0
        self._last = now
        return phases

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
