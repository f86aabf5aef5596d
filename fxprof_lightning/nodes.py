"""The package's vocabulary for timed nodes: what a row of a node table is (``NodeInfo``), how a graph node
gets one, and how a module was captured (``Capture``). No torch import, so the reports, ``runs`` and the ``fxprof``
command load without torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import fx

__all__ = ["JOINS", "NESTS", "ROW", "TIMED_OPS", "UNTIMED", "Capture", "NodeInfo", "describe_target", "is_timed", "mark_untimed",
           "module_stack", "node_info"]

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
    source: str = ""  # an op outside every submodule: the user's function and line (``stack_rows (train.py:12)``)


def module_stack(path: str) -> tuple[str, ...]:
    """The module at ``path`` and those around it, outermost first (``NodeInfo.module_stack`` of a node it owns).

    >>> module_stack("layer1.0.conv1")
    ('layer1', 'layer1.0', 'layer1.0.conv1')
    """
    parts = path.split(".") if path else []
    return tuple(".".join(parts[:i + 1]) for i in range(len(parts)))


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


@dataclass
class Capture:
    """How a module was captured.

    Attributes:
        method: ``"dynamo"``, ``"module_hooks"`` (where Dynamo cannot be used) or ``"compiled"`` (a
            torch.compile'd module, timed from its kernels: ``capture/compiled.py``).
        graph_module: the graph timed (None for ``module_hooks``).
        leaves: blocks timed as single rows, with why.
        error: ``dynamo`` and ``compiled``: how the rows are made; ``module_hooks``: why Dynamo was not used.
        fused: ``compiled``: the rows whose kernels were fused across modules, with those kernels.
        graph_breaks: ``compiled`` and ``dynamo``: Dynamo's graph breaks, by reason, with their counts.
        graphs: ``dynamo``: the graphs captured so far (one per graph break and per recapture).
        recaptures: ``dynamo``: why each capture after the first was made (the guard that failed).
        host_reads: ``dynamo``: where the forward reads tensors' values on the host (``.item()``, a branch on a
            value: host syncs on a GPU), module path -> what and where (``graph_breaks.host_reads``).
        untimed: ``dynamo``: layers whose parameters the forward used that no graph was given (they ran in a frame
            Dynamo ran eagerly, after a graph break inside a loop: untimed), module path -> why.
        dynamo_messages: ``dynamo``: what Dynamo, Inductor and torch.fx logged or warned in our captures and timed
            calls, each message once (kept off the console: ``timing.quiet.quiet_dynamo``).
        capture_s: seconds of each ``dynamo`` capture: Dynamo, the check against eager, the call.
    """

    method: str
    graph_module: fx.GraphModule | None = None
    leaves: dict[str, str] = field(default_factory=dict)
    error: str = ""
    fused: dict[str, list[str]] = field(default_factory=dict)
    graph_breaks: dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    recaptures: list[str] = field(default_factory=list)
    host_reads: dict[str, str] = field(default_factory=dict)
    untimed: dict[str, str] = field(default_factory=dict)
    capture_s: list[float] = field(default_factory=list)
    dynamo_messages: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for logs and reports."""
        text = self.method
        if self.leaves:
            text += f" ({len(self.leaves)} leaf module(s): " + "; ".join(f"{k} [{v}]" for k, v in self.leaves.items()) + ")"
        if self.method == "dynamo":
            text += f" ({self.error}; {self.graphs} graph(s)"
            if self.graph_breaks:
                text += "; graph breaks: " + "; ".join(f"{reason.splitlines()[0]} (x{n})" for reason, n in self.graph_breaks.items())
            if self.recaptures:
                text += "; captured again: " + "; ".join(self.recaptures)
            if self.untimed:
                text += f"; untimed, outside the graphs: {', '.join(self.untimed)} ({next(iter(self.untimed.values()))})"
            text += ")"
        if self.method == "module_hooks":
            text += f" ({self.error})"
        if self.method == "compiled":
            text += f" ({self.error}; kernels fused across modules: "
            text += "; ".join(f"{row} [{', '.join(kernels)}]" for row, kernels in self.fused.items()) or "none"
            # Dynamo's reasons run to many lines of hints; the first says what broke (graph_breaks keeps them whole).
            text += "; graph breaks: " + ("; ".join(f"{reason.splitlines()[0]} (x{n})" for reason, n in self.graph_breaks.items())
                                          or "none") + ")"
        return text
