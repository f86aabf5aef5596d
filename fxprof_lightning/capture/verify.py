"""How a captured call is checked against eager, in one place: one call's result (``run_checked``: outputs,
gradients by ``torch.autograd.grad`` with fixed cotangents, buffers after it, random states, tensors saved for
backward), one comparison (``first_difference``: bitwise, the first difference named), and the state put back
between the checking calls (``State``: buffers, random states, the Python state the forward and hooks can change,
FSDP2's state).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture import side_effects
from fxprof_lightning.timing import random_states

__all__ = ["CallResult", "FsdpKept", "State", "first_difference", "fsdp2_kept", "fsdp_states", "fsdp_unsharded", "is_fsdp", "patched",
           "run_checked"]

_ABSENT = object()


@contextlib.contextmanager
def patched(replacements: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``owner.name`` is its replacement inside the block; after it, also on an error, what it was
    (removed again where it was inherited, as ``Function.apply`` is by ``CheckpointFunction``)."""
    saved = [(owner, name, vars(owner).get(name, _ABSENT)) for owner, name, _ in replacements]
    for owner, name, replacement in replacements:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def is_fsdp(module: nn.Module) -> bool:
    return any(cls.__name__ == "FSDPModule" and cls.__module__.startswith("torch.distributed") for cls in type(module).__mro__)


@dataclass
class CallResult:
    """What one call did: its output tensors, the gradients, the buffers after it, random states, saved tensors."""

    outputs: list[torch.Tensor]
    gradients: list[tuple[str, torch.Tensor | None]]
    buffers: list[tuple[str, torch.Tensor]]
    random_states: dict[str, Any]
    saved: int
    saved_bytes: int


def run_checked(forward: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                gradients: bool = True) -> CallResult:
    """Call ``forward`` and, in grad mode (and with ``gradients``), ``torch.autograd.grad`` of its outputs with fixed
    cotangents (``.grad`` untouched); note what a comparison needs."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not _checkpoint_inputs_saved():
            sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    # The hooks run with Dynamo off: autograd calls them while Dynamo runs, which compiled them as frames of their
    # own. Following torch's frames, that failed on ``sys._getframe`` (``nn.LSTM`` before ``allow_rnn``); and after
    # the demo transformer's capture (which follows them), the host-sync test's model, captured in the same
    # process, timed no node.
    with (torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack), torch.compiler.disable(_unpack)),
          _reentrant_checked_as_not(), _deterministic_cudnn()):
        out = forward(*args, **kwargs)
    outputs = _tensors(out)
    grads_of: list[tuple[str, torch.Tensor | None]] = []
    if gradients and torch.is_grad_enabled():
        ys = [t for t in outputs if t.requires_grad]
        unsharded = fsdp_unsharded(module)  # FSDP2: of the parameter the forward computed with
        named = [(f"gradient of {name}", unsharded.get(id(p), p)) for name, p in module.named_parameters() if p.requires_grad]
        named += [(f"gradient of input tensor {i}", t) for i, t in enumerate(_tensors((args, kwargs))) if t.requires_grad]
        if ys and named:
            generator = torch.Generator().manual_seed(0)  # its own: the global random state is not drawn from
            cotangents = [torch.randn(y.shape, generator=generator).to(y.device, y.dtype) for y in ys]
            with _deterministic_cudnn():
                grads = torch.autograd.grad(ys, [t for _, t in named], cotangents, allow_unused=True)
            grads_of = [(name, g) for (name, _), g in zip(named, grads, strict=True)]
    buffers = [(name, b.detach().clone()) for name, b in module.named_buffers()]
    return CallResult([t.detach() for t in outputs], grads_of, buffers, random_states.save(), len(sizes), sum(sizes))


@contextlib.contextmanager
def _deterministic_cudnn() -> Iterator[None]:
    """Inside, cuDNN picks deterministic algorithms (``cudnn.deterministic``, no ``benchmark``), eager and captured
    alike: a nondeterministic one (the weight gradient of a convolution, summed with atomics) makes eager differ from
    eager, and the comparison refuse a graph that is the program eager runs (ResNet18's ``conv1.weight`` gradient on
    an H200, torch 2.11, 2026-11-27). Dynamo's guards do not read these flags; the timed calls run with the user's."""
    cudnn = torch.backends.cudnn
    saved = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _reentrant_checked_as_not() -> contextlib.AbstractContextManager[None]:
    """Inside, ``checkpoint(..., use_reentrant=True)`` checkpoints as ``use_reentrant=False`` does, eager and
    captured alike: the reentrant variant refuses ``torch.autograd.grad``, which the checking calls use so that
    ``.grad`` is never touched. Both run the region's ops once forward and again in backward, so the comparison
    checks the ops; timed calls (outside this block) checkpoint as the caller asked."""

    def apply(run: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    return patched([(torch.utils.checkpoint.CheckpointFunction, "apply", apply)])




def _checkpoint_inputs_saved() -> bool:
    """Whether the tensor being packed is an input a checkpointed region keeps for its recompute (``checkpoint``'s
    ``_CheckpointFrame.save_inputs``). Those are not counted: eager passes some of a region's inputs as arguments
    and reads others from a closure (HF passes ``partial(layer, **kwargs)``), the captured graph passes them all,
    and they are alive in both either way."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code in torch_api.CHECKPOINT_INPUT_SAVERS:
            return True
        frame = frame.f_back
    return False


