"""A captured graph never does less or more than the user's model: eager habits (random draws that pick the code
that runs, NumPy random numbers, item assignment, a loss module built in the forward, a custom autograd Function, a
no_grad block, state written to the module or its child) train as they do in eager mode under the Dynamo capture.

The models train through a real Trainer and end with weights bitwise equal to the same model trained without the
profiler (``test_layers.train_both``). Dynamo's capture's other checks are in test_sound_capture.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import LitClassifier
from test_layers import train_both
from torch import nn
from torch.nn import functional as F


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
    """Sets its child's state, as RecurrentGemma's temporal block does."""

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
        return self.head(self.block(x) + torch.zeros(x.shape[1]))


@pytest.mark.parametrize("make_lit", [lambda: LitLossInside(EagerHabits()), lambda: LitClassifier(FxBlindSpots()),
                                      lambda: LitClassifier(WithStatefulBlock())],
                         ids=["eager habits", "custom function, no_grad, attribute write", "state set on a child"])
def test_eager_habits_train_as_in_eager_mode_under_the_dynamo_capture(tmp_path, make_lit):
    # (these models were the torch.fx capture's blind spots: refused, traced through or baked into the graph)
    _, callback = train_both(tmp_path, make_lit, steps=6)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "dynamo" and cycle.nodes, cycle.capture.describe()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x))


class DroppingEncoder(nn.Module):
    """Six blocks, each skipped at random in training (LayerDrop, as in Wav2Vec2's and HuBERT's encoders, whose
    default configs have ``layerdrop=0.1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.3:
                continue
            x = layer(x)
        return x


class LayerDropStack(nn.Module):
    """The number of graph calls changes from call to call with no guard failing (the draw breaks the graph inside
    the encoder's loop: Dynamo runs that frame eagerly and captures each block's forward, one graph for all)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.encoder = DroppingEncoder()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(F.relu(self.conv(x)).mean(dim=(2, 3))))


def test_a_random_layer_drop_is_timed_step_after_step(tmp_path):
    """A call that skips another number of layers than the captured one makes another number of graph calls. The first
    time, that is read as a miss (the step is dropped) and the module is captured again; that capture finds no guard
    failing, so the count is no longer read as a miss: later cycles count every recorded step, with Dynamo's rows
    (before, the module fell back to module hooks or lost most of its steps)."""
    from fxprof_lightning.capture.recaptures import VARYING_CALLS

    _, callback = train_both(tmp_path, lambda: LitClassifier(LayerDropStack()), steps=18,
                             **{"wait": 1, "warmup": 1, "active": 3, "repeat": 0})
    cycles = callback.cycles
    assert len(cycles) == 3 and all(c.capture.method == "dynamo" and c.nodes for c in cycles), cycles[-1].capture
    assert [len(c.steps) for c in cycles[-2:]] == [3, 3]
    assert cycles[-1].capture.recaptures.count(VARYING_CALLS) <= 1


class LazyHook(nn.Module):
    """Registers a forward hook on its first call, as transformers installs its output-capturing hooks: on torch 2.6,
    Dynamo fails while tracing that registration (``cannot create weak reference to 'dict' object``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)
        self.seen: list[int] = []

    def forward(self, x):
        if not self.head._forward_hooks:
            self.head.register_forward_hook(self.count)
        return self.head(F.relu(self.conv(x)).mean(dim=(2, 3)))

    def count(self, module, inputs, output) -> None:
        self.seen.append(1)


def test_a_first_call_that_sets_up_hooks_is_captured_at_the_next_call(tmp_path):
    """A capture at the module's very first call that fails in Dynamo is tried once more at the next call (the first
    ran eagerly, untimed, and set up what later calls use), instead of leaving the run to module hooks. The hook runs
    as often as training calls the module."""
    profiled, callback = train_both(tmp_path, lambda: LitClassifier(LazyHook()), steps=6,
                                    **{"skip_first": 0, "wait": 0, "warmup": 1, "active": 2, "repeat": 1})
    assert len(profiled.model.seen) == 6
    (cycle,) = callback.cycles
    # (torch 2.6 guards on the hook's list, so the hook runs eagerly there and its layer is not a row: conv is)
    assert cycle.capture.method == "dynamo" and "conv" in {n.module_path for n in cycle.nodes}, cycle.capture.error
