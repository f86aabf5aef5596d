"""torch's private surface, in one place: every private torch name the package uses is looked up here, once, at
import, with what it is for, the torch versions that have it (checked on 2.6.0, 2.8.0, 2.11.0, 2.14.1, 2.15.0, CPU
wheels, 2026-11-27) and what the package does without it.

Looking a name up never fails: a name this torch lacks is None here and listed in ``MISSING``; the code that would use
it takes the way described beside it, and where that loses a feature, ``degraded`` warns once, naming the torch version
and the feature. Importing the package therefore never fails on a torch of the supported range (2.6 and newer), or on
a newer torch that renamed something.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MISSING", "degraded"]

TORCH = torch.__version__.split("+")[0]
MISSING: dict[str, str] = {}  # private name -> what the package does without it
_TOLD: set[str] = set()


def _find(path: str, without: str) -> Any:
    """The object at ``path`` (``module:attribute.attribute``), or None, noted in ``MISSING`` with ``without``."""
    module_name, _, attributes = path.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for name in filter(None, attributes.split(".")):
            found = getattr(found, name)
    except Exception:  # absent, renamed, or its import fails on this build: the package goes on without it
        MISSING[path] = without
        return None
    return found


def degraded(feature: str, why: str) -> None:
    """Warn once per feature that this torch cannot do it (``why``: the private name it lacks, and what happens)."""
    if feature in _TOLD:
        return
    _TOLD.add(feature)
    from fxprof_lightning.nodes import FxprofWarning

    warnings.warn(f"fxprof_lightning: torch {torch.__version__} cannot {feature}: {why}", FxprofWarning, stacklevel=3)


# ---------------------------------------------------------------- Dynamo (``torch._dynamo``): the capture

# Dynamo's frontend with our backend (2.0+); ``isolate_recompiles`` (2.14+) gives the context a cache of its own.
# Without it, the forward the context wraps is a copy of the user's function with a code object of its own
# (``own_code``): Dynamo keeps its cache on the code object, so the user's ``torch.compile`` of the same forward is
# untouched. (Frames Dynamo starts after a graph break inside a submodule share the user's code objects there; a
# backend-match guard keeps each backend's graphs apart.)
_optimize = _find("torch._dynamo.eval_frame:_optimize", "no Dynamo capture: torch.fx's capture")
try:
    ISOLATED_CACHE = _optimize is not None and "isolate_recompiles" in inspect.signature(_optimize).parameters
except (TypeError, ValueError):
    ISOLATED_CACHE = False
# A context's cache entries for a code object: by region (2.14+), or all of them (2.0+; a copied code object's are ours).
_entries_for_region = _find("torch._dynamo.eval_frame:_get_cache_entries_for_region", "all the code's entries are read")
_entries_of_code = _find("torch._dynamo.eval_frame:_debug_get_cache_entry_list", "guards are not asked before a call")
# The frames Dynamo leaves to run eagerly (a hook run between graphs): per code object (2.8+), or skipped for good
# and forgotten by resetting the code's Dynamo state (2.6-2.7).
_set_code_exec_strategy = _find("torch._dynamo.eval_frame:set_code_exec_strategy", "skip_code and reset_code")
_FrameAction = _find("torch._dynamo.types:FrameAction", "skip_code and reset_code")
_FrameExecStrategy = _find("torch._dynamo.types:FrameExecStrategy", "skip_code and reset_code")
_skip_code = _find("torch._C._dynamo.eval_frame:skip_code", "hooks are not run eagerly between graphs")
_reset_code = _find("torch._C._dynamo.eval_frame:reset_code", "a skipped hook stays skipped")
# Dynamo's own rule table: which torch functions it keeps whole as one call (all versions of the range).
trace_rules = _find("torch._dynamo:trace_rules", "torch functions are kept whole")
# What Dynamo answers for "are we compiling?" while it traces (2.6+).
tracing_state_functions = _find("torch._dynamo.variables.torch:tracing_state_functions", "one way less to try")
# The rule that makes Dynamo break its graph at a call and run it eagerly (2.6+).
SkipFunctionVariable = _find("torch._dynamo.variables:SkipFunctionVariable", "hooks are not run eagerly between graphs")
# The graph breaks Dynamo counted, and their reasons (2.0+).
counters = _find("torch._dynamo.utils:counters", "graph breaks are not counted")
graph_break_reasons = _find("torch._dynamo.utils:graph_break_reasons", "graph breaks are not named")


def missing_for_dynamo() -> str | None:
    """What this torch lacks for the Dynamo capture (None: nothing): Dynamo's frontend, the reading of its cache
    entries and ``torch.compiler.set_stance`` (2.6+)."""
    if _optimize is None:
        return "torch._dynamo.eval_frame has no _optimize"
    if _entries_for_region is None and _entries_of_code is None:
        return "torch._dynamo.eval_frame has no _debug_get_cache_entry_list"
    if not hasattr(torch.compiler, "set_stance"):
        return "torch.compiler has no set_stance"
    return None


def dynamo_context(backend: Callable[..., Any], guard_fail_fn: Callable[[Any], None]) -> Any:
    """A Dynamo context running ``backend`` on each graph, with a cache of its own where this torch has one."""
    isolated = {"isolate_recompiles": True} if ISOLATED_CACHE else {}
    return torch._dynamo.optimize(backend, guard_fail_fn=guard_fail_fn, **isolated)


def region_of(context: Any) -> int | None:
    """The id of a context's own cache (None: the cache is the code object's, ``own_code``)."""
    return getattr(context, "_isolate_recompiles_id", None) if ISOLATED_CACHE else None


def own_code(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` itself where the Dynamo context has a cache of its own; else the same function (and the same
    bound object) with a copy of its code object, which holds a cache of its own. A forward of torch's own (which
    Dynamo would wrap in its ``wrap_inline`` frame, one code object for all) is called from a frame of ours instead,
    with a code object of its own."""
    function = getattr(forward, "__func__", forward)
    if ISOLATED_CACHE:
        return forward
    if not isinstance(function, types.FunctionType) or trace_rules is None or trace_rules.check(function):
        function, forward = _caller(forward), None
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__, copy.__dict__ = function.__kwdefaults__, dict(function.__dict__)
    copy.__qualname__, copy.__module__ = function.__qualname__, function.__module__
    return types.MethodType(copy, forward.__self__) if isinstance(forward, types.MethodType) else copy


