"""The checkpointing plan (issue 42, item 3), checked by applying it: profile a model, take the plan, wrap the blocks
it names in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, profile again, and compare the measured
saved bytes (deterministic: held to 15% of the predicted saving, as the issue asks) and the added time (loosely here,
under load; ``benchmarks/bench_memory_plan.py`` prints the ratio)."""

from __future__ import annotations

import pytest
import torch
from helpers import resnet18
from torch import nn
from torch.utils.checkpoint import checkpoint

from fxprof_lightning import Profiler, torch_api
from fxprof_lightning.analysis.advice import advise
from fxprof_lightning.analysis.memory_plan import CheckpointPlan, checkpoint_plan, plan_for
from fxprof_lightning.report import ModuleStats

pytestmark = pytest.mark.skipif(not torch_api.READS_SAVED_TENSORS, reason="this torch cannot read saved tensors")


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convs with group norm, a shortcut, a ReLU at the end (it saves its result). Group
    norm, not batch norm: with a batch norm outside a checkpointed block, Dynamo's graph updates its
    ``num_batches_tracked`` unlike eager (torch 2.14.1), so the profiler falls back to module hooks."""

    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False), nn.GroupNorm(4, out)
        self.conv2, self.bn2 = nn.Conv2d(out, out, 3, 1, 1, bias=False), nn.GroupNorm(4, out)
        self.down = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.GroupNorm(4, out)) \
            if stride != 1 or inp != out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.down(x))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(4, 16), nn.ReLU())
        self.layer1 = nn.Sequential(Block(16, 16, 1), Block(16, 16, 1))
        self.layer2 = nn.Sequential(Block(16, 32, 2), Block(32, 32, 1))
        self.layer3 = nn.Sequential(Block(32, 64, 2), Block(64, 64, 1))
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(h.mean((2, 3)))


class GPTBlock(nn.Module):
    """A pre-norm transformer block: attention and an MLP, each added to the residual stream (the adds save nothing)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class SmallGPT(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, vocab: int = 128) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList(GPTBlock(width) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


class Checkpointed(nn.Module):
    """A block recomputed in backward (non-reentrant ``torch.utils.checkpoint``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def apply_plan(model: nn.Module, plan: CheckpointPlan) -> nn.Module:
    """``model`` with each block the plan names wrapped in ``Checkpointed`` (in place)."""
    for path in plan.modules:
        parent, _, name = path.rpartition(".")
        holder = model.get_submodule(parent)
        block = holder.get_submodule(name)
        if isinstance(holder, nn.ModuleList):
            holder[int(name)] = Checkpointed(block)
        else:
            setattr(holder, name, Checkpointed(block))
    return model


def profile(model: nn.Module, make_input, tmp_path, steps: int = 6, active: int = 3):
    """One cycle (a warm-up step, ``active`` recorded) of plain training with AdamW; the report
    (``benchmarks/bench_memory_plan.py`` runs it too)."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, wait=1, warmup=1, active=active, repeat=1, dirpath=tmp_path, torch_profiler=False,
                  pictures=False, sinks=[]) as prof:
        for _ in range(steps):
            model(make_input()).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    (cycle,) = prof.cycles
    return cycle


def _root(cycle) -> ModuleStats:
    return next(m for m in cycle.modules if m.path == "")


