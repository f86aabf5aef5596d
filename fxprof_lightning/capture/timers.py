"""Which timer times the module, and what every timer answers (``Timer``).

A timer times one train/eval mode of the module. ``Timers.for_module`` picks it on the mode's first use and keeps it:

* a ``torch.compile``'d module: ``KernelTimer`` (``compiled``), its rows read from the cycle's trace;
* ``ModuleHookTimer`` (module hooks: a row per module call) where Dynamo cannot be used: this torch lacks what the
  capture needs (``missing_for_dynamo``: the user is warned once, with the torch version), or the module is sharded
  by FSDP2 and this torch's FSDP2 lacks the state the capture's checking calls put back (``fsdp2_kept``: warned too);
* else ``DynamoTimer`` (``dynamo``), which captures at its first call and again when a guard fails (FSDP2's
  hooks run eagerly between its graphs).

A timer that stops fitting the calls (``usable`` False: a Dynamo capture refused) is replaced by module hooks for
that mode.

``capture`` is an option with one value left, ``"dynamo"`` (``CAPTURES``); ``check_capture`` refuses the others,
and says what became of ``"fx"`` (the torch.fx capture, removed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture.children import ChildTimers, timed_children
from fxprof_lightning.capture.compiled import MECHANISM, CompiledKernels, KernelTimer
from fxprof_lightning.capture.dynamo import DYNAMO, DynamoTimer, missing_for_dynamo
from fxprof_lightning.capture.module_hooks import ModuleHookTimer
from fxprof_lightning.capture.verify import fsdp2_kept, is_fsdp
from fxprof_lightning.nodes import Capture
from fxprof_lightning.timing.forward_swap import own_class
from fxprof_lightning.timing.readings import Collected, Progress, Traits

__all__ = ["CAPTURES", "Timer", "Timers", "check_capture"]

# The code objects Dynamo first saw in a run of ours (ids): each run's end lets go of the skips it made in them.
_CAPTURED_CODES: set[int] = set()

CAPTURES = ("dynamo",)


def _no_forward(module: nn.Module) -> bool:
    """Whether ``module`` has no forward of its own: torch's, which raises, or the LightningModule's, which calls it."""
    forward = own_class(module).forward
    return forward is nn.Module.forward or getattr(forward, "__qualname__", "") == "LightningModule.forward"


def check_capture(capture: str) -> None:
    """Refuse a ``capture`` option other than ``"dynamo"``; ``"fx"`` is told that the torch.fx capture is gone."""
    if capture == "fx":
        raise ValueError("capture='fx' is no longer an option: the torch.fx capture was removed, and the Dynamo "
                         "capture (the default) works on torch 2.6 and newer. Drop the capture argument.")
    if capture not in CAPTURES:
        raise ValueError(f"capture must be one of {', '.join(map(repr, CAPTURES))}, got {capture!r}")


class Timer(Protocol):
    """What the engine asks of a timer (``NodeTimer`` and its ``DynamoTimer``;
    ``ModuleHookTimer``, ``KernelTimer``), all of it read as values (``timing.readings``): the engine writes into no
    timer. ``NodeTimer`` makes ``traits``, ``progress`` and ``collected`` from its parts, ``Uninterrupted`` for the
    timers that capture nothing. (``Timers``, which
    makes the timers, also asks a timer that stopped fitting for its ``refusal``: the capture side's, not the engine's.)
    """

    @property
    def traits(self) -> Traits:
        """What kind of timer it is (where its backward times and rows come from)."""

    @property
    def progress(self) -> Progress:
        """How far it got: calls, whether it still fits them, interruptions, captures."""

    def install(self, module: nn.Module, backward_hooks: bool = False) -> None:
        """Time the module's calls until ``uninstall`` (``backward_hooks``: time backward with hooks, not events)."""

    def uninstall(self, module: nn.Module) -> None: ...

    def reset(self) -> None:
        """Forget every sample (the warm-up steps', the last cycle's)."""

    def save_point(self) -> Callable[[], None]:
        """A function that forgets the samples logged after this call (a recorded step that was interrupted)."""

    def collected(self, backward: list[tuple[int, int]], trace_events: list[Any], training: bool) -> Collected | str:
        """The cycle's samples from its backward events (and trace events), or why nothing was timed."""

    def node_ranges(self) -> Any:
        """What ``torch_trace.add_node_ranges`` writes into the cycle's trace (anchors, node spans, their autograd sequence
        ranges, the starts of the forward calls, each node's module stack: ``NodeTimer.node_ranges``), or None."""

    def describe(self, capture: Capture) -> Capture:
        """A report's own copy of ``capture``, with what the timer learnt meanwhile."""


