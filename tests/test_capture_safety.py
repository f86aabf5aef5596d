"""A captured graph never does less or more than the user's model: activation checkpointing is
kept, a graph traced on a recorded call that does not reproduce that call is refused, and random
draws, item assignment and modules built in the forward run as they do in eager mode.

The models train through a real Trainer and end with weights bitwise equal to the same model
trained without the profiler (``test_layers.train_both``).
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import types

import numpy as np
import pytest
import torch
import torch.utils.checkpoint
from helpers import LADDER_ON_NEWER_TORCH, LitClassifier, notices
from test_layers import train_both as train_both_with
from torch import nn
from torch.nn import functional as F

from fxprof_lightning.capture.guarded_timer import GuardedNodeTimer
from fxprof_lightning.capture.ladder import capture
from fxprof_lightning.capture.leaves import host_random_functions, refusing_checkpoint
from fxprof_lightning.capture.recorded_call import Example

CHECKPOINT_REASON = "activation checkpointing cannot be traced"

# These tests are of the torch.fx capture ladder (``capture="fx"``); the default Dynamo capture's are in
# test_sound_capture.py.
train_both = functools.partial(train_both_with, capture="fx")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class Checkpointed(nn.Module):
    """Runs ``block`` under activation checkpointing."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.block = Block()
        self.use_reentrant = use_reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)


class WithCheckpointedBlock(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.body = Checkpointed(use_reentrant)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.conv(x)).mean(dim=(2, 3))
        return self.head(self.body(x))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointing_submodule_is_a_leaf_and_keeps_its_checkpoint(tmp_path, use_reentrant):
    with pytest.warns(UserWarning, match=rf"symbolic_trace\+leaves \(1 leaf module\(s\): body \[TraceError: {CHECKPOINT_REASON}"):
        _, callback = train_both(tmp_path, lambda: LitClassifier(WithCheckpointedBlock(use_reentrant)))
    (cycle,) = callback.cycles
    assert list(cycle.capture.leaves) == ["body"] and CHECKPOINT_REASON in cycle.capture.leaves["body"]
    nodes = {n.name: n for n in cycle.nodes}
    assert set(nodes) == {"conv", "relu", "mean", "body", "head"}
    assert nodes["body"].op == "call_module" and nodes["body"].bwd_calls == 2


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_in_the_roots_own_forward_goes_down_the_ladder(use_reentrant):
    module = Checkpointed(use_reentrant).train()
    x = torch.randn(4, 16, requires_grad=True)
    for example in (None, Example.copy_of((x,), {})):
        how = capture(module, example)
        assert how.method == "module_hooks" and CHECKPOINT_REASON in how.error


def test_checkpointing_on_real_tensors_passes_and_everything_is_restored():
    internals = dict(vars(torch.utils.checkpoint))
    module = Block()
    x = torch.randn(4, 16, requires_grad=True)
    with refusing_checkpoint():
        got = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
        got_reentrant = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=True)
    assert torch.equal(got, module(x)) and torch.equal(got_reentrant, got) and got.grad_fn is not None
    assert dict(vars(torch.utils.checkpoint)) == internals
    assert "apply" not in vars(torch.utils.checkpoint.CheckpointFunction)  # inherited again


# ------------------------------------------------------------------ decisions fx does not ask a proxy about


class ScaledIfTensor(nn.Module):
    """Takes rung 3 (a branch on a shape), then asks ``isinstance`` of a traced value (the reviewer's case)."""

    def __init__(self, check_type: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(8, 4)
        self.check_type = check_type

    def forward(self, x, scale=None):
        x = self.bn(self.conv(x))
        if x.shape[1] > 1:  # plain symbolic tracing fails here
            x = x * 2
        if self.check_type and isinstance(scale, torch.Tensor):  # False on a proxy: dropped from the graph
            x = x * scale
        return self.head(self.drop(x.mean(dim=(2, 3))))


class LitScaled(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x, scale=torch.tensor(3.0)), y)


def test_a_graph_that_does_not_reproduce_its_recorded_call_is_refused(tmp_path):
    with pytest.warns(UserWarning, match="timed by module_hooks .*does not reproduce the module's output on that call"):
        _, callback = train_both(tmp_path, lambda: LitScaled(ScaledIfTensor()))
    (cycle,) = callback.cycles
    assert cycle.capture.method == "module_hooks" and "isinstance check" in cycle.capture.error
    assert {"conv", "bn", "head"} <= {n.name for n in cycle.nodes}


