"""A checkpointing plan: which blocks to recompute in backward (``torch.utils.checkpoint``, non-reentrant) so that the
step holds less at the end of its forward, with the predicted saving and cost, from the measured module table.

A non-reentrant checkpoint of a block keeps the block's inputs and reruns its forward in backward, so:

- the predicted saving is what the block's rows saved for backward (``ModuleStats.saved_bytes_per_step``) less what
  the checkpoint keeps of its input (nothing where the row before the block saved that tensor already, unless that row
  is in a checkpointed block too) and less its output where its last row saved it (the row after it then holds it);
- the predicted cost is the block's forward time per step, run once more in backward.

Blocks are modules with submodules; a plan is one run of sibling blocks (``layer2..layer4``, ``h.3..h.5``): the run
that saves most among those that save at least a third as many bytes per millisecond as the best block does.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxprof_lightning.report import ModuleStats

__all__ = ["ACTIVATION_SHARE", "MIN_SAVING", "CheckpointPlan", "checkpoint_plan", "plan_for", "step_peak_bytes"]

ACTIVATION_SHARE = 30.0  # % of the step's peak in saved activations below which no plan is made
MIN_SAVING = 10.0  # % of the step's peak a plan must save
EFFICIENCY = 1 / 3  # a run is a candidate while it saves at least this share of the best block's bytes per ms (a
# third, not a half: blocks alike should be planned together though a loaded machine stretched one's forward)


@dataclass(frozen=True)
class CheckpointPlan:
    """Blocks to checkpoint (module paths, in order) with the predicted bytes no longer held per step
    (``saved_bytes``), the forward ms per step rerun in backward (``cost_ms``), what the step holds at the end of its
    forward (``peak_bytes``: saved activations, parameters, optimizer state) and the step's time (``step_ms``)."""

    modules: tuple[str, ...]
    saved_bytes: float
    cost_ms: float
    peak_bytes: float
    step_ms: float

    @property
    def blocks(self) -> str:
        """The blocks in a few words: ``layer2..layer4`` (a run of siblings), or one path."""
        return self.modules[0] if len(self.modules) == 1 else f"{self.modules[0]}..{self.modules[-1]}"

    def text(self) -> str:
        """The plan in one line.

        >>> print(CheckpointPlan(("layer2", "layer3", "layer4"), 180e6, 9.0, 474e6, 128.0).text())
        checkpoint layer2..layer4: -180.0 MB saved (-38% of the step's peak), about +9.0 ms per step (+7%)
        """
        peak = f" (-{100 * self.saved_bytes / self.peak_bytes:.0f}% of the step's peak)" if self.peak_bytes else ""
        step = f" (+{100 * self.cost_ms / self.step_ms:.0f}%)" if self.step_ms else ""
        return (f"checkpoint {self.blocks}: -{self.saved_bytes / 1e6:.1f} MB saved{peak}, "
                f"about +{self.cost_ms:.1f} ms per step{step}")


def step_peak_bytes(modules: list[ModuleStats]) -> float | None:
    """What the step holds at the end of its forward: the root's saved activations, parameters and optimizer state
    (gradients are not held then with ``zero_grad(set_to_none=True)``, torch's default); None without saved bytes."""
    root = next((m for m in modules if m.path == ""), None)
    if root is None or root.saved_bytes_per_step is None:
        return None
    return root.saved_bytes_per_step + (root.param_bytes or 0) + (root.optimizer_bytes or 0)


def checkpoint_plan(modules: list[ModuleStats], step_ms: float) -> CheckpointPlan | None:
    """The plan for a cycle's module table (``CycleReport.modules``), or None where saved activations are less than
    ``ACTIVATION_SHARE`` % of the step's peak or no run of blocks saves ``MIN_SAVING`` % of it. ``step_ms``: the
    step's time, for the cost's share (0: not given)."""
    peak = step_peak_bytes(modules)
    root_saved = modules[0].saved_bytes_per_step if modules and modules[0].path == "" else None
    if not peak or root_saved is None or 100 * root_saved / peak < ACTIVATION_SHARE:
        return None
    scored = [(saving, cost, group, run) for group in _sibling_blocks(modules)
              for saving, cost, run in _runs(group) if saving > 0 and cost > 0]
    singles = [saving / cost for saving, cost, _, (start, end) in scored if end - start == 1]
    if not singles:
        return None
    best = max(singles)
    candidates = [c for c in scored if c[0] / c[1] >= EFFICIENCY * best]
    saving, cost, group, (start, end) = max(candidates, key=lambda c: (c[0], -c[1]))
    if 100 * saving / peak < MIN_SAVING:
        return None
    return CheckpointPlan(tuple(m.path for m in group[start:end]), saving, cost, peak, step_ms)


def plan_for(modules: list[ModuleStats], paths: list[str], step_ms: float) -> CheckpointPlan:
    """The prediction for checkpointing the sibling blocks ``paths`` (in the forward's order), whether or not the
    plan would name them: what checkpointing a block of your choice saves and costs."""
    by_path = {m.path: m for m in modules}
    saving, cost, _ = _runs([by_path[path] for path in paths], whole=True)[-1]
    return CheckpointPlan(tuple(paths), saving, cost, step_peak_bytes(modules) or 0.0, step_ms)


def _sibling_blocks(modules: list[ModuleStats]) -> list[list[ModuleStats]]:
    """Per parent module, its children that are blocks (modules with submodules, saved bytes and input size known),
    in the tree's order."""
    parents = {m.path.rpartition(".")[0] for m in modules if m.path}
    groups: dict[str, list[ModuleStats]] = {}
    for m in modules:
        if m.path and m.path in parents and m.saved_bytes_per_step is not None and m.input_bytes is not None \
                and m.output_bytes is not None and m.total_fwd_ms > 0:
            groups.setdefault(m.path.rpartition(".")[0], []).append(m)
    return list(groups.values())


def _runs(group: list[ModuleStats], whole: bool = False) -> list[tuple[float, float, tuple[int, int]]]:
    """Every run of consecutive blocks of ``group`` (only the whole group with ``whole``) as its slice ``(start, end)``
    of ``group``, after the bytes per step a
    checkpoint of each of its blocks no longer holds and the forward ms per step it reruns (each run extends the one
    before it by a block: the runs of n blocks take n * n steps).

    A block saves what its rows saved, less its input where the checkpoint keeps it and nothing else holds it (it is
    fed by the checkpointed block before it, or the row before it did not save it), less its output where its last
    row saved it and the row after it keeps it in its place (the run's last block, or one not feeding the next)."""
    found = []
    for i in range(1 if whole else len(group)):
        inner, cost = 0.0, 0.0  # the run so far, without its last block's output
        for j in range(i, len(group)):
            m, before = group[j], group[j - 1] if j > i else None
            fed = before is not None and before.output_bytes == m.input_bytes
            if before is not None and before.output_held and not fed:
                inner -= _bytes(before, before.output_bytes)
            inner += m.saved_bytes_per_step - (_bytes(m, m.input_bytes) if fed or not m.input_held else 0.0)
            cost += m.total_fwd_ms
            found.append((inner - (_bytes(m, m.output_bytes) if m.output_held else 0.0), cost, (i, j + 1)))
    return found


def _bytes(m: ModuleStats, per_call: float) -> float:
    return per_call * max(m.calls_per_step, 1.0)
