"""Dynamo's graph breaks read: its count of them by reason, where the forward reads a tensor's value on the host,
and the row of the code Dynamo runs eagerly after a graph that ended at a break."""

from __future__ import annotations

import linecache
import re
from typing import Any

from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.nodes import NodeInfo, module_stack
from fxprof_lightning.timing.forward_swap import own_class

__all__ = ["GRAPH_BREAK", "HOST_READS", "break_row", "graph_break_counter", "graph_break_reasons", "host_reads", "resumed_from"]


def resumed_from(function: str) -> str:
    """The user's function a Dynamo frame runs: a frame resumed after a graph break is named
    ``torch_dynamo_resume_in_<function>_at_<line>``."""
    return re.sub(r"^torch_dynamo_resume_in_(.+)_at_\d+$", r"\1", function)


def graph_break_counter() -> dict[str, int]:
    return torch_api.graph_break_counts()


def graph_break_reasons() -> list[Any]:
    """Dynamo's record of its graph breaks (``GraphCompileReason``: the reason and the user's stack), oldest first."""
    return torch_api.graph_break_records()


# What a graph break's reason (its first line) says the code did with a tensor's value on the host: each waits for
# the device to finish all the work queued before it (a host sync), at every call. Dynamo's wording differs by
# version, so each entry is a part of the first line, matched case-insensitively: "Tensor.item" (2.6; 2.11 and 2.14
# read "Unsupported Tensor.item() call ..."), a branch as "Dynamic control flow is not supported" (2.6) or
# "Data-dependent branching" (2.11, 2.14) in the graph that breaks, and "generic_jump TensorVariable()" in the frame
# Dynamo starts again at the branch (all versions; after a recapture only the former may be recorded).
HOST_READS = {
    "Tensor.item": "reads a tensor's value (`.item()`, `float(t)`, `bool(t)`)",
    "Tensor.tolist": "reads a tensor's values (`.tolist()`)",
    "generic_jump TensorVariable": "branches on a tensor's value (`if t ...:`)",
    "Data-dependent branching": "branches on a tensor's value (`if t ...:`)",
    "Dynamic control flow is not supported": "branches on a tensor's value (`if t ...:`)",
    "Dynamic shape operator": "calls an op whose output size depends on the values (`nonzero`, a boolean mask)",
    "Data dependent operator": "needs a tensor's values on the host (`.numpy()`, a data-dependent op)",
}


def host_reads(reasons: list[Any], root: nn.Module) -> dict[str, str]:
    """Where the forward reads tensors' values on the host, from Dynamo's graph-break ``reasons``: module path ->
    what and where (``'branches on a tensor's value (`if t ...:`) at model.py:81'``). The place is the innermost frame
    of the break's stack that runs a submodule's ``forward``, matched to the submodules of that class (all of them,
    comma-separated, when several share it); a break whose stack runs no submodule's forward is left out."""
    found: dict[str, str] = {}
    modules = list(root.named_modules())
    for reason in reasons:
        first = reason.reason.splitlines()[0].lower() if reason.reason else ""
        what = next((text for key, text in HOST_READS.items() if key.lower() in first), None)
        if what is None or not reason.user_stack:
            continue
        inner = reason.user_stack[-1]
        where = f"{what} at {inner.filename.rsplit('/', 1)[-1]}:{inner.lineno}"
        for frame in reversed(reason.user_stack):  # the innermost frame that runs a submodule's forward
            paths = [path or "(root)" for path, m in modules if _runs_in(own_class(m).forward, frame)]
            if paths:
                inside = f" (in `{inner.name}`, called from its forward)" if frame is not inner else ""
                found.setdefault(", ".join(paths), where + inside)
                break
    return found


GRAPH_BREAK = "graph_break"  # the op of a row of code Dynamo ran eagerly, between two graphs


def break_row(reason: Any, root: nn.Module | None) -> NodeInfo | None:
    """The row of the code Dynamo runs eagerly after a graph that ended at a graph break (``reason``: the graph's
    ``compile_subgraph_reason``), until the next graph starts: named by the function and line where the graph
    broke, with the code of that line (``maybe_slow (train.py:25): time.sleep(0.03)``; a module's forward as
    ``Block.forward``), in the module whose forward runs there (none where several modules share that code: one
    row for all of them). None for a graph that ended at its frame's return."""
    if reason is None or not getattr(reason, "graph_break", False) or not reason.user_stack:
        return None
    frame = reason.user_stack[0]  # the frame whose graph broke
    modules = list(root.named_modules()) if root is not None else []
    runs = [(path, module) for path, module in modules if _runs_in(own_class(module).forward, frame)]
    function = resumed_from(frame.name)
    function = getattr(own_class(runs[0][1]).forward, "__qualname__", function) if runs else function
    where = f"{function} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
    code = linecache.getline(frame.filename, frame.lineno or 0).strip()
    name = f"{where}: {code[:40]}{'...' if len(code) > 40 else ''}" if code else where
    for inner in reversed(reason.user_stack):  # the innermost frame that runs a module's forward
        if runs := [path for path, module in modules if _runs_in(own_class(module).forward, inner)]:
            break
    path = runs[0] if len(runs) == 1 else ""
    return NodeInfo(name, GRAPH_BREAK, reason.reason.splitlines()[0] if reason.reason else where, path, module_stack(path))


def _runs_in(function: Any, frame: Any) -> bool:
    """Whether a stack ``frame`` is a line of ``function`` (its file, name and line range)."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_filename != frame.filename or code.co_name != frame.name:
        return False
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return code.co_firstlineno <= (frame.lineno or 0) <= max(lines, default=code.co_firstlineno)