@pytest.mark.parametrize("check_type", [False, True], ids=["reproduces", "refused"])
def test_capture_leaves_random_state_and_buffers_as_they_were(check_type):
    module = ScaledIfTensor(check_type).train()  # batch norm updates its statistics, dropout draws numbers
    example = Example.copy_of((torch.randn(4, 3, 8, 8),), {"scale": torch.tensor(3.0)})
    buffers = {k: b.clone() for k, b in module.state_dict().items()}
    random_state = torch.get_rng_state()
    how = capture(module, example)
    assert how.method == ("module_hooks" if check_type else "traced_on_example"), how.describe()
    assert torch.equal(torch.get_rng_state(), random_state)
    assert all(torch.equal(b, buffers[k]) for k, b in module.state_dict().items())


class ShapeBranching(nn.Module):
    """Branches on a shape: plain tracing fails, tracing on a recorded call works (rung 3)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.head(x.flatten(1) if x.shape[1] == 3 else x)


@notices("torch.fx could not trace")
def test_tracing_on_a_recorded_call_happens_before_the_cycle_trace_starts(tmp_path):
    # Cycle 0 records steps 2-3 with no warm-up step; the call recorded at step 0 is traced on as the
    # cycle opens, which runs the model (tracing, then the check against the call): not in step 2's trace.
    _, callback = train_both(tmp_path, lambda: LitClassifier(ShapeBranching()), steps=4,
                             skip_first=1, wait=1, warmup=0, active=2, repeat=1)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and cycle.steps == [2, 3]
    events = json.loads(gzip.decompress(cycle.trace_paths[0].read_bytes()))["traceEvents"]
    steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")}
    linear = [e["ts"] for e in events if e.get("name") == "aten::linear"]
    per_step = {name: sum(start <= ts < end for ts in linear) for name, (start, end) in steps.items()}
    assert per_step == {"ProfilerStep#2": 1, "ProfilerStep#3": 1}


# ------------------------------------------------------------------ eager habits plain torch.fx refused or got wrong


def host_mask(width: int) -> np.ndarray:
    """Draws from NumPy's generator, as Wav2Vec2's ``_compute_mask_indices`` does (SpecAugment)."""
    return np.random.rand(width) < 0.75


class LayerDropped(nn.Module):
    """Skips its layer at random (LayerDrop): which code runs depends on a random draw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        if torch.rand([]) < 0.5:
            return x
        return self.linear(x)


