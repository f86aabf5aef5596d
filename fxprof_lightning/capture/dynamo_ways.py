"""How ``DynamoTimer`` has Dynamo capture a module's forward: a way (``Way``: the torch functions it traces into,
whether it follows torch's own frames after a graph break, the branches eager takes, the model's hooks run eagerly,
each torch.nn layer in a frame of its own), what a capture in one way gave (``Attempt``), and the timer's part that
keeps the way in use, puts in place what it needs, and tries the other ways after a first capture that broke the
graph or was refused, keeping the one that verifies and times the most ops inside layers (``Ways``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture.dynamo_rules import frames_skipped, hooks_eager, not_compiling, opened_frames
from fxprof_lightning.capture.recaptures import hook_functions
from fxprof_lightning.capture.row_names import FRAMED
from fxprof_lightning.nodes import ROW, is_timed
from fxprof_lightning.timing.flops import float_grouped_mm_meta

__all__ = ["ALWAYS_EAGER", "GUARD_SETTINGS", "OPENED", "Attempt", "Way", "Ways", "in_one_frame", "placed"]

# Frames Dynamo must run eagerly, from our first install on: ``float(tensor)`` breaks the graph and runs
# ``torch._as_tensor_fullprec`` as a frame; after Mask R-CNN's capture, that frame's compiled code called itself until
# a ``RecursionError`` (BatchNorm with ``momentum=None`` in the same process: SWA's BatchNorm epoch fell back).
ALWAYS_EAGER = tuple(f for f in (torch_api.as_tensor_fullprec,) if f is not None)

# Dynamo's defaults leave out guards on module hooks (a hook added after the capture would be bypassed): ours keep them.
GUARD_SETTINGS = {"skip_nnmodule_hook_guards": False,
                  # Guards skip an nn.Module subtree whose dicts' version tags are unchanged (MLP-300: 300 -> 22 us per
                  # check). Still caught: flags, attributes, hooks, requires_grad, inputs, grad mode, autocast. Assumes
                  # no function's __code__/__defaults__/__closure__ is rebound (Dynamo's assume_dunder_attributes...).
                  "use_recursive_dict_tags_for_guards": True,
                  # NumPy's random functions run eagerly (graph breaks), drawing from NumPy's own state as in eager
                  # (Dynamo's default draws them from torch's: wav2vec2's SpecAugment masks would differ).
                  "use_numpy_random_stream": True,
                  # Dynamo skips a frame that runs an nn.RNN/LSTM/GRU by default; allowed, the RNN is one op of the graph.
                  "allow_rnn": True,
                  # A Python number the forward reads that changes between calls (a step counter in a module
                  # attribute or a dict, a float annealed every step) becomes an input of the graph at its second
                  # value, as torch.compile's automatic dynamic shapes do, instead of a constant guarded on (a capture
                  # at every call). Dynamo's defaults keep nn.Module ints and all floats constants.
                  "allow_unspec_int_on_nn_module": True,
                  "specialize_float": False}


# Python functions of torch that Dynamo puts into its graphs as one call, though they run many ops (the trace rule
# ``TorchInGraphFunctionVariable``): while we capture, Dynamo traces into them, so their ops are rows.
OPENED = (torch.nn.functional.multi_head_attention_forward,)
OPENED_BY = (nn.MultiheadAttention,)  # the modules that call them


@dataclass(frozen=True)
class Way:
    """How Dynamo captures: the torch functions it traces into, whether it follows torch's own frames after a graph
    break (``dont_skip_tracing``), and whether the traced code is told it is not being compiled."""

    opening: tuple[Callable[..., Any], ...] = ()
    follow: bool = False
    eager_branches: bool = False  # Dynamo answers ``torch.compiler.is_compiling()`` with False
    eager_hooks: bool = False  # the model's forward hooks and pre-hooks run eagerly, between graphs (``hooks_eager``)
    # Every torch.nn submodule gets a forward of ours, a frame Dynamo starts (``_Frames``): a module with full
    # backward hooks breaks its parent's frame, and its siblings' torch.nn frames would run eagerly, untimed.
    framed: bool = False


@dataclass
class Attempt:
    """One capture (``DynamoTimer._attempt``): its way, where its graphs begin in the timer's lists, what it gave."""

    way: Way
    graphs: int
    uncounted: int
    graph_calls: int = 0
    difference: str | None = None  # how it differs from eager (None: bitwise the same)
    breaks: dict[str, int] = field(default_factory=dict)  # its graph breaks, by reason
    host_reads: dict[str, str] = field(default_factory=dict)  # module path -> a read of a tensor's value there
    timed: int = 0  # how many of its timed ops are placed in a layer (``placed``)
    untimed: list[str] = field(default_factory=list)  # layers that ran outside its graphs (``_untimed_layers``)


