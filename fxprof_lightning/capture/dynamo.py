"""The sound capture: Dynamo (``torch._dynamo``, the frontend of ``torch.compile``) captures the module's forward,
a backend of ours times each captured graph node by node and runs it eagerly (no Inductor).

Why Dynamo: it captures the program eager runs. It guards on what the traced code read (every submodule's
``training`` flag, attributes, module identity, hooks, input types and shapes, grad mode, autocast), keeps buffer
mutations (batch-norm statistics) in the graph, answers ``isinstance``/``torch.is_tensor`` truthfully (fake
tensors), keeps ``torch.utils.checkpoint`` as a higher-order op, inlines ``torch.nn`` modules (composite ones
too: ``TransformerEncoderLayer`` is opened), and breaks the graph where it cannot go on instead of failing.

``DynamoTimer`` (a ``NodeTimer`` over every graph Dynamo hands it) adds what Dynamo does not promise:

* **Verified before trusted**, forward and backward. The call that captures runs the module's own forward and
  then the captured graphs on the same input and state (buffers and random states put back in between and
  after), each followed by ``torch.autograd.grad`` with the same cotangents; outputs, gradients of the
  parameters and inputs, buffers after the call, random states, and the number and bytes of tensors saved for
  backward must be bitwise equal. Any difference refuses the graphs (``mismatch`` names the first differing
  tensor) and that call, like every later one, runs the module's own forward. ``.grad`` is never touched.
* **Never stale.** Before a timed call the guards of the forward's frame are asked (``EntryGuards``): a call in a
  state no capture fits is captured (and verified) on that call, with the reason Dynamo gives (``recaptures``).
  Where the capture is one graph of that frame, the code Dynamo made for the fitting state then runs directly;
  else the call goes through Dynamo under its ``eager_on_recompile`` stance, and a frame after a graph break whose
  guards fail runs eagerly (untimed) rather than a graph of another state, and the next call captures again.
* Its own cache (``isolate_recompiles``, or a copy of the forward's code object on a torch without it:
  ``torch_api.own_code``): the user's ``torch.compile`` of the same code is untouched.
* Quiet: what Dynamo logs or warns in our calls through it (graph-break hints, recompiles) goes into the capture's
  record (``Capture.dynamo_messages``), not the user's console (``timing.quiet.quiet_dynamo``).

Rows: the ops of one call of a ``torch.nn`` layer without children (``Linear``, ``Conv2d``, ``BatchNorm2d`` with
its ``num_batches_tracked`` update, ``Dropout``...) are one row named as ``torch.fx`` names a module call
(``layer1_0_conv1``, ``layer1_0_relu_1`` for its second call); every other op is a row of its own, named after the
function Dynamo saw and the module that called it (``layer1_0_iadd``, ``self_attn_multi_head_attention_forward``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture import verify
from fxprof_lightning.capture.dynamo_rules import TRACEABLE, guarded_functions
from fxprof_lightning.capture.dynamo_timing import DynamoGraphs
from fxprof_lightning.capture.dynamo_ways import OPENED, Attempt, Way, Ways, in_one_frame, placed
from fxprof_lightning.capture.entry_guards import EntryGuards
from fxprof_lightning.capture.graph_breaks import graph_break_counter, graph_break_reasons, host_reads
from fxprof_lightning.capture.recaptures import (
    RECAPTURES_IN_A_ROW,
    VARYING_CALLS,
    ParameterFlags,
    global_hooks,
    guarded_in,
    hook_functions,
    hooks_refusal,
    in_a_row_refusal,
    on_a_value_of_the_call,
    recapture_reason,
    run_eagerly,
    untimed_text,
)
from fxprof_lightning.capture.row_names import Owners
from fxprof_lightning.timing.forward_swap import put_forward
from fxprof_lightning.timing.quiet import quiet_dynamo

if TYPE_CHECKING:
    from fxprof_lightning.nodes import Capture

__all__ = ["DYNAMO", "DynamoTimer", "missing_for_dynamo"]

missing_for_dynamo = torch_api.missing_for_dynamo

DYNAMO = ("torch._dynamo's graphs, run eagerly by a backend that times each op (no Inductor), checked bitwise against "
          "eager (outputs, gradients, buffers, random states) before use, captured again when a guard fails")
FAILED = "capturing with Dynamo failed"  # (an exception in Dynamo or the graph, not a difference from eager)
# Why an FSDP2 model is not captured again (a guard failed): its checking calls' collectives would hang the job.
ONCE = "under FSDP2, which is captured once: capturing again would run collectives on this rank alone"
# A function of torch's that Dynamo was let trace into (``dynamo_ways.OPENED``) but captured whole: its one row.
_OPENED_NAMES = {f"{f.__module__}.{f.__name__}" for f in OPENED}
WHOLE = "{} timed as one row: traced into, it broke Dynamo's graph (its checks), so it was captured whole"


class DynamoTimer(DynamoGraphs):
    """Times the graphs Dynamo captures of a module's forward; see the module docstring.

    Args:
        training: the train/eval mode it times (a call in the other mode runs the module's own forward).
        on_refused: called once, with the reason, when a capture is refused.
        The rest as ``NodeTimer``.

    This class is the capture side (each capture verified against eager); how Dynamo captures, and the other ways it
    tries, are its part ``dynamo_ways.Ways``; the timing of the graphs is its base's, ``dynamo_timing.DynamoGraphs``.

    Attributes:
        mismatch: why the captured graphs were refused (None while they are trusted).
        recaptures: why each capture after the first was made (Dynamo's guard failure, or what changed).
        capture_s: seconds spent in each capture call (capture, verification, and the call itself).
    """

    def __init__(self, training: bool, *, backward: bool = True, device: str = "cpu", annotate: bool = False,
                 trace_ranges: bool = False, on_refused: Callable[[str], None] | None = None,
                 sharded: bool = False) -> None:
        super().__init__(training, annotate=annotate, backward=backward, device=device, trace_ranges=trace_ranges,
                         sharded=sharded)
        self.mismatch: str | None = None
        self.recaptures: list[str] = []
        self.capture_s: list[float] = []
        self.dynamo_messages: list[str] = []  # what Dynamo logged or warned in our calls through it (``quiet_dynamo``)
        self._on_refused = on_refused
        self._entry: EntryGuards | None = None  # asks the guards of the forward's own frame before a call
        self._guard_failures: list[str] = []
        self._graph_breaks: dict[str, int] = {}
        self.outside_graphs: list[str] = []  # layers that ran outside the graphs of the last capture (``Capture.untimed``)
        self.host_reads: dict[str, str] = {}  # module path -> where its forward reads a tensor's value (``host_reads``)
        self._global_hooks: tuple[tuple[int, ...], ...] = ()  # the global module hooks at the last capture
        self._flags: ParameterFlags | None = None  # parameters' requires_grad at the last capture (where Dynamo misses it)
        self._ways, self._sharded = Ways(sharded), sharded  # how Dynamo captures (``Ways.explore`` may change it)
        self._retried = False  # a first capture that failed was tried again at the next call
        self._context = self._new_context()
        self._own_forward: Callable[..., Any] | None = None  # the installed module's own forward

    def install(self, module: nn.Module, backward_hooks: bool = False) -> None:
        """Make ``module(...)`` run the captured graphs until ``uninstall``; see the module docstring."""
        if id(module) in self._saved_forward:
            return
        self._hooks_now = backward_hooks
        self._root = module
        own_forward = module.forward
        # Wrapping a function in the Dynamo context costs 70-370 us (trace_rules lookups): done once per forward
        # function, not at every traced step (a bound method compares equal for the same function and module).
        if self._compiled is None or own_forward != self._own_forward:
            self._own_forward = own_forward
            self._compiled = self._context(torch_api.own_code(own_forward))
            self._entry = EntryGuards.of(self._compiled, self._context)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if module.training is not self.training or self.mismatch is not None:
                return own_forward(*args, **kwargs)
            entered = time.perf_counter_ns()  # (the guards asked below are in the call's wall time)
            if self._pending is None and global_hooks() != self._global_hooks:  # Dynamo does not guard on these
                self._pending = "a global module hook (torch.nn.modules.module.register_module_*_hook) added or removed"
            if self._pending is None and self._flags and (flipped := self._flags.flipped()):  # (< 2.14: Dynamo misses it)
                self._pending = flipped
                self._fresh_cache()
            if self._one_frame and self._pending is None and self._entry is not None:  # the guards asked once
                state, run = self._entry.fitting(args, kwargs)
                if run is not None:  # (no Dynamo code runs: nothing for ``quiet_dynamo`` to keep)
                    return self._timed_call(args, kwargs, state, after_capture=False, entered=entered, run=run)
            state, missed = self._entry.check(args, kwargs) if self._entry is not None else (None, "")
            if missed and self._pending is None:
                self._pending, self._streak = "a guard failed", self._streak + 1  # captured on this call, its state
                self._guard_failures.append(missed)
            if self._pending is not None and (missed or self._pending_for in (None, state)):  # (that state's next call)
                if self._sharded and self.graphs:
                    self._refuse(f"{self._pending} {ONCE}")
                    return own_forward(*args, **kwargs)
                with quiet_dynamo(self.dynamo_messages):  # (Dynamo's messages go to the record, not the console)
                    return self._capture_call(module, own_forward, args, kwargs)
            with quiet_dynamo(self.dynamo_messages, look=False):
                return self._timed_call(args, kwargs, state, after_capture=False, entered=entered)

        self._saved_forward[id(module)] = put_forward(module, forward)
        TRACEABLE.enter()
        self._ways.enter(module)
        if self._fsdp is not None:
            self._fsdp.install(module, backward_hooks)

    def uninstall(self, module: nn.Module) -> None:
        if id(module) in self._saved_forward:
            try:
                TRACEABLE.exit()
                self._ways.exit()
            finally:  # (FSDP2's own methods back, whatever failed)
                if self._fsdp is not None:
                    self._fsdp.uninstall()
        super().uninstall(module)

    def _new_context(self) -> Any:
        """A Dynamo context with a cache of its own (the user's ``torch.compile`` of the same code is untouched)."""
        return torch_api.dynamo_context(self._backend, lambda failure: self._guard_failures.append(failure.reason))

    def _capture_call(self, module: nn.Module, own_forward: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """Capture (Dynamo compiles where its guards fail), verify against eager, then make the call itself.

        The first capture that has graph breaks or is refused also tries other ways (``Ways.explore``)."""
        started = time.perf_counter()
        reason, self._pending, self._pending_for = self._pending, None, None
        self.interruptions += 1
        self._names = {id(m): (name, m) for name, m in module.named_modules(remove_duplicate=False)}
        self._tensor_owners = Owners(module)
        state = verify.State(module)
        try:
            eager: verify.CallResult | Exception = verify.run_checked(own_forward, module, args, kwargs)
        except Exception as error:  # the module's own forward failed: the call below fails as it would without us
            eager = error
        state.restore()
        ways, attempt_in = self._ways, functools.partial(self._attempt, module, eager, state, args, kwargs)
        attempt = attempt_in(ways.way)
        hooks_now_eager = False
        # (not under FSDP2: the ways tried hang on bitwise results that may differ by rank, and each runs collectives)
        if (attempt.breaks or attempt.difference) and not ways.explored and not self._sharded:
            attempt = ways.explore(module, attempt, attempt_in, self._drop)
        hooks = hook_functions(module) if not ways.way.eager_hooks and not ways.way.follow else ()
        # A state of the forward's own making (a random layer drop) comes back, it does not run away: not in a row,
        # and not a hook's doing (a hook's place can be any dataclass's ``__init__``, as the failure's is).
        of_the_call = bool(self._guard_failures) and all(map(on_a_value_of_the_call, self._guard_failures))
        counted, self._count_missed = self._count_missed, False
        if counted and not self._guard_failures and attempt.difference is None:  # no guard failed: nothing was missed
            self._counts_vary, self._misses = True, max(self._misses - 1, 0)
            reason = VARYING_CALLS
        self._streak = 0 if of_the_call or self._counts_vary else self._streak
        in_a_row = self._streak >= RECAPTURES_IN_A_ROW
        in_hooks = not of_the_call and guarded_in(hooks, self._guard_failures)
        found = guarded_functions(module, self._guard_failures) if in_a_row and not in_hooks else ()
        # A hook, or a function the forward calls, changes what Dynamo guards on: run eagerly, between graphs.
        if attempt.difference is None and ((hooks and (in_a_row or in_hooks)) or found):
            self._drop(attempt)
            ways.run_hooks_eagerly(found)
            self._streak = 0
            attempt = attempt_in(ways.way)
            if attempt.difference is None and attempt.untimed and not found:  # (a function: its time is its row)
                attempt.difference = hooks_refusal(attempt.untimed)
            hooks_now_eager = True
        for why, count in attempt.breaks.items():
            self._graph_breaks[why] = self._graph_breaks.get(why, 0) + count
        self.host_reads.update(attempt.host_reads)
        self.outside_graphs = attempt.untimed
        reason = recapture_reason(reason, self._guard_failures)  # (Dynamo's first line says what changed)
        self._guard_failures.clear()
        if hooks_now_eager:
            why = (f"{RECAPTURES_IN_A_ROW} calls in a row, each right after a capture" if in_a_row else
                   "a guard on what a hook's code read")
            reason += f" ({why}): from now on {run_eagerly(found)}, between graphs"
        if reason != "first call":
            self.recaptures.append(reason)
        self.interrupted_by = f"captured ({reason})"
        if attempt.difference is None and self._streak >= RECAPTURES_IN_A_ROW:
            attempt.difference = in_a_row_refusal(reason)
        if attempt.difference is not None:
            self.capture_s.append(time.perf_counter() - started)
            if reason == "first call" and attempt.difference.startswith(FAILED) and not self._retried:
                self._pending, self._retried = reason, True  # tried once more (a first call may set up what later
            else:  # calls use: transformers installs its output hooks then)
                self._refuse(attempt.difference)
            return own_forward(*args, **kwargs)
        self._global_hooks = global_hooks()
        self._flags = None if torch_api.PARAMETER_FLAGS_GUARDED else ParameterFlags(module)
        self._one_frame = in_one_frame(attempt, ways.way, self._sharded) and self._one_frame is not False
        state, missed = self._entry.check(args, kwargs) if self._entry is not None else (None, "")
        if missed:
            self._entry, state = None, None  # the guards cannot be asked before a call here (the call just captured would miss)
        self._expected[None] = self._expected[state] = attempt.graph_calls  # (None: a call whose state is not told)
        out = self._timed_call(args, kwargs, state)
        self.capture_s.append(time.perf_counter() - started)
        return out

    def _attempt(self, module: nn.Module, eager: verify.CallResult | Exception, state: verify.State, args: tuple[Any, ...],
                 kwargs: dict[str, Any], way: Way) -> Attempt:
        """One capture through Dynamo (the ``way``), run and compared with ``eager``; the module's state and the
        timer's logs put back after."""
        attempt = Attempt(way, len(self.graphs), len(self._uncounted))
        mark = self.mark()
        breaks = dict(graph_break_counter())
        reasons = len(graph_break_reasons())
        try:
            if isinstance(eager, Exception):
                raise eager
            before, self._inputs_seen = self.samples.calls, set()
            with self._ways.capturing(module, way):
                captured = verify.run_checked(self._compiled, module, args, kwargs)
            attempt.graph_calls = self.samples.calls - before
            attempt.untimed = _untimed_layers(module, eager, self._inputs_seen)
            attempt.difference = verify.first_difference(eager, captured)
            if attempt.difference is None and attempt.graph_calls == 0:
                attempt.difference = "Dynamo captured no graph of the forward (it ran the module's code eagerly)"
        except Exception as error:  # Dynamo or the graph failed: refuse, the call runs eagerly
            attempt.difference = f"{FAILED}: {type(error).__name__}: {error}"
        self._inputs_seen = None
        state.restore()
        self.drop_since(mark)
        self._in_pass = False  # (the checking calls' backward ended without the engine's callback)
        attempt.breaks = {why: count - breaks.get(why, 0) for why, count in graph_break_counter().items()
                          if count > breaks.get(why, 0)}
        attempt.host_reads = host_reads(graph_break_reasons()[reasons:], module)
        ours = self.graphs[attempt.graphs:]
        attempt.timed = sum(placed(node, first=i == 0) for i, graph in enumerate(ours) for node in graph.captured.graph.nodes)
        return attempt

    def _drop(self, attempt: Attempt) -> None:
        """Forget an attempt's graphs: a fresh Dynamo cache, so that the next call captures again."""
        self._fresh_cache(self.graphs[attempt.graphs:])
        del self.graphs[attempt.graphs:], self._uncounted[attempt.uncounted:]

    def _fresh_cache(self, graphs: list[Any] | None = None) -> None:
        """Forget the cache entries of ``graphs`` (all: their guards would pass a state they were not captured for;
        the graphs stay in ``graphs``, as those of a guard failure): the next capture compiles anew."""
        torch_api.forget_compiles({graph.compile_id for graph in (self.graphs if graphs is None else graphs)})
        self._expected.clear()
        self._one_frame = None
        self._context = self._new_context()
        self._compiled = self._context(torch_api.own_code(self._own_forward))
        self._entry = EntryGuards.of(self._compiled, self._context)

    @property
    def untimed(self) -> str | None:
        return untimed_text(self._misses, self.recaptures[-1] if self.recaptures else "a guard failed") if self._misses else None

    def refusal(self, capture: Capture) -> str:
        return f"the graph Dynamo captured was refused: {self.mismatch}"

    def describe(self, capture: Capture) -> Capture:
        leaves = {info.module_path: WHOLE.format(info.target) for info in self.samples.nodes if info.target in _OPENED_NAMES}
        untimed = dict.fromkeys(self.outside_graphs, OUTSIDE_GRAPHS)
        return replace(capture, graphs=len(self.graphs), recaptures=list(self.recaptures), capture_s=list(self.capture_s),
                       graph_breaks=self.graph_breaks(), leaves=leaves, host_reads=dict(self.host_reads), untimed=untimed,
                       dynamo_messages=list(self.dynamo_messages))

    def graph_breaks(self) -> dict[str, int]:
        """Dynamo's graph breaks in this timer's captures, by reason (each code path is broken once per capture)."""
        return dict(self._graph_breaks)

    def _refuse(self, reason: str) -> None:
        self.mismatch = reason
        if self._on_refused is not None:
            self._on_refused(reason)


# ---------------------------------------------------------------- verification


OUTSIDE_GRAPHS = ("their parameters were given to no graph: a graph break inside a loop made Dynamo run the frame "
                  "that calls them eagerly")


def _untimed_layers(module: nn.Module, eager: verify.CallResult | Exception, seen: set[int]) -> list[str]:
    """The modules whose parameters eager's call used (they got gradients; none are known without grad) but no
    graph was given (``seen``: ids of the graphs' inputs): they ran outside the graphs, untimed."""
    if isinstance(eager, Exception):
        return []
    unsharded = verify.fsdp_unsharded(module)
    parameters = {name: unsharded.get(id(p), p) for name, p in module.named_parameters()}
    used = [name.removeprefix("gradient of ") for name, gradient in eager.gradients if gradient is not None]
    return list(dict.fromkeys(name.rpartition(".")[0] or "(the root)" for name in used
                              if name in parameters and id(parameters[name]) not in seen))