class EagerHabits(nn.Module):
    """Item assignment into a traced tensor, NumPy random numbers, a block with LayerDrop, a loss module built in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.block = LayerDropped()
        self.head = nn.Linear(16, 4)

    def forward(self, x, labels):
        x = F.relu(self.conv(x)).mean(dim=(2, 3))
        x[:, 0] = 0.0
        x = x * torch.as_tensor(host_mask(x.shape[1]))
        return nn.CrossEntropyLoss()(self.head(self.block(x)), labels)


class LitLossInside(LitClassifier):
    def training_step(self, batch, batch_idx):
        return self.model(*batch)


@notices("torch.fx could not trace", "FLOPs not counted")
def test_eager_habits_are_traced_as_they_run_and_training_is_unchanged(tmp_path):
    # Before: the draws made while tracing were baked into the graph (the same mask and the same branch at every
    # step), item assignment and the loss module stopped tracing. The weights (train_both) tell.
    _, callback = train_both(tmp_path, lambda: LitLossInside(EagerHabits()), steps=6)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "symbolic_trace+leaves"
    assert list(cycle.capture.leaves) == ["block"] and "control flow" in cycle.capture.leaves["block"]
    targets = {n.target for n in cycle.nodes}
    assert {"operator.setitem", "torch.as_tensor", "block", "torch.nn.functional.cross_entropy"} <= targets
    assert any(t.endswith("host_mask") for t in targets)


def test_host_random_functions_are_those_of_the_models_own_files_that_draw():
    found = {name for _, name, _ in host_random_functions(EagerHabits())}
    assert "host_mask" in found and "train_both" not in found and not any("torch" in n for n in found)


class DrawsThenBranches(nn.Module):
    """Draws NumPy numbers, then branches on the batch size: rung 3 (plain tracing fails on the branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        x = x * torch.as_tensor(host_mask(x.shape[1]))
        if x.shape[0] > 2:
            x = x * 2
        return self.linear(x)


def test_a_call_failing_a_guard_after_a_numpy_draw_gets_the_models_numpy_numbers():
    module = DrawsThenBranches()
    how = capture(module, Example.copy_of((torch.randn(4, 16),), {}))
    assert how.method == "traced_on_example" and any(t is host_mask for t in (n.target for n in how.graph_module.graph.nodes))
    small = torch.randn(2, 16)  # the other branch: the guard fails after the graph drew its mask
    np.random.seed(0)
    expected, expected_next = module(small), np.random.rand()
    timer = GuardedNodeTimer(how.graph_module)
    timer.install(module)
    try:
        np.random.seed(0)
        got, got_next = module(small), np.random.rand()
    finally:
        timer.uninstall(module)
    assert timer.mismatch and "GraphMismatch" in timer.mismatch
    assert torch.equal(got, expected) and got_next == expected_next


class HalfGradient(torch.autograd.Function):
    """The identity with a custom backward (half the gradient): autograd alone would give another gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class Tracker(nn.Module):
    """Keeps the last batch mean as an attribute: state written by the forward."""

    def forward(self, x):
        self.last = x.detach().mean()
        return x


class FxBlindSpots(nn.Module):
    """What torch.fx does not see: a custom autograd Function, a no_grad block, an attribute assigned in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.gate = nn.Linear(16, 16)
        self.tracker = Tracker()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.conv(x)).mean(dim=(2, 3))
        with torch.no_grad():
            gate = torch.sigmoid(self.gate(x))
        return self.head(self.tracker(HalfGradient.apply(x * gate)))


@notices("torch.fx could not trace")
def test_custom_functions_grad_modes_and_attribute_writes_train_as_in_eager_mode(tmp_path):
    # Before: HalfGradient was traced through (autograd's gradient, not its own), the no_grad block was traced as
    # plain code (the gate got gradients), and the traced value assigned to tracker.last stayed in the user's model.
    profiled, callback = train_both(tmp_path, lambda: LitClassifier(FxBlindSpots()), steps=6)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "symbolic_trace+leaves"
    assert "assigns a traced value to tracker.last" in cycle.capture.leaves["tracker"]
    nodes = {n.target: n for n in cycle.nodes}
    assert nodes["test_capture_safety.HalfGradient.apply"].bwd_calls == 2
    assert nodes["gate"].calls == 2 and nodes["gate"].bwd_calls == 0
    assert not any("grad_enabled" in target for target in nodes)  # setting the grad mode is bookkeeping
    assert type(profiled.model.tracker.last) is torch.Tensor


class BranchesWithoutGrad(nn.Module):
    """A branch on the batch size inside a no_grad block: rung 3, with a guard that runs with grad mode off."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            if x.shape[0] > 2:
                x = x * 2
        return self.linear(x)


def test_a_guard_failing_inside_a_no_grad_block_leaves_grad_mode_on():
    module = BranchesWithoutGrad()
    how = capture(module, Example.copy_of((torch.randn(4, 16),), {}))
    assert how.method == "traced_on_example"
    timer = GuardedNodeTimer(how.graph_module)
    timer.install(module)
    try:
        got = module(torch.randn(2, 16))  # the other branch
    finally:
        timer.uninstall(module)
    assert timer.mismatch and torch.is_grad_enabled() and got.requires_grad


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.state = None

    def forward(self, x):
        out = self.linear(x) + self.state
        self.state = out.detach()
        return out


class StatefulBlock(nn.Module):
    """Sets its child's state, as RecurrentGemma's temporal block does, and marks a tensor for torch.compile."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = Cell()

    def forward(self, x):
        self.cell.state = torch.zeros(x.shape[0], 16)
        return self.cell(x)


class WithStatefulBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.block = StatefulBlock()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.conv(x)).mean(dim=(2, 3))
        bias = torch.zeros(x.shape[1])
        torch._dynamo.mark_static_address(bias)  # an annotation for torch.compile: no reason to stop tracing
        return self.head(self.block(x) + bias)


