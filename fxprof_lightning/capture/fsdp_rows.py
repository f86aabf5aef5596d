"""FSDP2's collectives as rows of their own: each FSDP module's all-gathers, reshards and reduce-scatters, timed on
the host while the timer is installed, and what they take out of the time the other rows and the unowned rows hold.

FSDP2 (``fully_shard``) runs them eagerly in its hooks, between our graphs and inside the autograd engine
(``FSDPParamGroup`` of ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``, torch 2.14):

* ``unshard`` starts a module's all-gather (on gloo it runs it) and ``wait_for_unshard`` waits for it and copies the
  parameters out: one sample of the ``all-gather`` row (the forward pre-hook; in backward the pre-backward hook, and
  the prefetch another module's hook makes for the next);
* ``reshard`` frees the unsharded parameters: the ``reshard`` row (after forward, and inside ``post_backward``);
* ``post_backward`` less the ``reshard`` inside it: the ``reduce-scatter`` row (accumulating, reducing and scattering
  the gradients), run by FSDP2's ``RegisterPostBackwardFunction`` (inside that autograd node's own profiler event)
  or by the root's callback at the end of backward.

Only the profiled model's ``FSDPParamGroup`` objects are wrapped, each method as an attribute of the instance
(never the class), from ``install`` to ``uninstall``; a wrapper calls the method it replaced and keeps its result,
so FSDP2 runs as often and does the same as without it. A call that changed nothing (an ``unshard`` of a module
already unsharded, a ``reshard`` that keeps the parameters) is no sample: its microseconds stay where they were.

Each sample's place is measured as it runs, so that nothing is counted twice: its side (backward when the autograd
engine runs a graph task: ``torch._C._current_graph_task_id``), whether it ran inside the timed call of the module
(a flag the timer sets) or around it (the root's own hooks: the forward wall is extended by them), and, in backward,
the autograd node whose own code runs it (a ``BackwardCFunction.apply`` frame below it: that node's profiler event
holds the sample, and gives it up). With backward timed by hooks on the autograd nodes (another profiler runs), the
nodes' spans hold the backward samples: only the forward ones are rows.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture.verify import fsdp2_kept, fsdp_states
from fxprof_lightning.nodes import NodeInfo, module_stack

__all__ = ["FSDP2", "FsdpRows"]

FSDP2 = "fsdp2"  # the op of these rows
ALL_GATHER, RESHARD, REDUCE_SCATTER = "all-gather", "reshard", "reduce-scatter"
METHODS = {"unshard": ALL_GATHER, "wait_for_unshard": ALL_GATHER, "reshard": RESHARD, "post_backward": REDUCE_SCATTER}
_ABSENT = object()


def _code(owner: Any, name: str) -> Any:
    function = getattr(owner, name, None)
    return getattr(function, "__code__", None)


_APPLY = _code(torch.autograd.function.BackwardCFunction, "apply")  # a custom Function's backward runs under it
_RUN_BACKWARD = getattr(torch_api.engine_run_backward, "__code__", None)  # where a backward pass starts


@dataclass
class _Piece:
    """One timed call that did work: its row, side, place and own time (less the wrapped calls inside it)."""

    row: int
    backward: bool
    start: int
    end: int
    ns: int
    in_call: bool  # inside the timed call of the module (forward)
    node: int | None  # backward: the sequence number of the autograd node whose own code ran it


def row_name(path: str, kind: str) -> str:
    """``blocks_0 (FSDP2 all-gather)``; the profiled module itself is ``(root)``."""
    return f"{path.replace('.', '_') if path else '(root)'} (FSDP2 {kind})"


class FsdpRows:
    """The FSDP2 collectives of a model's recorded steps, a row per FSDP module and kind (see the module docstring).

    ``install``/``uninstall`` wrap and unwrap; ``mark``/``drop_since``/``reset`` as a timer's; ``in_call`` is set by
    the timer around its timed calls. After a cycle the timer asks for ``events_less`` (the backward events less the
    samples inside them), ``take_from`` (its rows' forward samples less those inside them), ``around_forward_ns``
    (to add to its forward wall) and ``rows`` (``NodeInfo``, forward and backward samples).
    """

    @staticmethod
    def usable() -> bool:
        """Whether this torch's FSDP2 has what is wrapped and read (else no rows, nothing wrapped)."""
        if not fsdp2_kept() or _APPLY is None or torch_api.lacks("torch._C:_current_graph_task_id"):
            return False
        return all(callable(getattr(torch_api.FSDPParamGroup, method, None)) for method in METHODS)

    def __init__(self) -> None:
        self.in_call = False
        self.infos: list[NodeInfo] = []
        self._rows: dict[str, int] = {}
        self._wrapped: list[tuple[Any, str, Any]] = []  # group, method, its own instance attribute (or _ABSENT)
        self._hooks = False  # backward timed by hooks: no backward samples
        self._stack: list[list[int]] = []  # per running wrapped call: the time of the wrapped calls inside it
        self._calls: list[Any] = []  # the hooks on the profiled module that say when its call runs
        self._in_module = False  # in the profiled module's call (its own FSDP2 hooks around the timed call included)
        self.reset()

    def reset(self) -> None:
        self.pieces: list[_Piece] = []
        self._samples: list[tuple[int, bool, int]] = []  # row, backward, ns: a call of the row (unshard + wait)
        self._pending: dict[tuple[int, bool], int] = {}  # an unshard's ns waiting for its wait

    def mark(self) -> tuple[int, int, dict[tuple[int, bool], int]]:
        return len(self.pieces), len(self._samples), dict(self._pending)

    def drop_since(self, mark: tuple[int, int, dict[tuple[int, bool], int]]) -> None:
        pieces, samples, pending = mark
        del self.pieces[pieces:], self._samples[samples:]
        self._pending = dict(pending)

    def install(self, module: nn.Module, backward_hooks: bool) -> None:
        """Wrap the methods of every FSDP2 parameter group of ``module`` and its submodules."""
        self._hooks = backward_hooks
        if self._wrapped:
            return
        self._calls = [module.register_forward_pre_hook(self._enter, prepend=True),
                       module.register_forward_hook(self._leave, always_call=True)]
        paths = {id(m): path for path, m in module.named_modules()}
        for state in fsdp_states(module):
            for group in torch_api.fsdp_param_groups(state):
                path = next((paths[id(m)] for m in getattr(group, "modules", ()) if id(m) in paths), None)
                if path is None or not all(hasattr(group, name) for name in ("_sharded_state", "_all_gather_result")):
                    continue
                for method, kind in METHODS.items():
                    self._wrapped.append((group, method, group.__dict__.get(method, _ABSENT)))
                    setattr(group, method, self._timed(group, self._row(path, kind), getattr(group, method)))

    def _enter(self, *_: Any) -> None:
        self._in_module = True

    def _leave(self, *_: Any) -> None:
        self._in_module = False

    def uninstall(self) -> None:
        for handle in self._calls:
            handle.remove()
        self._calls, self._in_module = [], False
        for group, method, own in reversed(self._wrapped):
            if own is _ABSENT:
                group.__dict__.pop(method, None)
            else:
                setattr(group, method, own)
        self._wrapped = []

    def _row(self, path: str, kind: str) -> int:
        name = row_name(path, kind)
        if name not in self._rows:
            self._rows[name] = len(self.infos)
            self.infos.append(NodeInfo(name, FSDP2, kind, path, module_stack(path)))
        return self._rows[name]

    def _timed(self, group: Any, row: int, method: Callable[..., Any]) -> Callable[..., Any]:
        kind = self.infos[row].target
        stack = self._stack

        def timed(*args: Any, **kwargs: Any) -> Any:
            before = (group._sharded_state, group._all_gather_result is not None)
            inner = [0]
            stack.append(inner)
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                end = time.perf_counter_ns()
                stack.pop()
                if stack:
                    stack[-1][0] += end - start
                after = (group._sharded_state, group._all_gather_result is not None)
                if kind == REDUCE_SCATTER or after != before:  # (else it changed nothing: no sample)
                    self._add(row, start, end, end - start - inner[0], completes=kind != ALL_GATHER or not after[1])

        return timed

    def _add(self, row: int, start: int, end: int, ns: int, completes: bool) -> None:
        """A call that did work: a piece of its row (an all-gather's ``unshard`` waits for its ``wait_for_unshard``)."""
        backward = torch_api.current_graph_task_id() != -1
        if (backward and self._hooks) or not (backward or self._in_module):
            return  # (a forward call outside the module's, such as the user's own ``unshard()`` prefetch: no row's)
        self.pieces.append(_Piece(row, backward, start, end, ns, self.in_call, _applying() if backward else None))
        ns += self._pending.pop((row, backward), 0)
        if completes:
            self._samples.append((row, backward, ns))
        else:
            self._pending[(row, backward)] = ns

    # After the cycle

    def rows(self) -> list[tuple[NodeInfo, list[int], list[int]]]:
        """Each row's forward and backward samples, ns per call (an all-gather never waited for is a call too)."""
        forward: list[list[int]] = [[] for _ in self.infos]
        backward: list[list[int]] = [[] for _ in self.infos]
        for row, side, ns in [*self._samples, *((row, side, ns) for (row, side), ns in self._pending.items())]:
            (backward if side else forward)[row].append(ns)
        return [(info, f, b) for info, f, b in zip(self.infos, forward, backward, strict=True) if f or b]

    def events_less(self, events: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The backward events ``(sequence number, ns)``, each less the samples its autograd node's own code ran
        (FSDP2's ``post_backward``: the node's time is its row's, or no row's, less that)."""
        inside: dict[int, int] = {}
        for piece in self.pieces:
            if piece.node is not None:
                inside[piece.node] = inside.get(piece.node, 0) + piece.ns
        if not inside:
            return events
        less = []
        for sequence_nr, ns in events:
            taken = min(ns, inside.pop(sequence_nr, 0))
            less.append((sequence_nr, ns - taken))
        return less

    def around_forward_ns(self) -> int:
        """The forward samples that ran around the timed calls (the profiled module's own FSDP2 hooks, before and
        after its forward): the forward wall does not hold them, so it is extended by them. (Forward calls outside
        the module's call are no samples.)"""
        return sum(p.ns for p in self.pieces if not p.backward and not p.in_call)

    def take_from(self, starts: list[list[int]], durations: list[list[int]]) -> None:
        """Take each forward sample inside the timed calls out of the forward sample of another row that holds it
        (``starts``/``durations``: per row, the start and ns of each call; Dynamo's code run eagerly between two
        graphs, after a graph break, is a row and may run FSDP2's hooks)."""
        pieces = [p for p in self.pieces if not p.backward and p.in_call]
        if not pieces:
            return
        spans = sorted((start, start + ns, row, i) for row, (row_starts, row_ns) in enumerate(zip(starts, durations, strict=True))
                       for i, (start, ns) in enumerate(zip(row_starts, row_ns, strict=False)))
        firsts = [span[0] for span in spans]
        for piece in pieces:
            k = bisect.bisect_right(firsts, piece.start) - 1  # the last row call to start before it (they do not nest)
            if k >= 0 and spans[k][1] >= piece.end:
                _, _, row, i = spans[k]
                durations[row][i] = max(durations[row][i] - piece.ns, 0)

def _applying() -> int | None:
    """In backward: the sequence number of the autograd node whose own code (a custom Function's ``backward``) runs
    the caller, or None where the engine runs it outside any node's code (a hook on a tensor, a callback at the end
    of the pass)."""
    frame = sys._getframe(3)
    while frame is not None and frame.f_code is not _RUN_BACKWARD:
        if frame.f_code is _APPLY:
            node = torch_api.current_autograd_node()
            return torch_api.node_sequence_nr(node) if node is not None else None
        frame = frame.f_back
    return None
