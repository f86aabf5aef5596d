"""``ChildTimers``: the timer of a module with no forward of its own (a LightningModule whose training step calls
several children: a GAN's generator and discriminator), made of one timer per child with parameters, each capturing
its child's forward with Dynamo as if that child were the module given.

The children's rows become one table, each row named as a capture of the whole module would name it: the child's
name before its own (``generator_model_0``), its module path under the child's (``generator.model.0``). A child its
steps never call has no rows. A child's timer that stops fitting its calls makes the whole unusable: ``Timers`` then
times the module by module hooks, as before there was a timer per child.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from fxprof_lightning.nodes import Capture, NodeInfo
from fxprof_lightning.timing.flops import NodeCosts
from fxprof_lightning.timing.readings import Collected, Progress, Traits

__all__ = ["ChildTimers", "timed_children"]


def timed_children(module: nn.Module) -> dict[str, nn.Module]:
    """The children of ``module`` with parameters of their own, by name: those a training step trains."""
    return {name: child for name, child in module.named_children() if next(child.parameters(), None) is not None}


class ChildTimers:
    """``timers.Timer`` over one timer per child (``timers``: child name -> its timer), the rows of all as one table."""

    def __init__(self, children: dict[str, nn.Module], timers: dict[str, Any]) -> None:
        self.children, self.timers = children, timers

    @property
    def traits(self) -> Traits:
        return next(iter(self.timers.values())).traits

    @property
    def progress(self) -> Progress:
        each = [t.progress for t in self.timers.values()]
        return Progress(sum(p.calls for p in each), all(p.usable for p in each),
                        next((p.untimed for p in each if p.untimed is not None), None), sum(p.interruptions for p in each),
                        next((p.interrupted_by for p in reversed(each) if p.interrupted_by), ""),
                        tuple(s for p in each for s in p.capture_s))

    def install(self, module: nn.Module, backward_hooks: bool = False) -> None:
        for name, timer in self.timers.items():
            timer.install(self.children[name], backward_hooks=backward_hooks)

    def uninstall(self, module: nn.Module) -> None:
        for name, timer in self.timers.items():
            timer.uninstall(self.children[name])

    def reset(self) -> None:
        for timer in self.timers.values():
            timer.reset()

    def save_point(self) -> Callable[[], None]:
        points = [timer.save_point() for timer in self.timers.values()]

        def forget() -> None:
            for point in points:
                point()
        return forget

    def refusal(self, capture: Capture) -> str:
        """Why a child's graph was given up (``Timers`` asks when the whole is no longer usable)."""
        name, timer = next((n, t) for n, t in self.timers.items() if not t.progress.usable)
        return f"{name}: {timer.refusal(capture)}"

    def collected(self, backward: list[tuple[int, int]], trace_events: list[Any], training: bool) -> Collected | str:
        """Each child's samples, as one table (or why nothing was timed, when no child was). Each child's timer is
        given every backward event; an event is outside every row when no child's rows account for it."""
        found = {name: timer.collected(backward, trace_events, training) for name, timer in self.timers.items()}
        parts = {name: c for name, c in found.items() if isinstance(c, Collected)}
        if not parts:
            return "; ".join(f"{name}: {why}" for name, why in found.items())
        total = sum(duration for _, duration in backward)
        owned = sum(total - c.backward_outside_ns for c in parts.values())
        nodes = [_under(name, info) for name, c in parts.items() for info in c.nodes]
        costs = [c.costs for c in parts.values()]
        saved = [c.saved for c in parts.values()]
        return Collected(
            nodes, *([x for c in parts.values() for x in getattr(c, field)]
                     for field in ("forward", "backward", "mem_delta", "mem_peak")),
            costs=None if all(k is None for k in costs) else NodeCosts(*(
                [x for k, c in zip(costs, parts.values(), strict=True)
                 for x in (getattr(k, field) if k is not None else [None] * len(c.nodes))]
                for field in ("fwd_flops", "bwd_flops", "out_bytes", "fwd_bytes")),
                failed=next((k.failed for k in costs if k is not None and k.failed), None)),
            costs_error=next((c.costs_error for c in parts.values() if c.costs_error), None),
            backward_outside_ns=max(total - owned, 0),
            forward_walls_ns=[w for c in parts.values() for w in c.forward_walls_ns],
            saved=None if all(s is None for s in saved) else [
                x for s, c in zip(saved, parts.values(), strict=True) for x in (s if s is not None else [None] * len(c.nodes))],
            saved_unknown=next((c.saved_unknown for c in parts.values() if c.saved_unknown), None))

    def node_ranges(self) -> Any:
        """The children's node ranges (``NodeTimer.node_ranges``) together, node names as in the table."""
        each = {name: r for name, timer in self.timers.items() if (r := timer.node_ranges()) is not None}
        if not each:
            return None
        anchors, spans, calls, starts, stacks = [], [], [], [], {}
        for name, (a, s, b, c, k) in each.items():
            anchors += a
            spans += [(_name(name, node), start, duration) for node, start, duration in s]
            calls += [(_name(name, node), first, end) for node, first, end in b]
            starts += c
            stacks |= {_name(name, node): _stack(name, stack) for node, stack in k.items()}
        # (in the order they ran, as one timer's are: the trace's events are matched to them in that order)
        return sorted(anchors), sorted(spans, key=lambda s: s[1]), sorted(calls, key=lambda c: c[1]), sorted(starts), stacks

    def describe(self, capture: Capture) -> Capture:
        """How the children were captured, together."""
        each = {name: timer.describe(capture) for name, timer in self.timers.items()}
        breaks: dict[str, int] = {}
        for c in each.values():
            for reason, n in c.graph_breaks.items():
                breaks[reason] = breaks.get(reason, 0) + n
        return dataclasses.replace(
            capture, graphs=sum(c.graphs for c in each.values()), graph_breaks=breaks,
            recaptures=[f"{name}: {r}" for name, c in each.items() for r in c.recaptures],
            leaves={_path(name, k): v for name, c in each.items() for k, v in c.leaves.items()},
            host_reads={_path(name, k): v for name, c in each.items() for k, v in c.host_reads.items()},
            untimed={_path(name, k): v for name, c in each.items() for k, v in c.untimed.items()},
            capture_s=[s for c in each.values() for s in c.capture_s],
            dynamo_messages=list(dict.fromkeys(m for c in each.values() for m in c.dynamo_messages)))


def _path(child: str, path: str) -> str:
    return f"{child}.{path}" if path else child


def _name(child: str, name: str) -> str:
    return f"{child}_{name}"


def _stack(child: str, stack: tuple[str, ...]) -> tuple[str, ...]:
    return (child, *(f"{child}.{key}" for key in stack))


def _under(child: str, info: NodeInfo) -> NodeInfo:
    """A child's row as the whole module's: its name, module path and stack under the child's."""
    return dataclasses.replace(info, name=_name(child, info.name), module_path=_path(child, info.module_path),
                               module_stack=_stack(child, info.module_stack),
                               target=_path(child, info.target) if info.op == "call_module" else info.target)