@notices("torch.fx could not trace")
def test_state_a_parent_assigns_to_its_child_makes_the_parent_a_leaf(tmp_path):
    profiled, callback = train_both(tmp_path, lambda: LitClassifier(WithStatefulBlock()), steps=6)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "symbolic_trace+leaves"
    assert set(cycle.capture.leaves) == {"block.cell", "block"}
    assert "assigns a traced value to block.cell.state" in cycle.capture.leaves["block"]
    assert {"conv", "block", "head", "torch.zeros"} <= {n.target for n in cycle.nodes}
    assert type(profiled.model.block.cell.state) is torch.Tensor


# ------------------------------------------------------------------ capture leaves the user's process as it was


class SetsGradMode(nn.Module):
    """``set_grad_enabled`` blocks (positional and keyword), ``no_grad`` as a decorator, Python random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    @torch.no_grad()
    def frozen(self, x):
        return self.linear(x)

    def forward(self, x):
        with torch.set_grad_enabled(False):
            y = self.linear(x)
        with torch.set_grad_enabled(mode=True):
            z = self.linear(x)
        return z * (1 + random.random()) + y + self.frozen(x)


class Remembers(nn.Module):
    """Keeps state in a list and in an object: changes a graph cannot make."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[torch.Tensor] = []
        self.notes = types.SimpleNamespace(last=None)

    def forward(self, x):
        self.history.append(x.detach())
        self.notes.last = x.mean()
        return x


class WithMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.memory = Remembers()

    def forward(self, x):
        return self.memory(self.linear(x))


@pytest.mark.parametrize("example", [False, True], ids=["plain tracing", "on a recorded call"])
def test_capture_leaves_grad_mode_and_random_states_as_they_were(example):
    module, call = SetsGradMode(), Example.copy_of((torch.randn(2, 4),), {})
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    how = capture(module, call if example else None)
    assert how.method == "symbolic_trace", how.describe()
    assert torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]


def test_state_changed_inside_lists_and_objects_is_put_back_and_its_module_is_a_leaf():
    module = WithMemory()
    how = capture(module, None)
    assert how.method == "symbolic_trace+leaves" and "memory.history" in how.leaves["memory"]
    assert module.memory.history == [] and module.memory.notes.last is None


# ------------------------------------------------------------------ objects built in the forward, no-op assignments


class Layer:
    def __init__(self) -> None:
        self.keys = None


class Store:
    """A cache-like object built in the forward: one layer gets a traced value, the other stays empty."""

    def __init__(self) -> None:
        self.layers = [Layer(), Layer()]


class BuildsStore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 1:  # plain tracing fails here: rung 3
            x = x * 2
        store = Store()
        store.layers[0].keys = self.linear(x)
        return x, store


def test_an_object_built_in_the_forward_is_built_anew_at_every_call_empty_parts_included():
    module, x = BuildsStore(), torch.randn(2, 4)
    how = capture(module, Example.copy_of((x,), {}))
    assert how.method == "traced_on_example", how.describe()
    (_, first), (_, second) = how.graph_module(x), how.graph_module(x)
    assert first is not second and first.layers[1] is not second.layers[1]  # nothing shared between calls
    assert torch.equal(first.layers[0].keys, module.linear(x * 2)) and first.layers[1].keys is None


class Clamps(nn.Module):
    """Assigns module state that equals what it was on the recorded call: an int (Swin's window size) and a buffer
    (CTRL's ``pos_encoding.to(device)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.window = 4
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        self.window = min(x.shape[1], self.window)
        self.scale = self.scale.to(x.device)
        return self.linear(x) * self.scale


@LADDER_ON_NEWER_TORCH
def test_assignments_that_change_nothing_on_the_recorded_call_do_not_stop_tracing():
    module = Clamps()
    how = capture(module, Example.copy_of((torch.randn(2, 4),), {}))
    assert how.method == "traced_on_example" and not how.leaves, how.describe()
    assert module.window == 4 and type(module.scale) is torch.Tensor


class Filler(nn.Module):
    """A leaf (data-dependent branch) handed an object the forward fills with traced values afterwards."""

    def forward(self, x, store):
        if x.sum() > -1e9:
            store.layers[1].keys = x
        return x * 2


class FillsLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.filler = Filler()

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        store = Store()
        y = self.filler(x, store)  # the empty store: a constant of the graph, were it kept
        store.layers[0].keys = self.linear(y)
        return y, store


def test_an_object_the_graph_would_share_between_calls_is_refused_and_grad_mode_stays_on():
    module = FillsLater()
    how = capture(module, Example.copy_of((torch.randn(2, 4),), {}))
    assert how.method == "module_hooks"
    assert "a Store the graph would hold as a constant gets traced values later in the forward" in how.error
    assert torch.is_grad_enabled() and not any(name.startswith("_fxprof") for name in vars(module))


class NoisyLeaf(nn.Module):
    """A leaf of the model's own code (data-dependent branch) that draws NumPy numbers."""

    def forward(self, x):
        if x.sum() > -1e9:
            x = x + float(np.random.rand())
        return x


class LeafThenBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noise = NoisyLeaf()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        x = self.noise(x)
        if x.shape[0] > 1:
            x = x * 2
        return self.linear(x)


def test_a_guard_failing_after_a_leaf_drew_numpy_numbers_gives_the_models_numpy_numbers():
    module = LeafThenBranch()
    how = capture(module, Example.copy_of((torch.randn(4, 4),), {}))
    assert how.method == "traced_on_example+leaves" and list(how.leaves) == ["noise"]
    one = torch.randn(1, 4)  # the other branch
    np.random.seed(0)
    expected, expected_next = module(one), np.random.rand()
    timer = GuardedNodeTimer(how.graph_module)
    timer.install(module)
    try:
        np.random.seed(0)
        got, got_next = module(one), np.random.rand()
    finally:
        timer.uninstall(module)
    assert timer.mismatch and torch.equal(got, expected) and got_next == expected_next


class SameOutputIfTensor(nn.Module):
    """Takes rung 3, then drops (``isinstance``, False on a proxy) work that leaves the output's values as they are."""

    def __init__(self, dropped: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.dropped = dropped

    def forward(self, x, scale):
        if x.shape[1] > 1:  # plain symbolic tracing fails here
            x = x * 2
        weight = self.linear.weight
        if not isinstance(scale, torch.Tensor):  # True on a proxy only: the graph takes this branch
            if self.dropped == "buffer update":
                self.calls.add_(1)
            elif self.dropped == "random draw":
                torch.rand(1)
            else:
                weight = weight.detach()
        return F.linear(x, weight, self.linear.bias)


@pytest.mark.parametrize(("dropped", "named"), [("buffer update", "buffer calls after the call"),
                                                ("random draw", "the torch CPU random state"),
                                                ("gradient", "gradient of linear.weight")])
def test_a_graph_whose_output_is_right_but_whose_call_is_not_is_refused(dropped, named):
    # The output's values are the same, so a comparison of outputs alone would keep the graph; timed training would
    # then miss a buffer update, draw other random numbers afterwards or not train a weight. The comparison of
    # Dynamo's capture (verify.first_difference) sees each.
    module, x, scale = SameOutputIfTensor(dropped), torch.randn(3, 4), torch.tensor(2.0)
    how = capture(module, Example.copy_of((x, scale), {}))
    assert how.method == "module_hooks" and "does not reproduce" in how.error and named in how.error, how.error
    assert module.calls == 0  # the check's calls changed nothing


class Appender(nn.Module):
    """A leaf (data-dependent branch) that appends to the store it is given."""

    def forward(self, x, store):
        if x.sum() > -1e9:
            store.layers[0].keys = torch.cat([store.layers[0].keys, x])
        return x * 2


class HandsFilledStore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.appender = Appender()

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        store = Store()
        store.layers[0].keys = self.linear(x)
        return self.appender(x, store), store.layers[0].keys


def test_a_leaf_handed_an_object_holding_traced_values_runs_on_a_copy_and_traces_nothing():
    # Evaluated on the object itself, the leaf would trace torch.cat into the graph with the example's values as a
    # constant, and the no_grad its evaluation runs under would be left on.
    module, x = HandsFilledStore(), torch.randn(2, 4)
    how = capture(module, Example.copy_of((x,), {}))
    assert torch.is_grad_enabled()
    assert how.method == "module_hooks" and "does not reproduce the module's output" in how.error  # the leaf's change
    # to the store is made on the graph's copy, which the model's own output shows