def in_one_frame(attempt: Attempt, way: Way, sharded: bool) -> bool:
    """Whether a capture is one graph of the forward's own frame (no graph break, no layer outside the graphs, no frame
    of ours): a call then runs no other frame Dynamo guards, so the code Dynamo made for the frame can run directly
    once the guards are asked (``EntryGuards.fitting``)."""
    return attempt.graph_calls == 1 and not attempt.breaks and not attempt.untimed and not (
        way.eager_hooks or way.framed or way.follow or sharded)


class Ways:
    """How the timer's captures are made (``way``, which ``explore`` and ``run_hooks_eagerly`` change for the rest of
    the run), and what a way puts in place around the module: the hook functions whose frames run eagerly, the
    torch.nn submodules' forwards of ours (``_Frames``).

    Args:
        sharded: the module holds FSDP2 modules: Dynamo follows torch's frames (a hook's graph break in a loop).
    """

    def __init__(self, sharded: bool) -> None:
        self.way = Way(OPENED, follow=sharded)
        self.explored = False  # the other ways were tried (once a run)
        self.eager_hooks: tuple[Callable[..., Any], ...] = ()  # hook functions run eagerly (``Way.eager_hooks``)
        self.eager_functions: tuple[Callable[..., Any], ...] = ()  # and the functions whose reads failed guards
        self.frames = _Frames()  # torch.nn submodules' forwards of ours, frames Dynamo starts

    def enter(self, module: nn.Module) -> None:
        """The timer is installed on ``module``: the way's frames of ours given, the eager frames skipped by Dynamo."""
        if self.way.eager_hooks or self.way.framed:
            self.frames.frame(module, every=self.way.framed)
        frames_skipped(self.eager_hooks + ALWAYS_EAGER, True)

    def exit(self) -> None:
        """The timer is uninstalled: the hook functions' frames traced again, the submodules' own forwards back."""
        frames_skipped(self.eager_hooks, False)
        self.frames.restore()

    @contextlib.contextmanager
    def capturing(self, module: nn.Module, way: Way) -> Iterator[None]:
        """Inside the block, Dynamo captures ``module`` in ``way`` (with ``GUARD_SETTINGS``)."""
        self.frames.restore()
        if way.eager_hooks:
            frames_skipped(self.eager_hooks, False)
            self.eager_hooks = hook_functions(module) + self.eager_functions
            frames_skipped(self.eager_hooks, True)
        if way.eager_hooks or way.framed:
            self.frames.frame(module, every=way.framed)
        with (torch_api.following(way.follow, GUARD_SETTINGS), opened_frames(way.opening),
              not_compiling(way.eager_branches), hooks_eager(self.eager_hooks if way.eager_hooks else ()),
              float_grouped_mm_meta()):
            yield

    def explore(self, module: nn.Module, first: Attempt, attempt: Callable[[Way], Attempt],
                drop: Callable[[Attempt], None]) -> Attempt:
        """The first capture broke the graph or was refused: try the other ways (``_other_ways``), each an ``attempt``
        after the one before was ``drop``ped (a fresh Dynamo cache). Keeps the way that verifies and times the most
        ops inside layers (``placed``; the first of equals), from now on."""
        self.explored = True
        tried, others = [first], _other_ways(module, first)
        for other in others:
            drop(tried[-1])
            tried.append(attempt(other))
        best = max(tried, key=lambda a: (a.difference is None, a.timed, -sum(a.breaks.values())))
        if best is not tried[-1]:
            drop(tried[-1])
            best = attempt(best.way)
        self.way = best.way
        return best

    def run_hooks_eagerly(self, found: tuple[Callable[..., Any], ...]) -> None:
        """From now on the model's hooks, and the functions ``found`` (their reads failed guards), run eagerly."""
        self.eager_functions += found
        self.way = replace(self.way, eager_hooks=True)


