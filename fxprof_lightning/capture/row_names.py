"""The rows of a Dynamo graph: each node named for its layer, or its function and the module that called it, and the
module a graph of a submodule's forward runs for (``Anchor``), so that its copy for another module of the same
code gets that module's names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxprof_lightning import torch_api
from fxprof_lightning.capture import verify
from fxprof_lightning.capture.graph_breaks import resumed_from
from fxprof_lightning.nodes import JOINS, ROW, NodeInfo, describe_target, mark_untimed, module_stack

__all__ = ["FRAMED", "Anchor", "Owners", "annotate_rows", "frame_of", "graph_anchor", "names_moved"]

FRAMED = "_fxprof_framed_"  # a torch.nn module's forward of ours, a frame Dynamo starts: this, then the module's id


def annotate_rows(graph_module: fx.GraphModule, names: dict[int, tuple[str, nn.Module]], frame: str = "") -> None:
    """Give every node of a Dynamo graph its row (``ROW``) and join the ops of one layer call (``JOINS``).

    ``names`` maps ``id(module)`` to its qualified name and the module (``nn_module_stack`` keys are
    ``str(id(module))``, with ``@N`` for its N-th extra call in the graph). ``frame``: the path of the module whose
    forward the graph's frame runs (its own ops have no ``nn_module_stack``), "" for the root.
    """
    frame = frame or _framed_module(graph_module, names)
    taken: dict[str, int] = {}
    outer = module_stack(frame)  # the frame's module and those around it
    previous_layer: str | None = None
    for node in graph_module.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if not _makes_tensors(node):  # sizes and other Python values: bookkeeping, no row
            mark_untimed(node)
            continue
        stack = []
        for key, (source, _cls) in (node.meta.get("nn_module_stack") or {}).items():
            ident, _, call = str(key).partition("@")
            path = names[int(ident)][0] if ident.isdigit() and int(ident) in names else _path_of(source)
            stack.append((path, call, int(ident) if ident.isdigit() else None, str(key)))
        path, call, ident, key = stack[-1] if stack else (frame, "", None, "")
        module = names[ident][1] if ident in names else None
        if not stack and frame:  # the graph of a layer's own forward (Dynamo caught its frame): the layer's row
            module = next((m for p, m in names.values() if p == frame), None)
        inside = outer + tuple(p + (f"@{c}" if c else "") for p, c, _, _ in stack if p and p not in outer)
        if module is not None and path and _is_layer(module):
            name = path.replace(".", "_") + (f"_{call}" if call else "")
            node.meta[ROW] = NodeInfo(name, "call_module", path, path, inside)
            if previous_layer == key:
                node.meta[JOINS] = True
            previous_layer = key
            continue
        previous_layer = None
        functions = node.meta.get("source_fn_stack") or []
        function = functions[-1][0] if functions else node.name
        function = re.sub(r"_\d+$", "", str(function))
        source, caller = ("", "") if path else _user_line(node)  # outside every submodule: the user's function
        base = f"{path.replace('.', '_')}_{function}" if path else f"{caller}_{function}" if caller else function
        count = taken.get(base, 0)
        taken[base] = count + 1
        name = base if count == 0 else f"{base}_{count}"
        node.meta[ROW] = NodeInfo(name, node.op, describe_target(node), path, inside, source)


def _user_line(node: fx.Node) -> tuple[str, str]:
    """The innermost frame of a node's stack trace as ``function (file:line)``, and the function when it is not a
    ``forward`` (a helper the forward called: its name starts the row's), else ''."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")
    if not frames:
        return "", ""
    file, line, _ = frames[-1]
    named = [f for _, _, f in frames if not f.startswith("<")]  # a comprehension's frame is its function's
    function = resumed_from(named[-1] if named else frames[-1][2])
    return f"{function} ({file.rsplit('/', 1)[-1]}:{line})", "" if function in ("forward", "<module>") else function


def _makes_tensors(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return value is None or any(isinstance(v, torch.Tensor) for v in torch_api.tree_leaves(value))


def _is_layer(module: nn.Module) -> bool:
    """A ``torch.nn`` module with no children: its ops are one row, as ``torch.fx`` times such a module."""
    return type(module).__module__.startswith("torch.nn.") and next(module.children(), None) is None


def _path_of(source: str) -> str:
    """``"L['self'].layer1[0].conv1"`` (Dynamo's name of a module) as ``"layer1.0.conv1"``."""
    path = re.sub(r"^L\['(self|fn)'\](\.__self__)?", "", source)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return re.sub(r"\._modules\.", ".", path).strip(".")


def _framed_module(graph_module: fx.GraphModule, names: dict[int, tuple[str, nn.Module]]) -> str:
    """The path of the module whose frame of ours (``dynamo._own_frame``: a torch.nn module with no parameter, such as
    ReLU, has no input that tells it) a graph runs, where the outermost frame of its nodes' stacks is one; else ""."""
    for node in graph_module.graph.nodes:
        outermost = re.search(r'File "[^"]*", line \d+, in (\S+)', node.meta.get("stack_trace") or "")
        if outermost is not None:
            name = outermost.group(1)
            ident = name[len(FRAMED):] if name.startswith(FRAMED) else ""
            return names[int(ident)][0] if ident.isdigit() and int(ident) in names else ""
    return ""


@dataclass
class Anchor:
    """Which module a graph of a submodule's forward runs for. Dynamo passes that module's parameters and buffers as
    graph inputs, so one graph serves every module of the same code (wav2vec2's encoder layers, Mask R-CNN's heads,
    where a graph break made each layer's forward a frame of its own); the rows are named for the module of the
    capture. The ``index``-th input is ``tensor`` in that module (at ``frame``), at ``inner`` below it."""

    index: int
    tensor: torch.Tensor
    inner: str
    frame: str
    names: dict[int, tuple[str, nn.Module]]  # the timer's module names at the capture


def graph_anchor(captured: fx.GraphModule, example_inputs: list[Any], owners: dict[int, str],
            names: dict[int, tuple[str, nn.Module]]) -> Anchor | None:
    """The first input of ``captured`` that is a parameter or buffer of the module whose forward the graph's frame
    runs, unless that module is the root (``owners``: a tensor's id -> the path of its module)."""
    placeholders = [node for node in captured.graph.nodes if node.op == "placeholder"]
    for index, (node, value) in enumerate(zip(placeholders, example_inputs, strict=False)):
        match = re.fullmatch(r"L\['self'\](.*?)\._(?:parameters|buffers)\['[^']+'\]", torch_api.source_name(node))
        owner = owners.get(id(value))
        if match is None or owner is None:
            continue
        inner = _path_of(f"L['self']{match.group(1)}")
        frame = frame_of(owner, inner)
        return Anchor(index, value, inner, frame, names) if frame else None
    return None


def frame_of(owner: str, inner: str) -> str | None:
    """The path of the module a frame runs for, from the path of a tensor's module (``owner``) and that module's path
    below the frame's (``inner``); None where ``owner`` does not end in ``inner``."""
    if not inner:
        return owner
    if owner != inner and not owner.endswith(f".{inner}"):
        return None
    return owner[:len(owner) - len(inner)].rstrip(".")


def _tensor_owners(root: nn.Module) -> dict[int, str]:
    """id of a parameter or buffer -> the path of its module. Left out: a tensor whose module is shared by different
    parents (one norm given to every block), or that several modules hold (tied): it does not tell which module a
    graph runs for. A module reachable by two paths through the same parents (an alias) is kept."""
    owners: dict[int, str] = {}
    parents: dict[int, int] = {}
    shared: set[int] = set()
    modules = dict(root.named_modules(remove_duplicate=False))
    for name, module in modules.items():
        parent = id(modules[name.rpartition(".")[0]]) if name else 0
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                if parents.setdefault(id(t), parent) != parent:
                    shared.add(id(t))
                owners[id(t)] = name
    for ident in shared:
        del owners[ident]
    for sharded, unsharded in verify.fsdp_unsharded(root).items():  # FSDP2: the module holds one or the other
        if sharded in owners:
            owners.setdefault(id(unsharded), owners[sharded])
        elif id(unsharded) in owners:
            owners.setdefault(sharded, owners[id(unsharded)])
    return owners


class Owners:
    """The module path of each parameter and buffer of ``root`` (``_tensor_owners``), looked at again once when a
    tensor no module owned is asked about (a module replaced since the capture, which Dynamo's guards let pass)."""

    def __init__(self, root: nn.Module | None) -> None:
        self.root = root
        self.owners = _tensor_owners(root) if root is not None else {}
        self.unowned: set[int] = set()  # ids of tensors no module owned at the last look

    def of(self, tensor: Any) -> str | None:
        owner = self.owners.get(id(tensor))
        if owner is None and self.root is not None and id(tensor) not in self.unowned:
            self.owners, self.unowned = _tensor_owners(self.root), set()
            owner = self.owners.get(id(tensor))
            if owner is None:
                self.unowned.add(id(tensor))
        return owner


def names_moved(anchor: Anchor, frame: str, root: nn.Module) -> dict[int, tuple[str, nn.Module]] | None:
    """The capture's module names (``anchor.names``) with the modules at and below ``anchor.frame`` given the names
    and modules at and below ``frame`` (None where the structure there differs)."""
    names = dict(anchor.names)
    for ident, (path, _module) in anchor.names.items():
        if path == anchor.frame or path.startswith(f"{anchor.frame}."):
            moved = frame + path[len(anchor.frame):]
            try:
                names[ident] = (moved, root.get_submodule(moved))
            except AttributeError:
                return None
    return names
