"""The package's vocabulary for timed nodes: what a row of a node table is (``NodeInfo``) and how a graph node
gets one. No torch import, so the reports, ``runs`` and the ``fxprof`` command load without torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import fx

__all__ = ["JOINS", "NESTS", "ROW", "TIMED_OPS", "UNTIMED", "NodeInfo", "describe_target", "is_timed", "mark_untimed", "node_info"]

# Node kinds that run code worth timing; placeholders, get_attr and output only move references.
TIMED_OPS = ("call_module", "call_function", "call_method")
# ``node.meta`` key of nodes a capture puts into a graph that are bookkeeping, not the model's work
# (guards, grad-mode switches, rebuilt objects): ``mark_untimed``.
UNTIMED = "fxprof_untimed"
# ``node.meta`` keys a capture may set: the ``NodeInfo`` of the node's row (default: ``node_info``), and whether
# the node is timed together with the timed node before it (one row for several ops).
ROW = "fxprof_row"
JOINS = "fxprof_joins_previous"
# ``node.meta`` key of an untimed node that runs an instrumented graph of its own (a checkpointed region, whose ops
# are rows): the timed nodes after it go on with the call of the graph it is in.
NESTS = "fxprof_nests"


def mark_untimed(node: fx.Node) -> fx.Node:
    """Mark a node as bookkeeping: it runs, untimed, with no row of its own."""
    node.meta[UNTIMED] = True
    return node


def is_timed(node: fx.Node) -> bool:
    """Whether a node runs the model's code (and gets a row, a clock and FLOPs)."""
    return node.op in TIMED_OPS and not node.meta.get(UNTIMED)


@dataclass(frozen=True)
class NodeInfo:
    """What a timed node is: its name, kind, target, and the modules it is inside.

    ``module_stack`` lists the module calls the node runs inside, outermost first (the node's
    own module last for ``call_module``), each as ``path`` or ``path@N`` for the N-th extra
    call of a module used several times; ``module_path`` is the innermost path.
    """

    name: str
    op: str
    target: str
    module_path: str
    module_stack: tuple[str, ...] = ()


def describe_target(node: fx.Node) -> str:
    """A readable target: ``layer1.0.conv1``, ``torch.flatten``, ``operator.add``, ``view``."""
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    if name.startswith("_VariableFunctionsClass."):  # torch.matmul, torch.relu, ...
        name = name.split(".", 1)[1]
    if module in ("_operator", "builtins"):
        module = "operator" if module == "_operator" else ""
    elif module.startswith("torch._C._nn") or module == "torch.nn.functional":
        module = "torch.nn.functional"
    elif module.startswith("torch._C") or (module.startswith("torch") and hasattr(sys.modules["torch"], name)):
        module = "torch"
    return f"{module}.{name}" if module else name


def node_info(node: fx.Node) -> NodeInfo:
    # nn_module_stack keys are "path", or "path@N" for the N-th extra call of a shared module.
    entries = (node.meta.get("nn_module_stack") or {}).items()
    stack = tuple(key if key.split("@")[0] == path else path for key, (path, _type) in entries)
    if node.op == "call_module" and (not stack or stack[-1].split("@")[0] != node.target):
        stack = (*stack, str(node.target))
    return NodeInfo(node.name, node.op, describe_target(node), stack[-1].split("@")[0] if stack else "", stack)