class _Frames:
    """Forwards of ours for torch.nn submodules, frames Dynamo starts where it would skip torch.nn's: with the hooks
    run eagerly, for each submodule with forward hooks where this torch's Dynamo skips its frame
    (``torch_api.hooked_forward``); with ``every`` (``Way.framed``), for each torch.nn submodule. One function per
    module for the whole run, as the graphs that inline it guard on it."""

    def __init__(self) -> None:
        self.made: dict[tuple[int, bool], tuple[nn.Module, Callable[..., Any]]] = {}
        self.now: list[nn.Module] = []

    def frame(self, module: nn.Module, every: bool) -> None:
        for submodule in module.modules():
            # (hooked: the forward of ours itself, cheap; every: whether one is needed, made once below)
            needed = _framed(submodule) if every else torch_api.hooked_forward(submodule)
            if submodule is not module and needed:
                if self.made.get((id(submodule), every), (None,))[0] is not submodule:
                    self.made[id(submodule), every] = (submodule, _own_frame(submodule) if every else needed)
                submodule.forward = self.made[id(submodule), every][1]
                self.now.append(submodule)

    def restore(self) -> None:
        """The submodules' own forwards back."""
        for submodule in self.now:
            submodule.__dict__.pop("forward", None)
        self.now.clear()


def _framed(module: nn.Module) -> bool:
    """Whether ``module`` gets a forward of ours under ``Way.framed``: a torch.nn (or torch.ao) module without a
    forward of its own already."""
    return "forward" not in module.__dict__ and type(module).__module__.startswith(("torch.nn.", "torch.ao."))


def _own_frame(module: nn.Module) -> Callable[..., Any]:
    """A forward of ours for a torch.nn ``module`` (``_framed``): a frame Dynamo starts where it skips torch.nn's,
    its ``self`` the module, as in the frame Dynamo starts at a hooked module's forward (the rows are named from it)."""
    code = _framed_forward.__code__.replace(co_name=f"{FRAMED}{id(module)}")  # (a graph's stack names its module)
    return types.MethodType(types.FunctionType(code, _framed_forward.__globals__, code.co_name), module)


def _framed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(self).forward(self, *args, **kwargs)


def _follows(first: Attempt) -> bool:
    """Whether ``Ways.explore`` tries following torch's own frames after a break (``torch_api.FOLLOWS``): on 2.14+ (a
    cache per context) wherever the first capture broke; before, only where layers ran outside its graphs: each
    capture there leaves Dynamo state on the code objects (skip marks, automatic-dynamic sizes), and a capture after
    the first was seen to win without timing a layer more (test_dynamics: a helper's row then named by its caller)."""
    return torch_api.FOLLOWS and (torch_api.ISOLATED_CACHE or bool(first.untimed))


def _other_ways(module: nn.Module, first: Attempt) -> list[Way]:
    """The ways to try after a first capture that broke the graph or was refused:

    * Without tracing into ``OPENED`` (the checks inside ``F.multi_head_attention_forward`` with a padding mask
      break the graph, and torch's own code after a break runs untimed).
    * Following torch's own frames after a break (``dont_skip_tracing``: ``nn.Transformer``'s causal-mask check
      breaks the graph, after which its layers would run untimed).
    * Refused: on the branches eager takes (``torch.compiler.is_compiling()`` answered False while Dynamo
      traces): libraries take other branches while compiling (HF drops an all-ones attention mask in eager
      only, and picks its MoE kernels by it), which computes the same values by other ops.
    * Each torch.nn layer in a frame of its own (``framed``) where a module has backward hooks: it breaks its parent's
      frame, and its siblings' frames would run untimed (not for other breaks: a layer whose ``.item()`` breaks each
      call is better timed by following torch's frames)."""
    way = first.way
    opens = any(isinstance(m, OPENED_BY) for m in module.modules())  # calls a function in ``OPENED``
    others = [replace(way, opening=())] if way.opening and opens and first.breaks else []
    others += [replace(way, follow=True)] if first.breaks and not way.follow and _follows(first) else []
    others += [replace(way, eager_branches=True)] if first.difference and not way.eager_branches else []
    backward_hooked = any(m._backward_hooks or m._backward_pre_hooks for m in module.modules())
    return others + ([replace(way, framed=True)] if backward_hooked and not way.framed else [])


def placed(node: fx.Node, first: bool) -> int:
    """A timed op's score in the choice of a way to capture (``Ways.explore``): 1 inside a submodule; -1
    outside any module in a graph after the first (code of torch's own that Dynamo followed after a graph break,
    whose rows could not say which layer ran them); else 0 (the root's own ops: the same in every way)."""
    if not is_timed(node):
        return 0
    info = node.meta.get(ROW)
    if info is not None and info.module_stack:
        return 1
    return 0 if first else -1