def first_difference(eager: CallResult, captured: CallResult) -> str | None:
    """The first way the captured call differs from eager (None: bitwise the same)."""
    if len(eager.outputs) != len(captured.outputs):
        return f"the captured graph returns {len(captured.outputs)} tensor(s), the module {len(eager.outputs)}"
    for i, (a, b) in enumerate(zip(eager.outputs, captured.outputs, strict=True)):
        if not _bitwise_equal(a, b):
            return f"output tensor {i} differs from eager"
    if len(eager.gradients) != len(captured.gradients):
        return "the gradients differ in number"
    for (name, a), (_, b) in zip(eager.gradients, captured.gradients, strict=True):
        if not _bitwise_equal(a, b):
            return f"{name} differs from eager"
    for (name, a), (_, b) in zip(eager.buffers, captured.buffers, strict=True):
        if not _bitwise_equal(a, b):
            return f"buffer {name} after the call differs from eager"
    for name, state in eager.random_states.items():
        if not random_states.same(state, captured.random_states.get(name)):
            return f"the {name} random state after the call differs from eager (random numbers drawn differently)"
    if (eager.saved, eager.saved_bytes) != (captured.saved, captured.saved_bytes):
        return (f"tensors saved for backward: {captured.saved} ({captured.saved_bytes / 1e6:.2f} MB) against "
                f"{eager.saved} ({eager.saved_bytes / 1e6:.2f} MB) in eager: the graph computes the same values by "
                "other ops (a library taking another branch while compiling: torch.compiler.is_compiling(), HF's "
                "is_torchdynamo_compiling()) or activation checkpointing was not kept")
    return None


def _bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    if a.dtype.is_floating_point or a.dtype.is_complex:  # bit patterns: NaN equals NaN, -0.0 differs from 0.0
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an output or the arguments: pytree leaves (HF registers its outputs and caches), objects'
    attributes one level down (other objects)."""
    found = []
    for leaf in torch_api.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif hasattr(leaf, "__dict__") and not isinstance(leaf, nn.Module | type):
            found += [v for v in torch_api.tree_leaves(list(vars(leaf).values())) if isinstance(v, torch.Tensor)]
    return found


# ---------------------------------------------------------------- state put back between the checking calls


def fsdp_states(module: nn.Module) -> list[Any]:
    """The FSDP2 states (``fully_shard``) of ``module`` and its submodules, each once (none without FSDP2)."""
    if not any(is_fsdp(m) for m in module.modules()):
        return []
    if torch_api.get_module_fsdp_state is None:
        return []
    states = [torch_api.get_module_fsdp_state(m) for m in module.modules()]
    return list({id(s): s for s in states if s is not None}.values())


def fsdp_unsharded(module: nn.Module) -> dict[int, torch.Tensor]:
    """id of an FSDP2 sharded parameter -> its unsharded parameter, the tensor the forward computes with (one tensor
    kept for the run, its storage freed at each reshard): the module holds one or the other, by FSDP2's state."""
    return {id(p.sharded_param): p._unsharded_param for state in fsdp_states(module)
            for group in torch_api.fsdp_param_groups(state) for p in group.fsdp_params if hasattr(p, "_unsharded_param")}