MODELS = {
    "resnet": (SmallResNet, lambda: torch.randn(16, 3, 32, 32)),
    "gpt": (SmallGPT, lambda: torch.randint(0, 128, (8, 64))),
    # torchvision's, as its users build it (BatchNorm in training mode: a checkpointed block recomputes it), on a batch
    # whose activations are most of the step's peak (at 8 x 64 x 64 the parameters and AdamW's state are: no plan)
    "torchvision_resnet18": (lambda: resnet18(num_classes=10), lambda: torch.randn(16, 3, 112, 112)),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_plan_applied_saves_what_it_predicted(tmp_path, name):
    make, make_input = MODELS[name]
    torch.manual_seed(0)
    before = profile(make(), make_input, tmp_path / "before")
    plan = before.checkpoint_plan
    assert plan is not None and plan == checkpoint_plan(before.modules, plan.step_ms)
    assert plan.text() in before.to_markdown()
    assert any(plan.blocks in line for line in before.advice) or len(before.advice) == 5  # (the five most at stake)
    assert plan.text() in " ".join(advise([], plan=plan))
    torch.manual_seed(0)
    after = profile(apply_plan(make(), plan), make_input, tmp_path / "after")
    measured = _root(before).saved_bytes_per_step - _root(after).saved_bytes_per_step
    assert measured == pytest.approx(plan.saved_bytes, rel=0.15), (plan.text(), measured)
    if after.distortion or before.distortion:
        pytest.skip(f"the cycles' times are distorted by other load: {after.distortion or before.distortion}")
    # The recompute rows' backward (medians: robust to a call the shared machine stretched), loosely: 2 shared cores.
    recompute = [n for n in after.nodes if n.op == "recompute"]
    added = sum(n.bwd_median_ms * n.bwd_calls for n in recompute) / len(after.steps)
    assert len(recompute) == len(plan.modules) and 0.3 * plan.cost_ms < added < 3 * plan.cost_ms, (plan.text(), added)


@pytest.mark.parametrize(("name", "blocks"), [("resnet", ["layer2"]), ("resnet", ["layer3.0"]),
                                             ("gpt", ["h.1", "h.2"]), ("gpt", ["h.3"])])
def test_a_run_of_blocks_of_ones_choice_saves_what_was_predicted(tmp_path, name, blocks):
    make, make_input = MODELS[name]
    torch.manual_seed(0)
    before = profile(make(), make_input, tmp_path / "before")
    plan = plan_for(before.modules, blocks, 0.0)
    torch.manual_seed(0)
    after = profile(apply_plan(make(), plan), make_input, tmp_path / "after")
    measured = _root(before).saved_bytes_per_step - _root(after).saved_bytes_per_step
    assert measured == pytest.approx(plan.saved_bytes, rel=0.15), (plan.text(), measured)


def _block(path, saved, fwd_ms, inp, held, out, out_held=False, calls=1.0):
    return ModuleStats(path, "Block", path.count(".") + 1, calls, 0.0, fwd_ms, 0.0, 2 * fwd_ms, saved,
                       input_bytes=inp, input_held=held, output_bytes=out, output_held=out_held)


def test_the_plan_picks_the_run_that_saves_most_per_millisecond():
    leaf = [ModuleStats(f"b{i}.0", "Linear", 2, 1.0, 0.0, 0.1, 0.0, 0.2, 0.0) for i in range(4)]
    blocks = [_block("b0", 10e6, 10.0, 1e6, False, 1e6), _block("b1", 40e6, 2.0, 1e6, False, 1e6),
              _block("b2", 40e6, 2.0, 1e6, False, 1e6), _block("b3", 40e6, 20.0, 1e6, False, 1e6)]
    root = ModuleStats("", "Net", 0, 1.0, 0.0, 29.0, 0.0, 58.0, 130e6, param_bytes=10e6, optimizer_bytes=20e6)
    plan = checkpoint_plan([root, *sorted(blocks + leaf, key=lambda m: m.path)], 100.0)
    # b1 and b2 save 19.5 MB per ms each (their own input kept); b1..b2 keeps both inputs: 78 MB for 4 ms; b0..b2 saves
    # more (87 MB) but for 14 ms: 6.2 MB per ms, less than a third of 19.5.
    assert plan == CheckpointPlan(("b1", "b2"), 78e6, 4.0, 160e6, 100.0)
    assert plan.text() == "checkpoint b1..b2: -78.0 MB saved (-49% of the step's peak), about +4.0 ms per step (+4%)"
    few_activations = [ModuleStats("", "Net", 0, 1.0, 0.0, 29.0, 0.0, 58.0, 10e6, param_bytes=100e6), *blocks, *leaf]
    assert checkpoint_plan(few_activations, 100.0) is None


def _batch_norm_then_checkpoint() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                         Checkpointed(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())))


def test_a_batch_norm_outside_a_checkpointed_block_keeps_the_graph(tmp_path):
    """Opening the checkpointed region kept BatchNorm's ``num_batches_tracked.add_(1)`` (its result unused): the graph
    is the program eager runs, and training is bitwise as without the profiler."""
    inputs = [torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    plain, profiled = _batch_norm_then_checkpoint(), _batch_norm_then_checkpoint()
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for x in inputs:
        plain(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    given = iter(inputs)
    cycle = profile(profiled, lambda: next(given), tmp_path)
    assert cycle.capture.method == "dynamo" and _root(cycle).saved_bytes_per_step
    assert profiled[1].num_batches_tracked.item() == len(inputs)
    for (name, a), b in zip(plain.state_dict().items(), profiled.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