def _caller(function: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return forward


def cache_entries(code: types.CodeType, region: int | None) -> list[Any]:
    """Dynamo's cache entries for ``code`` in a context's cache (``region_of``), each with its ``guard_manager``."""
    if region is not None and _entries_for_region is not None:
        return list(_entries_for_region(code, region))
    return list(_entries_of_code(code)) if _entries_of_code is not None else []


def dynamo_config(settings: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """``torch._dynamo.config.patch`` with those of ``settings`` this torch knows (each names a version beside it)."""
    config = torch._dynamo.config
    return config.patch({name: value for name, value in settings.items() if hasattr(config, name)})


def has_dynamo_setting(name: str) -> bool:
    return hasattr(torch._dynamo.config, name)


def frames_skipped(functions: tuple[Callable[..., Any], ...], skipped: bool) -> None:
    """Whether Dynamo leaves the frames of ``functions``, and the frames they call, to run eagerly."""
    if _set_code_exec_strategy is not None and _FrameAction is not None and _FrameExecStrategy is not None:
        action = _FrameAction.SKIP if skipped else _FrameAction.DEFAULT
        for function in functions:
            _set_code_exec_strategy(function.__code__, _FrameExecStrategy(action, action))
        return
    change = _skip_code if skipped else _reset_code
    if change is not None:
        for function in functions:
            change(function.__code__)


def source_name(node: Any) -> str:
    """The name of the source Dynamo gave a graph input (``L['self']._modules['0']._parameters['weight']``), '' where
    none: a property in 2.8+, a method in 2.6-2.7."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "") if source is not None else ""
    return (name() if callable(name) else name) or ""


# The higher-order op Dynamo puts a ``torch.utils.checkpoint`` region into (2.1+; not on ``torch.ops.higher_order``
# until first used in 2.6-2.7): without it, checkpointed regions are not opened into rows.
tag_activation_checkpoint = _find("torch._higher_order_ops.wrap:tag_activation_checkpoint", "checkpoints kept whole")


# ---- added by sound-range

# Where a Dynamo context has no cache of its own (< 2.14, ``ISOLATED_CACHE``), the frames Dynamo starts inside
# submodules (after a graph break in a loop) keep a dropped capture's cache entries on the user's code objects: a
# later capture of the same timer matches them (its backend compares equal) and compiles nothing. Forgetting them
# needs the codes Dynamo compiled (``input_codes``, 2.0+), the compile each graph came from (2.1+), and invalidating
# one entry as torch does when a guarded object dies (``ExtraState.invalidate``, 2.6+). Without them a capture after
# a dropped one reuses the dropped graphs.
_input_codes = _find("torch._dynamo.convert_frame:input_codes", "a dropped capture's graphs are not forgotten")
_DeletedGuardManager = _find("torch._dynamo.guards:DeletedGuardManagerWrapper",
                             "a dropped capture's graphs are not forgotten")


def current_compile_id() -> Any:
    """The id of the compile Dynamo is in (called from a backend), or None."""
    return torch._guards.CompileContext.current_compile_id()


def forget_compiles(compile_ids: set[Any]) -> None:
    """Invalidate the cache entries Dynamo made in the compiles ``compile_ids`` (their guards fail from now on), where
    a context has no cache of its own (``ISOLATED_CACHE``: a new context's cache is already empty)."""
    if ISOLATED_CACHE or not compile_ids or _input_codes is None or _DeletedGuardManager is None:
        return
    for reference in list(_input_codes.seen):
        code = reference()
        for entry in cache_entries(code, None) if code is not None else ():
            manager = entry.guard_manager
            if entry.compile_id in compile_ids and getattr(manager, "cache_entry", None) is not None:
                manager.extra_state.invalidate(manager.cache_entry, _DeletedGuardManager("dropped by fxprof_lightning"))

# The MoE experts' grouped matmul (``torch._grouped_mm``, 2.8+; not in 2.6): ``flops.float_grouped_mm_meta`` gives it
# a float32 meta kernel. Without it no model can call it, and the block changes nothing.
grouped_mm = _find("torch:_grouped_mm", "nothing to give a meta kernel (no model can call it)")
# What ``torch.utils.checkpoint(use_reentrant=False)`` runs at each call, looked up in its module at run time: the
# generator's ``_impl`` (2.14+), ``_checkpoint_without_reentrant_generator`` itself before (2.6-2.13). Without
# either, checkpointed calls are not counted (tests only; ``leaves.CHECKPOINT_INTERNALS`` takes both).
NON_REENTRANT_CHECKPOINT = next((name for name in ("_checkpoint_without_reentrant_generator_impl",
                                                   "_checkpoint_without_reentrant_generator")
                                 if _find(f"torch.utils.checkpoint:{name}", "the older name is tried") is not None), None)