class Timers:
    """One timer per train/eval mode of the module, chosen at the mode's first use (see the module docstring).

    Args:
        warn: tells the user (rank 0) about a fallback or a refused graph.
    """

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.capture, self.backward, self.ranges, self.memory = "dynamo", True, False, True
        self.compiled: CompiledKernels | None = None  # a compiled module: the Inductor settings its kernels need
        self._kernels: CompiledKernels | None = None  # kept for the process: graphs compiled in earlier runs
        self._timers: dict[bool, tuple[Timer, Capture]] = {}
        self._told_missing = False  # the user was told that this torch cannot capture with Dynamo
        self._codes: set[int] | None = None  # the code objects Dynamo had seen when the run started (ids)
        # A LightningModule chosen for its forward (the callback without module=) whose training step calls its
        # children instead: they are timed from the step after the warm-up step its forward sat out.
        self.children_when_unused = False

    def start(self, capture: str, backward: bool, ranges: bool, compiled: bool, memory: bool = True) -> None:
        """A new run: forget every capture.

        Args:
            capture: ``"dynamo"`` (``CAPTURES``).
            backward: time each node's backward too.
            ranges: timers keep what writes a range per node into the trace (module hooks open a range per call).
            compiled: the module is torch.compile'd: its kernels are followed from before its first call (the
                kernels of graphs an earlier run compiled are remembered).
            memory: timers read what autograd saves for backward per row (``saved_memory``), once per cycle.
        """
        check_capture(capture)
        self.stop()
        self.capture, self.backward, self.ranges, self.memory = capture, backward, ranges, memory
        self._timers, self._told_missing = {}, False
        self._codes = torch_api.codes_unskipped()
        if compiled:
            self._kernels = self._kernels or CompiledKernels()
            self._kernels.start()
        self.compiled = self._kernels if compiled else None

    def stop(self) -> None:
        """Put Inductor's settings back; where Dynamo skips a frame's code for good (< 2.8), the codes it first saw in
        the run not skipped any more: a later model in the process is captured as if this run had not been."""
        if self.compiled is not None:
            self.compiled.stop()
        if self._codes is not None:  # (those of an earlier run too: this one may have skipped them again)
            _CAPTURED_CODES.update(torch_api.codes_unskipped(self._codes - _CAPTURED_CODES) - self._codes)
            self._codes = None

    @property
    def chosen(self) -> dict[bool, tuple[Timer, Capture]]:
        """The timer and capture of each train/eval mode chosen so far (``True``: training)."""
        return dict(self._timers)

    def for_module(self, module: nn.Module) -> tuple[Timer, Capture]:
        """The timer of the module's current mode, chosen on first use; module hooks once its graph stopped fitting."""
        training = module.training
        entry = self._timers.get(training)
        if entry is None:
            entry = self._timers[training] = self._choose(module)
        elif not entry[0].progress.usable:
            timer, how = entry
            before = timer.describe(how)  # the captures made until then, and why
            entry = self._timers[training] = (self._hook_timer(module), Capture("module_hooks", None, {}, timer.refusal(how),
                                                                                 recaptures=before.recaptures))
        return entry

    def _choose(self, module: nn.Module) -> tuple[Timer, Capture]:
        if self.compiled is not None:
            return KernelTimer(self.compiled), Capture("compiled", error=MECHANISM)
        name = type(module).__name__
        if _no_forward(module):  # (a LightningModule whose training step calls several children: a GAN's two)
            return self._each_child(module)
        missing = missing_for_dynamo()
        if missing:
            if not self._told_missing:
                self._told_missing = True
                self.warn(f"torch {torch.__version__} lacks what the Dynamo capture needs ({missing}; torch 2.14 has "
                          f"it), so the layers of {name} are timed by module hooks instead")
            return self._hook_timer(module), Capture("module_hooks", error=f"torch {torch.__version__}: {missing}")
        sharded = any(is_fsdp(m) for m in module.modules())
        if sharded and not fsdp2_kept():
            why = f"torch {torch.__version__}'s FSDP2 lacks the state a checking call of the capture must put back"
            self.warn(f"{name} is sharded by FSDP2 and {why}, so its layers are timed by module hooks")
            return self._hook_timer(module), Capture("module_hooks", error=why)
        device = next(module.parameters(), None)
        device = device.device.type if device is not None else "cpu"
        # The node ranges are written into the trace after it is exported (``add_node_ranges``), from the node
        # timestamps; on CUDA the trace's kernels then give each node its device time (``gpu_trace``).
        # FSDP2's hooks are ``torch._dynamo.disable``d: each breaks the graph, and a break inside a loop (blocks
        # called in a loop) makes Dynamo run that frame eagerly; following torch's own frames then captures the
        # forward of each torch.nn layer that frame calls (the sharded blocks' own forwards are captured anyway).
        timer = DynamoTimer(module.training, backward=self.backward, device=device, trace_ranges=self.ranges,
                            on_refused=functools.partial(self._refused, module, module.training), sharded=sharded)
        timer.measure_memory = self.memory
        return timer, Capture("dynamo", error=DYNAMO)

    def children_instead(self, module: nn.Module) -> tuple[Timer, Capture] | None:
        """The module's forward did not run in a warm-up step (``children_when_unused``: a LightningModule whose
        ``training_step`` calls ``self.model`` itself): its children with parameters are timed instead, for its
        current mode, from now on (``_each_child``); None where that does not apply (once per mode, and never once
        the forward has run: it was captured then)."""
        chosen = self._timers.get(module.training)
        if not self.children_when_unused or chosen is None or chosen[1].method != "dynamo" \
                or isinstance(chosen[0], ChildTimers) or chosen[0].progress.capture_s or not timed_children(module):
            return None  # (the forward's timer was uninstalled at the end of that step)
        entry = self._timers[module.training] = self._each_child(
            module, f"{type(module).__name__}.forward did not run in the warm-up step (its training step calls its "
                    "children)")
        return entry

    def _each_child(self, module: nn.Module, why: str = "") -> tuple[Timer, Capture]:
        """A module with no forward of its own (or one its steps do not call: ``why``): each child with parameters
        captured on its own by Dynamo, where every child can be (``ChildTimers``), else the module by module hooks,
        module by module. Below torch 2.14, Dynamo does not guard on the parameters' ``requires_grad``, which a
        LightningModule that optimizes by hand flips at every step (``toggle_optimizer``: a GAN's two optimizers);
        each flip would mean a capture, so module hooks."""
        name, children = type(module).__name__, timed_children(module)
        why = why or f"{name} has no forward of its own"
        if not torch_api.PARAMETER_FLAGS_GUARDED and getattr(module, "automatic_optimization", True) is False:
            return self._hook_timer(module), Capture("module_hooks", error=(
                f"{why} and {name} optimizes by hand: toggle_optimizer flips its parameters' "
                f"requires_grad at every step, which torch {torch.__version__}'s Dynamo does not guard on (2.14 does), "
                "so the child modules its steps call are timed by module hooks, module by module"))
        timers = {child: self._choose(part)[0] for child, part in children.items()} if not missing_for_dynamo() else {}
        if timers and all(isinstance(timer, DynamoTimer) for timer in timers.values()):
            return ChildTimers(children, timers), Capture("dynamo", error=(
                f"{DYNAMO}; {why}: each child its steps call ({', '.join(children)}) is captured on its own"))
        return self._hook_timer(module), Capture("module_hooks", error=(
            f"{why}, and not every child of {name} can be captured on its own: the child modules its steps call are "
            "timed by module hooks, module by module (module= picks one child for the Dynamo capture)"))

    def _hook_timer(self, module: nn.Module) -> ModuleHookTimer:
        return ModuleHookTimer(module, annotate=self.ranges)

    def _refused(self, module: nn.Module, training: bool, reason: str) -> None:
        mode = "training" if training else "evaluation"
        # (a graph that is the program eager runs but misses its guards at every call cannot be used either)
        verdict = ("cannot be used" if reason.startswith("the graphs missed Dynamo's guards") else
                   "cannot be captured again" if "captured once" in reason else "is not the program eager runs")
        self.warn(
            f"the graph Dynamo captured of {type(module).__name__} ({mode} mode) {verdict}: "
            f"{reason}. That call and every later one run the module's own forward, so training is unchanged; "
            f"{mode} steps are timed by module hooks from now on (a cycle that had already recorded steps with the "
            "graph reports no node times)."
        )

