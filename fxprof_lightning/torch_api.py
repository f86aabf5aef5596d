"""torch's private surface, in one place: every private torch name the package uses is looked up here, once, at
import, with what it is for, the torch versions that have it (the Dynamo section checked on 2.6.0, 2.8.0, 2.11.0,
2.14.1, 2.15.0, CPU wheels, 2026-11-27; the sections after it on 2.6.0, 2.11.0, 2.14.1, 2.15.0; "2.6-2.15": all of
those) and what the package does without it. No other module touches ``torch._*`` (``tests/test_house.py``).

Looking a name up never fails: a name this torch lacks is None here and listed in ``MISSING``; the code using it takes
the way described beside it, and where that loses a feature, ``degraded`` warns once, naming the torch version and the
feature. Importing the package never fails on a torch of the supported range (2.6 and newer) or one renaming a name.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import inspect
import operator
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["MISSING", "degraded", "lacks"]

TORCH = torch.__version__.split("+")[0]
MISSING: dict[str, str] = {}  # private name -> what the package does without it
_TOLD: set[str] = set()


def _find(path: str, without: str, default: Any = None) -> Any:
    """The object at ``path`` (``module:attribute.attribute``), or ``default``, noted in ``MISSING`` with ``without``."""
    module_name, _, attributes = path.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for name in filter(None, attributes.split(".")):
            found = getattr(found, name)
    except Exception:  # absent, renamed, or its import fails on this build: the package goes on without it
        MISSING[path] = without
        return default
    return found


def lacks(path: str) -> bool:
    """Whether this torch lacks the private name at ``path`` (as ``_find`` was given it)."""
    return path in MISSING


def _function(path: str, without: str, feature: str | None = None, value: Any = None) -> Callable[..., Any]:
    """The function at ``path``; where absent, a stand-in: with no ``feature`` calling it fails, naming what is missing
    (reported by the caller's failure policy); with one, it warns once that ``feature`` is lost and returns ``value``."""
    found = _find(path, without)
    if found is not None:
        return found

    name = path.replace(":", ".")

    def missing(*args: Any, **kwargs: Any) -> Any:
        if feature is None:
            raise RuntimeError(f"torch {torch.__version__} has no {name}: {without}")
        degraded(feature, f"it has no {name}; {without}")
        return value

    return missing


def degraded(feature: str, why: str) -> None:
    """Warn once per feature that this torch cannot do it (``why``: the private name it lacks, and what happens)."""
    if feature in _TOLD:
        return
    _TOLD.add(feature)
    from fxprof_lightning import FxprofWarning

    warnings.warn(f"fxprof_lightning: torch {torch.__version__} cannot {feature}: {why}", FxprofWarning, stacklevel=3)


# ---------------------------------------------------------------- Dynamo (``torch._dynamo``): the capture
# Dynamo's frontend with our backend (2.0+); ``isolate_recompiles`` (2.14+) gives the context a cache of its own.
# Without it, the context wraps a copy of the user's forward with a code object of its own (``own_code``), which holds
# Dynamo's cache: the user's ``torch.compile`` of it is untouched (frames after a graph break inside a submodule share
# the user's code objects; a backend-match guard keeps each backend's graphs apart).
_optimize = _find("torch._dynamo.eval_frame:_optimize", "no Dynamo capture: module hooks")
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


def graph_break_counts() -> Any:
    """Dynamo's graph breaks so far in the process, by reason (where this torch lacks them: none, and a warning)."""
    if counters is None:
        degraded("count graph breaks", "it has no torch._dynamo.utils.counters")
    return counters["graph_break"] if counters is not None else {}


def graph_break_records() -> list[Any]:
    """Dynamo's record of its graph breaks, oldest first (where this torch lacks it: none, and a warning)."""
    if graph_break_reasons is None:
        degraded("name graph breaks", "it has no torch._dynamo.utils.graph_break_reasons")
    return graph_break_reasons if graph_break_reasons is not None else []


def missing_for_dynamo() -> str | None:
    """What this torch lacks for the capture (None: nothing): Dynamo's frontend, its cache entries, ``set_stance``."""
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
    """``forward`` itself where the Dynamo context has a cache of its own; else the same function (and bound object)
    with a copy of its code object, holding a cache of its own. One of torch's own (which Dynamo would wrap in its
    ``wrap_inline`` frame, one code object for all) is called from a frame of ours instead."""
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


def frames_skipped(functions: tuple[Callable[..., Any], ...], skipped: bool) -> None:
    """Whether Dynamo leaves the frames of ``functions``, and the frames they call, to run eagerly."""
    for function in functions:
        _code_skipped(function.__code__, skipped)


def _code_skipped(code: types.CodeType, skipped: bool) -> None:
    if _set_code_exec_strategy is not None and _FrameAction is not None and _FrameExecStrategy is not None:
        action = _FrameAction.SKIP if skipped else _FrameAction.DEFAULT
        _set_code_exec_strategy(code, _FrameExecStrategy(action, action))
    elif (change := _skip_code if skipped else _reset_code) is not None:
        change(code)


def source_name(node: Any) -> str:
    """The source Dynamo gave a graph input (``L['self']._parameters['weight']``; a method in 2.6-2.7), or ''."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "") if source is not None else ""
    return (name() if callable(name) else name) or ""


# The higher-order op Dynamo puts a ``torch.utils.checkpoint`` region into (2.1+; not on ``torch.ops.higher_order``
# until first used in 2.6-2.7): without it, checkpointed regions are not opened into rows.
tag_activation_checkpoint = _find("torch._higher_order_ops.wrap:tag_activation_checkpoint", "checkpoints kept whole")

# ---------------------------------------------------------------- Dynamo, continued
# Older aliases of ``torch.compiler.is_compiling`` (2.6-2.15): without one, the public two are answered alone.
external_is_compiling = _find("torch._dynamo.external_utils:is_compiling", "the public is_compiling answered alone")
utils_is_compiling = _find("torch._utils:is_compiling", "the public is_compiling answered alone")
# A float read from a tensor (2.6-2.15): Dynamo's resumed frame of it must run eagerly; without it, nothing to skip.
as_tensor_fullprec = _find("torch:_as_tensor_fullprec", "no frame of it to keep eager")
# MultiheadAttention's mask check (2.6-2.15), which Dynamo breaks its graph on: without it, nothing to swap.
check_key_padding_mask = _find("torch.nn.functional:_check_key_padding_mask", "no mask check to make traceable")
# The hooks every module runs (``register_module_forward_hook`` and kin; 2.6-2.15): without them, none are seen.
GLOBAL_MODULE_HOOKS = tuple(_find(f"torch.nn.modules.module:_global_{name}_hooks", "no global hooks seen", {})
                            for name in ("forward_pre", "forward", "backward_pre", "backward"))
# Where a checkpointed region saves the inputs kept for its recompute, seen from the pack hook: ``_CheckpointFrame.
# save_inputs`` (2.14+), ``_checkpoint_without_reentrant_generator``'s ``_NoopSaveInputs.apply`` (2.6-2.13). Without
# it they count as saved activations in the checking calls (HF's checkpointing refused).
_saver = (_find("torch.utils.checkpoint:_CheckpointFrame.save_inputs", "the generator's frame looked for")
          or _find("torch.utils.checkpoint:_checkpoint_without_reentrant_generator", "kept inputs counted"))
CHECKPOINT_INPUT_SAVERS = (_saver.__code__,) if _saver is not None else ()

# ---------------------------------------------------------------- the autograd engine: capture and timing
# The id of the backward pass the engine runs (-1: none; 2.6-2.15): tells a recompute inside backward (activation
# checkpointing) from a forward call; without it, every call counts as forward.
current_graph_task_id = _function("torch._C:_current_graph_task_id", "recomputes in backward count as forward",
                                  "tell a recompute inside backward from a forward call", -1)
# The autograd node the engine runs (2.6-2.15): ties a recompute or an FSDP2 collective to its node (without: none).
current_autograd_node = _function("torch._C:_current_autograd_node", "recomputes and collectives tied to no node",
                                  "tie a backward recompute or collective to its autograd node", None)
# The sequence number the next autograd node gets (2.6-2.15): per-node backward timing and FLOP counting rest on it
# (they fail at use without it). ``AUTOGRAD`` holds it for the instrumented forward (a local there, one lookup away).
sequence_nr_now = _function("torch._C._autograd:_get_sequence_nr", "backward timing and FLOP counting fail at use")
AUTOGRAD = types.SimpleNamespace(sequence_nr=sequence_nr_now)
# An autograd node's sequence number, the order of the forward op that made it (every torch of the range).
node_sequence_nr = operator.methodcaller("_sequence_nr")
# A callback the engine runs at the end of the backward pass (2.6-2.15): where a backward ends; the loop's phases and
# backward timing by hooks rest on it (they fail at use without it).
queue_callback = _function("torch.autograd:Variable._execution_engine.queue_callback", "backward ends fail at use")
# Where a backward pass starts (2.6-2.15): without it, the search for a collective's node goes to the stack's top.
engine_run_backward = _find("torch.autograd.graph:_engine_run_backward", "the stack searched to its top")

# ---------------------------------------------------------------- the profiler's C++ side: backward events
# Whether the C++ profiler runs (2.6-2.15): without it, another profiler is not noticed before ours starts.
profiler_enabled = _function("torch._C._autograd:_profiler_enabled", "another profiler is not noticed",
                             "notice another profiler running", False)
# Starting and stopping the C++ profiler for the backward scope alone, and its settings (2.6-2.15): without one of
# them, no backward events (the backward is timed by hooks).
_BACKWARD_EVENTS = {path: _find(path, "backward timed by hooks") for path in (
    "torch._C._autograd:_prepare_profiler", "torch._C._autograd:_enable_profiler",
    "torch._C._autograd:_disable_profiler", "torch._C._profiler:ProfilerConfig", "torch._C._profiler:ProfilerState",
    "torch._C._profiler:ProfilerActivity", "torch._C._profiler:_ExperimentalConfig", "torch._C._profiler:RecordScope")}
RecordScope = _BACKWARD_EVENTS["torch._C._profiler:RecordScope"]
# Set while a torch.profiler session runs (2.6-2.15): without it, one over ours is seen only once the profiler is off.
_find("torch.autograd.profiler:_is_profiler_enabled", "a session over ours noticed only once the profiler is off")
# torch's lean profiler range, ~1 us (2.6-2.15): without it, ``record_function``'s (3-7 us) bound the anchors.
RecordFunctionFast = _find("torch._C._profiler:_RecordFunctionFast", "record_function's ranges")


def missing_for_backward_events() -> str | None:  # the first piece of the C++ profiler this torch lacks for backward events (None: nothing)
    return next((path for path, found in _BACKWARD_EVENTS.items() if found is None), None)


def start_backward_events() -> None:
    """The C++ profiler on, CPU activity, the backward scope alone (forward ops pay nothing)."""
    ProfilerConfig, ProfilerState, ProfilerActivity, ExperimentalConfig = (_BACKWARD_EVENTS[f"torch._C._profiler:{name}"]
        for name in ("ProfilerConfig", "ProfilerState", "ProfilerActivity", "_ExperimentalConfig"))
    config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False, ExperimentalConfig())
    _BACKWARD_EVENTS["torch._C._autograd:_prepare_profiler"](config, {ProfilerActivity.CPU})
    _BACKWARD_EVENTS["torch._C._autograd:_enable_profiler"](config, {ProfilerActivity.CPU}, {RecordScope.BACKWARD_FUNCTION})


def stop_backward_events() -> Any:  # the C++ profiler off: its results (``events()``)
    return _BACKWARD_EVENTS["torch._C._autograd:_disable_profiler"]()


def torch_profiler_running() -> bool:  # whether a torch.profiler session runs (read at each call: torch sets it)
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))

# ---------------------------------------------------------------- dispatch and pytree: FLOPs and the checks
# Python kernels (meta ones) in dispatch (2.6-2.15): FLOP counting runs under it; without it, ops whose meta kernel
# is Python's get no FLOPs (each reported as a node without one).
enable_python_dispatcher = _find("torch._dispatch.python:enable_python_dispatcher", "Python meta kernels unused",
                                 contextlib.nullcontext)
# The Meta dispatch key (2.6-2.15): without it, float ``aten._grouped_mm`` gets no meta kernel (no FLOPs, no trace).
META_KEY = _find("torch._C:DispatchKey.Meta", "no float meta kernel for aten._grouped_mm")
# The MoE experts' op (2.11+; not 2.6): without it, no formula or meta kernel of ours for it.
grouped_mm = _find("torch:ops.aten._grouped_mm", "no FLOP formula for it")
# Fake tensors' cache (``FakeTensorMode.cache``, 2.6-2.15): its entries made while our kernel was in place are dropped.
FakeTensorMode = _find("torch._subclasses.fake_tensor:FakeTensorMode", "no fake-tensor cache to clear")
# Nested containers' leaves (2.6-2.15): the checks rest on them (they fail at use without them).
tree_leaves = _function("torch.utils._pytree:tree_leaves", "the checks fail at use")

# ---------------------------------------------------------------- Inductor: per-layer times of compiled modules
# Inductor's and AOTAutograd's settings (2.6-2.15; ``trace.provenance_tracking_to_timeline`` 2.14+), a compiled
# graph's id (2.6-2.15) and its kernels' origins (2.14+; not 2.6, 2.11): without one, compiled modules get no
# per-layer times from kernels (``missing_for_kernels``).
inductor_config = _find("torch._inductor.config", "no per-layer times from kernels")
functorch_config = _find("torch._functorch.config", "no per-layer times from kernels")
CompileContext = _find("torch._guards:CompileContext", "no per-layer times from kernels")
get_kernel_information_jsons = _find("torch._inductor.debug:get_kernel_information_jsons", "no per-layer times from kernels")

# ---------------------------------------------------------------- FSDP2's private state (``fully_shard``)
# A module's FSDP2 state, its parameter groups and their states (2.6-2.15): the checking calls put them back after
# them; without one, an FSDP2 model is not captured by Dynamo (``verify.fsdp2_kept``) and gets no collective rows.
get_module_fsdp_state = _find("torch.distributed.fsdp._fully_shard._fsdp_state:_get_module_fsdp_state", "not kept")
FSDPState = _find("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", "not kept")
FSDPParamGroup = _find("torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup", "not kept")
ShardedState = _find("torch.distributed.fsdp._fully_shard._fsdp_param_group:ShardedState", "not kept")
TrainingState = _find("torch.distributed.fsdp._fully_shard._fsdp_common:TrainingState", "not kept")


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups (``_fsdp_param_groups`` 2.14+; one ``_fsdp_param_group`` in 2.6-2.13)."""
    groups, group = getattr(state, "_fsdp_param_groups", None), getattr(state, "_fsdp_param_group", None)
    return list(groups) if groups is not None else [group] if group is not None else []


# The backend a ``torch.compile``'d module was given, by name (2.6-2.15): ``OptimizedModule.dynamo_ctx.callback``'s
# wrappers hold the one inside (``_torchdynamo_orig_backend``/``_callable``) down to the backend's, with its
# ``compiler_name``. Without it (a ``module.compile()``: the context in a closure), known after the cycle only.
def compile_backend(module: Any) -> str | None:
    """The name of the backend ``module`` (an ``OptimizedModule``) is compiled by, or None where not known."""
    found = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(8):  # (four wrappers deep in 2.6-2.15)
        if found is None or isinstance(name := getattr(found, "compiler_name", None), str):
            return name if found is not None else None
        found = getattr(found, "_torchdynamo_orig_backend", None) or getattr(found, "_torchdynamo_orig_callable", None)
    return None


# Dynamo starts a frame at the forward of a torch.nn (or torch.ao) module with hooks, though torch.nn's files are
# skipped (2.14+: ``trace_rules.check_verbose`` takes the ``frame``): after a graph break at a hook run eagerly, the
# module's ops get a graph of their own. Before (2.6, 2.11) that frame is skipped, its ops untimed: ``hooked_forward``
# gives such a module a forward of its own, a frame of ours calling torch's, which Dynamo starts.
try:
    HOOKED_FORWARD_FRAMES = trace_rules is not None and "frame" in inspect.signature(trace_rules.check_verbose).parameters
except (AttributeError, TypeError, ValueError):
    HOOKED_FORWARD_FRAMES = False


def hooked_forward(module: Any) -> Callable[..., Any] | None:
    """Where Dynamo would skip a hooked torch.nn ``module``'s forward frame (without ``HOOKED_FORWARD_FRAMES``): a
    function calling its forward, for its ``forward`` attribute (a frame Dynamo starts); None where not needed."""
    if HOOKED_FORWARD_FRAMES or "forward" in module.__dict__ or not (module._forward_hooks or module._forward_pre_hooks):
        return None
    return _caller(module.forward) if type(module).__module__.startswith(("torch.nn.", "torch.ao.")) else None


def compiling_answers() -> dict[Any, Any]:
    """Dynamo's answers for "are we compiling?" while it traces, a dict to edit (a function's cached dict in 2.11+, the
    dict in 2.6; empty where missing: Dynamo answers them, and a model that branches on them is refused)."""
    answers = tracing_state_functions() if callable(tracing_state_functions) else tracing_state_functions
    return answers if isinstance(answers, dict) else {}

# Forgetting compiled graphs (a dropped capture's where a context has no cache of its own, < 2.14; a compiled module's
# compiled without Inductor's records): the codes Dynamo compiled (2.0+), invalidating one entry (2.6+). Without: kept.
_input_codes = _find("torch._dynamo.convert_frame:input_codes", "compiled graphs are not forgotten")
_DeletedGuardManager = _find("torch._dynamo.guards:DeletedGuardManagerWrapper", "compiled graphs are not forgotten")


def current_compile_id() -> Any:
    """The id of the compile Dynamo is in (called from a backend), or None."""
    return CompileContext.current_compile_id()


def forget_compiles(compile_ids: set[Any], shared: bool = False) -> None:
    """Invalidate the cache entries of the compiles ``compile_ids`` (ids or ``"0/0"``; the next call compiles again):
    our captures' where a context has no cache of its own (``ISOLATED_CACHE``), or (``shared``) the user's own."""
    if (ISOLATED_CACHE and not shared) or not compile_ids or _input_codes is None or _DeletedGuardManager is None:
        return
    for reference in list(_input_codes.seen):
        code = reference()
        for entry in cache_entries(code, None) if code is not None else ():
            manager = entry.guard_manager
            if ((entry.compile_id in compile_ids or str(entry.compile_id) in compile_ids)
                    and getattr(manager, "cache_entry", None) is not None):
                manager.extra_state.invalidate(manager.cache_entry, _DeletedGuardManager("dropped by fxprof_lightning"))


# Functions libraries call inside ``try``/``except`` that 2.6 lacks: ``torch.compiler.is_exporting`` and
# ``torch.xpu.is_current_stream_capturing`` (2.7+; HF's masks ask both): Dynamo 2.6 cannot trace the ``AttributeError``,
# and the capture failed (HF Llama). While a capture is installed, such a torch lends one answering False.
_LENT = [(owner, name) for owner, name in ((torch.compiler, "is_exporting"),
                                           (getattr(torch, "xpu", None), "is_current_stream_capturing"))
         if owner is not None and not hasattr(owner, name)]


def _answers_false() -> bool:
    return False


def lend_missing_queries(lent: bool) -> None:
    """Put the missing functions (answering False, one object: Dynamo guards on it) in place, or take them back."""
    for owner, name in _LENT:
        if lent:
            setattr(owner, name, _answers_false)
        elif getattr(owner, name, None) is _answers_false:
            delattr(owner, name)

# Inductor's record of the post-grad nodes each kernel was made from, kept while ``trace.provenance_tracking_level``
# is not 0 (2.11+; not 2.6, 2.8), read at each post-grad pass (``kernel_provenance``) where 2.14's
# ``provenance_tracking_to_timeline`` is absent. Without it, no per-layer times from kernels (``missing_for_kernels``).
inductor_debug = _find("torch._inductor.debug", "no per-layer times from kernels")
PROVENANCE_LEVEL = (inductor_config is not None and hasattr(inductor_config.trace, "provenance_tracking_level")
                    and isinstance(getattr(inductor_debug, "_inductor_triton_kernel_to_post_grad_node_info", None), dict)
                    and isinstance(getattr(inductor_debug, "_inductor_kernel_provenance_debug_handle", None), int))
if not PROVENANCE_LEVEL:
    MISSING["torch._inductor.debug:_inductor_triton_kernel_to_post_grad_node_info"] = "no per-layer times from kernels"


def kernel_provenance() -> tuple[dict[str, list[str]], int]:
    """Inductor's kernel -> post-grad nodes record (``PROVENANCE_LEVEL``) and its last debug handle: kernels added
    after a graph's post-grad pass have greater ones."""
    return (inductor_debug._inductor_triton_kernel_to_post_grad_node_info,
            inductor_debug._inductor_kernel_provenance_debug_handle)

# Whether Dynamo's guards catch a flip of a parameter's ``requires_grad`` (``BackboneFinetuning`` unfreezing a backbone;
# a version's behaviour, no private name): before 2.14 (2.6.0, 2.11.0) the C++ guard manager skips the TENSOR_MATCH of
# a tensor in a dict (``_parameters``) whose version tag is unchanged, which ``requires_grad_`` leaves (2.11's
# ``config.skip_tensor_guards_with_matching_dict_tags``). Where False, the timer compares the flags itself before each
# call (``dynamo._parameter_flags``) and captures again in a fresh cache; nothing is lost.
PARAMETER_FLAGS_GUARDED = torch.torch_version.TorchVersion(TORCH) >= "2.14"
# Whether Dynamo traces the module-level ``random.random()`` into its graph, replaying the draw (2.14.1); before (2.6.0,
# 2.11.0) it breaks the graph there and draws eagerly; the resumed frame gets the float as a constant, then as an input
# (automatic dynamic: one call missing the guards, untimed, then a capture). Tests read it to expect each capture.
TRACES_RANDOM_RANDOM = torch.torch_version.TorchVersion(TORCH) >= "2.14"
# ``torch.cuda.is_current_stream_capturing`` raises on a CUDA build without its driver (documented: False); eager's
# ``try``/``except`` (HF's ``is_tracing``) makes that False, but Dynamo before 2.14 failed the capture (2.6, 2.11: HF
# Llama, GPT-2). There it answers False while a capture is installed (its code swapped, its identity kept: guarded).
TRACES_STREAM_QUERY_WITHOUT_CUDA = torch.torch_version.TorchVersion(TORCH) >= "2.14"
_stream_query = _find("torch.cuda.graphs:is_current_stream_capturing", "nothing to answer")
_STREAM_QUERY_CODE = getattr(_stream_query, "__code__", None)


def lend_stream_query(lent: bool) -> None:
    """Make ``is_current_stream_capturing`` answer False (``lent``), or put its code back, where it would raise."""
    if TRACES_STREAM_QUERY_WITHOUT_CUDA or _STREAM_QUERY_CODE is None or torch.cuda.is_available():
        return
    _stream_query.__code__ = _answers_false.__code__ if lent else _STREAM_QUERY_CODE


# Following torch's own frames after a graph break (the capture's "follow" way, ``dynamo_ways.Ways.explore``): Dynamo's
# ``dont_skip_tracing`` (2.8+) makes ``trace_rules.lookup_inner`` answer "trace" for all but Dynamo's own functions. On
# 2.6-2.7 ``following`` swaps in, for the capture alone, a ``lookup_inner`` answering so for torch's own code (Python's
# stays skipped; it, ``getfile``, ``_module_dir``, the two variable classes: 2.6-2.15). Without one (``FOLLOWS``
# False), torch's frames after a graph break run eagerly, untimed (``degraded`` says so where asked).
_lookup_inner = _find("torch._dynamo.trace_rules:lookup_inner", "torch's frames after a break run untimed")
_getfile = _find("torch._dynamo.trace_rules:getfile", "torch's frames after a break run untimed")
_module_dir = _find("torch._dynamo.trace_rules:_module_dir", "torch's frames after a break run untimed")
UserFunctionVariable = _find("torch._dynamo.variables:UserFunctionVariable", "torch's frames after a break run untimed")
DONT_SKIP_TRACING = hasattr(torch._dynamo.config, "dont_skip_tracing")  # (2.8+)
FOLLOWS = DONT_SKIP_TRACING or None not in (
    _lookup_inner, _getfile, _module_dir, SkipFunctionVariable, UserFunctionVariable)
# Where a Dynamo context has no cache of its own (< 2.14), a frame its trace rules skipped (``trace_rules.check``,
# 2.6-2.15) stays marked skipped on its code object for every later context: torch's frames that a capture not
# following them skipped (``nn.Transformer``'s layers after its mask check) stayed skipped in a following one (2.11).
# ``following`` notes those codes in each capture and marks them not skipped (``_code_skipped``) before one that
# follows them. Without ``trace_rules.check`` nothing is noted: torch's frames stay untimed there, as before.
_check = getattr(trace_rules, "check", None)
_SKIPPED: weakref.WeakSet[types.CodeType] = weakref.WeakSet()  # codes Dynamo's trace rules skipped in a capture (< 2.14)


@contextlib.contextmanager
def following(follow: bool, settings: dict[str, Any]) -> Any:
    """Inside the block (one capture), Dynamo's ``settings``; Dynamo follows torch's own frames after a graph break
    where ``follow`` (``dont_skip_tracing``, or ``_followed_lookup``); where a context has no cache of its own, the
    frames a capture before skipped are first marked not skipped, and those this capture skips are noted."""
    if follow and not FOLLOWS:
        degraded("follow torch's own frames after a graph break",
                 "it has neither torch._dynamo.config.dont_skip_tracing nor the trace rules to answer as it; torch's "
                 "own code after a graph break runs eagerly, untimed")
    saved: dict[str, Any] = {}
    if not ISOLATED_CACHE and _check is not None:
        if follow:  # torch's frames a capture before skipped (not Dynamo's own, nor codes holding cache entries)
            for code in [c for c in _SKIPPED if _torch_not_dynamo(c.co_filename) and not cache_entries(c, None)]:
                _code_skipped(code, False)
            _SKIPPED.clear()
        saved["check"] = _check
        trace_rules.check = _noting_check
    if follow and FOLLOWS and not DONT_SKIP_TRACING:
        saved["lookup_inner"] = _lookup_inner
        trace_rules.lookup_inner = _followed_lookup
    try:
        config = torch._dynamo.config  # (those of the settings this torch knows: each names a version beside it)
        with config.patch({n: v for n, v in {**settings, "dont_skip_tracing": follow}.items() if hasattr(config, n)}):
            yield
    finally:
        for name, value in saved.items():
            setattr(trace_rules, name, value)


def _noting_check(obj: Any, *args: Any, **kwargs: Any) -> bool:
    skipped = _check(obj, *args, **kwargs)
    if skipped and isinstance(obj, types.CodeType):
        _SKIPPED.add(obj)
    return skipped


def _torch_not_dynamo(filename: str) -> bool:
    """Whether ``filename`` is torch's own code but not Dynamo's."""
    torch_files, filename = str(_module_dir(torch)).replace("\\", "/"), filename.replace("\\", "/")
    return filename.startswith(torch_files) and not filename.startswith(torch_files + "_dynamo")


def _followed_lookup(obj: Any, name: Any = None, filename: Any = None, is_direct_call: bool = True,
                     reasons: Any = None) -> Any:
    """``trace_rules.lookup_inner`` answering as ``dont_skip_tracing`` (2.8+) makes it for torch's own code, not Dynamo's."""
    rule = _lookup_inner(obj, name, filename, is_direct_call, reasons)
    if rule is not SkipFunctionVariable:
        return rule
    filename = filename if filename is not None else _getfile(obj)
    if filename is None or not _torch_not_dynamo(str(filename)):
        return rule
    if reasons is not None:
        reasons.add("followed by fxprof_lightning (as torch._dynamo.config.dont_skip_tracing would)")
    return UserFunctionVariable


# Whether Dynamo goes on after a graph break inside a loop (2.11, 2.14, 2.15 yes; 2.6 no: the frame runs eagerly,
# its layers untimed, each named in ``Capture.untimed``: HF Llama's ``lm_head``; and before 2.8 its code stays skipped
# in every context: a shared HF wrapper skipped in Wav2Vec2's capture left the next model's frames all eager).
RESUMES_IN_LOOPS = torch.torch_version.TorchVersion(TORCH) >= "2.11"


def codes_unskipped(kept: set[int] | None = None) -> set[int]:
    """Where Dynamo skips a code for good (< 2.8), each code it saw not skipped but those in ``kept`` (None: none
    changed); the ids of the codes it saw so far (a run notes them at its start and keeps them at its end)."""
    codes = [c for c in (r() for r in list(_input_codes.seen)) if c is not None] if _input_codes is not None else []
    for code in codes if kept is not None and _set_code_exec_strategy is None else ():
        if id(code) not in kept:
            _code_skipped(code, False)
    return {id(code) for code in codes}

# ---------------------------------------------------------------- saved tensors: what autograd keeps for backward
# Read running no hook, recomputing nothing: a node's ``_raw_saved_<name>`` (2.6-2.15), ``SavedTensor.data`` and
# ``.unpack_hook`` (2.11-2.15). On 2.6-2.10 ``_saved_<name>`` unpacks, running no hook where none was on top when the
# node was made: ``_push``/``_pop_saved_tensors_default_hooks`` (2.6-2.15), wrapped from the first read on (Dynamo guards
# on them), note those pushed in the forward call (``note_saved_hooks``); without them, no saved bytes. A checkpoint's
# unpack hook holds its ``_CheckpointFrame``: inputs in ``saved_args`` (2.14+), ``input_saver.grad_fn`` (2.6-2.13).
_SavedTensor = _find("torch._C._autograd:SavedTensor", "no saved bytes")
HAS_DATA = None not in [_find(f"torch._C._autograd:SavedTensor.{n}", "saved bytes by unpacking") for n in ("data", "unpack_hook")]
_push, _pop = (_find(f"torch._C._autograd:_{n}_saved_tensors_default_hooks", "no saved bytes") for n in ("push", "pop"))
READS_SAVED_TENSORS = HAS_DATA or None not in (_push, _pop)
_RAW_SAVED: dict[type, tuple[str, ...]] = {}  # node type -> its ``_raw_saved_<name>`` attributes
_NOTES: list[Any] = []  # (``note_saved_hooks``) the thread, its notes, the unpack hooks pushed since


def note_saved_hooks(notes: list[tuple[int, Any]] | None) -> None:
    """Until None: each change of the hooks on top in this thread into ``notes`` (sequence number, unpack hook or None);
    the first call wraps torch's push and pop for good (pass-through; not at import: the user's own code is untouched
    until a cycle reads saved bytes)."""
    hooks = torch._C._autograd
    if notes is not None and not HAS_DATA and READS_SAVED_TENSORS and hooks._pop_saved_tensors_default_hooks is _pop:
        hooks._push_saved_tensors_default_hooks, hooks._pop_saved_tensors_default_hooks = _noting_push, _noting_pop
    _NOTES[:] = [threading.get_ident(), notes, []] if notes is not None else []


def _noting_push(pack_hook: Any, unpack_hook: Any) -> None:
    _push(pack_hook, unpack_hook)
    if _NOTES and _NOTES[0] == threading.get_ident():
        _NOTES[2].append(unpack_hook)
        _NOTES[1].append((sequence_nr_now(), unpack_hook))


def _noting_pop() -> None:
    _pop()
    if _NOTES and _NOTES[0] == threading.get_ident() and _NOTES[2]:
        _NOTES[2].pop()
        _NOTES[1].append((sequence_nr_now(), _NOTES[2][-1] if _NOTES[2] else None))


def saved_tensors(node: Any, notes: list[tuple[int, Any]] | None = None) -> list[tuple[Any, Any]]:
    """``(tensor or None, unpack hook or None)`` per tensor ``node`` saved (``notes``: its call's, without ``HAS_DATA``)."""
    if (names := _RAW_SAVED.get(type(node))) is None:
        names = _RAW_SAVED[type(node)] = tuple(n for n in dir(type(node)) if n.startswith("_raw_saved_"))
    if HAS_DATA:
        return [(s.data, s.unpack_hook) for s in _flat(getattr(node, n) for n in names)]
    at = bisect.bisect_right(notes or [], node_sequence_nr(node), key=lambda note: note[0]) - 1
    if notes is None or (at >= 0 and notes[at][1] is not None):  # (not noted, or packed by the hook on top then)
        return [(None, notes[at][1]) for _ in _flat(getattr(node, n) for n in names)] if notes else []
    try:  # no hook on top: unpacking runs none (an op's ``_saved_x``, a Function's ``saved_tensors``)
        return [(t, None) for t in _flat(getattr(node, n[4:] if hasattr(type(node), n[4:]) else "saved_tensors")
                                         for n in names)]
    except RuntimeError:  # modified in place since: unknown to backward as well
        return []


def _flat(values: Any) -> list[Any]:
    return [s for v in values for s in (v if isinstance(v, tuple | list) else (v,)) if s is not None]


def checkpoint_inputs(unpack_hook: Any, notes: list[tuple[int, Any]] | None = None) -> tuple[Any, list[Any]] | None:
    """The frame of the checkpointed region whose unpack hook this is and the inputs it keeps; None: another hook."""
    code = getattr(unpack_hook, "__code__", None)
    if code is None or code.co_filename != torch.utils.checkpoint.__file__ or "frame" not in code.co_freevars:
        return None
    frame = unpack_hook.__closure__[code.co_freevars.index("frame")].cell_contents
    saved, node = getattr(frame, "saved_args", None), getattr(getattr(frame, "input_saver", None), "grad_fn", None)
    kept = [(s.data, None) for s in saved if isinstance(s, _SavedTensor)] if isinstance(saved, list) else (
        saved_tensors(node, notes) if node is not None else [])
    return frame, [t for t, hook in kept if hook is None]