def fsdp2_kept() -> bool:
    """Whether this torch's FSDP2 has the state ``FsdpKept`` puts back (FSDP2's private state, 2.6-2.15): without it an
    FSDP2 model is not captured by Dynamo (a checking call would leave its parameters resharded)."""
    if any(found is None for found in (torch_api.FSDPParamGroup, torch_api.FSDPState, torch_api.get_module_fsdp_state,
                                       torch_api.ShardedState, torch_api.TrainingState)):
        return False
    return all(hasattr(torch_api.FSDPParamGroup, name) for name in ("unshard", "wait_for_unshard", "reshard", "use_training_state",
                                                          "is_sharded", "is_unsharded"))


class FsdpKept:
    """FSDP2's state as a checking call finds it, put back after it. The checking calls' ``torch.autograd.grad`` runs
    FSDP2's pre-backward hooks (all-gathers, the same on every rank) and the root's post-backward callback, which
    reshards every group (the root's too, unsharded by the root's pre-forward hook that ran before our forward) and
    sets the training states to idle. No gradient reaches ``.grad``: ``torch.autograd.grad`` of the unsharded
    parameters leaves FSDP2's post-backward nothing to reduce-scatter."""

    def __init__(self, module: nn.Module) -> None:
        states = fsdp_states(module)
        self.saved = [(state, state._training_state, set(state._modules_to_run_forward),
                       [(g, g._sharded_state, g._training_state, list(g._post_forward_indices))
                        for g in torch_api.fsdp_param_groups(state)]) for state in states]
        ctx, comm = (states[0]._state_ctx, states[0]._comm_ctx) if states else (None, None)
        self.ctx = (ctx, ctx.iter_forward_root, ctx.post_backward_final_callback_queued) if ctx is not None else None
        self.comm = (comm, list(comm.post_forward_order)) if comm is not None else None

    def restore(self) -> None:
        if not self.saved:
            return
        TrainingState, ShardedState = torch_api.TrainingState, torch_api.ShardedState
        for state, training, to_run, groups in self.saved:
            for group, sharded, group_training, indices in groups:
                if sharded == ShardedState.UNSHARDED and not group.is_unsharded:
                    with group.use_training_state(TrainingState.PRE_BACKWARD):  # (the all-gather result freed at once)
                        group.unshard()
                        group.wait_for_unshard()
                elif sharded == ShardedState.SHARDED and not group.is_sharded:
                    group.reshard()
                group._training_state = group_training
                group._post_forward_indices[:] = indices
            state._training_state = training
            state._modules_to_run_forward.clear()
            state._modules_to_run_forward.update(to_run)
        if self.ctx is not None:
            ctx, root, queued = self.ctx
            ctx.iter_forward_root, ctx.post_backward_final_callback_queued = root, queued
        if self.comm is not None:
            comm, order = self.comm
            comm.post_forward_order[:] = order


class State:
    """The module's buffers (the tensors and their values), the random states and the Python state its forward and
    hooks can change (``side_effects``), to put back after a checking call."""

    def __init__(self, module: nn.Module, fsdp: bool = True) -> None:
        self.buffers = [(owner, name, tensor, tensor.detach().clone()) for owner in module.modules()
                        for name, tensor in owner._buffers.items() if tensor is not None]
        self.random_states = random_states.save()
        self.python = side_effects.kept(module)
        self.fsdp = FsdpKept(module) if fsdp else None  # (False: a forward-only check, FSDP2 puts its own state back)

    def restore(self) -> None:
        if self.fsdp is not None:
            self.fsdp.restore()
        self.python()
        with torch.no_grad():
            for owner, name, tensor, value in self.buffers:
                owner._buffers[name] = tensor
                tensor.copy_(value)
        random_states.restore(self.random_states)
