"""Whether the capture survives the ways people really train: twenty-four patterns, each trained through a real
Lightning ``Trainer`` without the callback and with it (the Dynamo capture, the only one), compared bitwise.

    .venv/bin/python benchmarks/bench_patterns.py [--quick] [--only SUBSTRING] [--details] [--threads N]

Each pattern is a small model trained the way its users train it (timm and torchvision classifiers, HuggingFace
language, speech and MoE models, a diffusers UNet, a torch_geometric GCN, Lightning's demo Transformer, Mask R-CNN),
some with a change made mid-run at step ``CHANGE_STEP`` = 6 by a small callback's ``on_train_batch_start`` (a block
put in ``eval()``, a drop-path rate raised, the head replaced and added to the optimizer, a forward hook added,
``BackboneFinetuning`` unfreezing at its epoch, ``ModelPruning`` pruning at the end of the first epoch of 6 steps),
a GAN generator called under ``no_grad`` and with grad in each step (manual optimisation), a forward that
reads a step counter it keeps (``self.calls += 1``), GPT-2 checkpointed with ``use_reentrant=True``,
``StochasticWeightAveraging`` on a ResNet18 (``max_epochs=2`` of 6 steps: SWA from epoch 1, then its BatchNorm
epoch with ``momentum=None``), a plain function of the user's with a graph break (a call Dynamo skips) that takes
5 ms more from ``CHANGE_STEP``, and a Python loop over a batch's rows in a plain function. Each is trained twice from the same ``pl.seed_everything``:
(a) without our callback, (b) with ``FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=2, repeat=0,
module="model", capture="dynamo", pictures=False)`` (it records steps 2-3, 6-7, 10-11). ``max_steps`` is 12 for the mid-run patterns and Mask R-CNN (its box
counts change at every step: Dynamo makes each dimension dynamic at its second value, so its first steps all capture
again), 24 for the GAN (Lightning counts each of its two optimizers' steps), 5 otherwise. Every
model is built from a config (nothing downloaded) and kept tiny; everything runs on the CPU. ``--quick`` runs
patterns 1, 3, 7 and 9; ``--only`` runs the patterns whose name contains the substring; ``--details`` prints every
callback warning in full and ``capture.describe()`` under each row.

Columns, one row per pattern, (b) against (a):
    pattern, capture: the pattern and the callback's ``capture`` option (``dynamo``).
    method: ``cycles[-1].capture.method`` (``dynamo``; ``module_hooks`` is a fallback).
    rows: ``len(cycles[-1].nodes)``.
    graphs, breaks: ``capture.graphs`` and ``sum(capture.graph_breaks.values())`` .
    recap: ``len(capture.recaptures)``: captures made again because a guard failed.
    whole%: ``CycleReport.whole_share``, max over the run's cycles: percent of node time in rows that time a block
        whole (leaf modules, torch functions kept as one call, every row under module hooks).
    W, B, G: weights (``named_parameters``), buffers (``named_buffers``) and every parameter's ``.grad`` after
        ``fit`` (the last step's) bitwise equal to run (a): ``yes`` or ``NO k/n`` (k of n tensors differ; a None
        grad must match a None).
    ckpt: patterns with activation checkpointing: ``yes`` when the last cycle has ``recompute`` rows and the
        capture was not refused, else ``NO``; ``-`` without checkpointing.
    timed: in the last cycle, the fewest timed calls of a layer row against the calls its counted steps made
        (``calls_per_step`` x steps): every call timed reads n/n; ``-`` for a model without ``torch.nn`` layers (the
        GCN's are PyG's, opened op by op).
    drop: recorded steps the run's cycles dropped because a capture ran in them (``CycleReport.dropped_steps``; each
        replaced by a later idle step; with those of a cycle that counted no step, named in its warning).
    cover: in the last cycle, the node rows' forward per step (``forward_ms_per_step``) / the forward as the user
        times it (the loss call in ``training_step``, mean over the counted steps), then the same with the named row
        of what no row owns (``forward_wall_ms``: the timed calls whole); ``-`` for the GAN (its own training_step).
    cap s: ``sum(capture.capture_s)`` of the last cycle's capture.
    warn: warnings the callback raised in the run (texts naming ``FXProfilerCallback``; one of them is always "the
        Trainer has no logger", as ``logger=False``); those that mention
        "refused", "module hooks" or "not the program eager runs" are printed under the row.
    error: the first 120 characters of ``capture.error`` when the method is ``module_hooks``, or the run's exception.
Then a summary per capture: patterns timed node by node (the last cycle has rows, not from module hooks), whole% <= 10,
bitwise counts, checkpointing kept.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import logging
import os
import platform
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from run_info import package_state, quiet_stderr

from fxprof_lightning import FXProfilerCallback

CHANGE_STEP = 6
SEED = 1234
MID_RUN_STEPS = 12
PLAIN_STEPS = 5
SHOWN = ("refused", "module hooks", "not the program eager runs")


# ------------------------------------------------------------------ the patterns


@dataclass
class Pattern:
    name: str
    build: Callable[[], nn.Module]                        # the model (called after seed_everything)
    batches: Callable[[], list[Any]]                      # one entry per step (an epoch), built from a fixed seed
    loss: Callable[[nn.Module, Any], torch.Tensor]        # training_step's loss
    change: Callable[[pl.Trainer, pl.LightningModule, dict], None] | None = None  # at CHANGE_STEP
    steps: int = PLAIN_STEPS
    checkpointing: bool = False
    precision: str | None = None
    lit: type | None = None                               # a LightningModule class other than Lit
    callbacks: Callable[[], list[pl.Callback]] = field(default=lambda: [])
    note: str = ""
    calls_per_step: int = 1                               # forward calls of ``model`` per training step
    epochs: int | None = None                             # max_epochs instead of max_steps (epoch-based callbacks)


class Lit(pl.LightningModule):
    def __init__(self, pattern: Pattern) -> None:
        super().__init__()
        self.pattern = pattern
        self.model = pattern.build()
        self.forward_ms: dict[int, float] = {}  # step -> ms of the loss call (the forward, as the user measures it)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter_ns()
        loss = self.pattern.loss(self.model, batch)
        self.forward_ms[self.global_step] = (time.perf_counter_ns() - start) / 1e6
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01, momentum=0.9)


class LitFinetune(Lit):
    """``self.model = Sequential(backbone, head)``; ``backbone`` for ``BackboneFinetuning``; the optimizer starts
    with the head's trainable parameters only."""

    @property
    def backbone(self) -> nn.Module:
        return self.model[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.model[1].parameters() if p.requires_grad], lr=0.01, momentum=0.9)


class LitGAN(Lit):
    """The usual manual-optimisation GAN loop: the generator (``model``) runs under ``no_grad`` for the
    discriminator's update and with grad for its own. Lightning counts each optimizer's step in ``max_steps``."""

    def __init__(self, pattern: Pattern) -> None:
        super().__init__(pattern)
        self.automatic_optimization = False
        self.disc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        z = torch.randn(batch.shape[0], 8)
        with torch.no_grad():
            fake = self.model(z)
        loss_d = F.softplus(self.disc(fake)).mean() + F.softplus(-self.disc(batch)).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = F.softplus(-self.disc(self.model(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9),
                torch.optim.SGD(self.disc.parameters(), lr=0.01, momentum=0.9))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(steps: int, n: int, size: int, classes: int = 10) -> list[Any]:
    g = gen()
    return [(torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(steps)]


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def tokens(steps: int, n: int = 2, length: int = 16, vocab: int = 128, pad_last: int = 0) -> list[Any]:
    g = gen()
    out = []
    for _ in range(steps):
        ids = torch.randint(1, vocab, (n, length), generator=g)
        mask = torch.ones(n, length, dtype=torch.long)
        if pad_last:
            mask[0, -pad_last:] = 0
            ids[0, -pad_last:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return out


def vit_tiny(**kwargs: Any) -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10, **kwargs)


def eval_flip(trainer: pl.Trainer, lit: pl.LightningModule, state: dict) -> None:
    lit.model.blocks[:2].eval()


def drop_path_up(trainer: pl.Trainer, lit: pl.LightningModule, state: dict) -> None:
    import timm.layers

    for m in lit.model.modules():
        if isinstance(m, timm.layers.DropPath):
            m.drop_prob = 0.3


def head_swap(trainer: pl.Trainer, lit: pl.LightningModule, state: dict) -> None:
    torch.manual_seed(123)
    lit.model.fc = nn.Linear(512, 10)
    trainer.optimizers[0].add_param_group({"params": lit.model.fc.parameters()})


def hook_added(trainer: pl.Trainer, lit: pl.LightningModule, state: dict) -> None:
    calls = state.setdefault("hook_calls", [])
    lit.model.layer2[0].register_forward_hook(lambda module, args, output: calls.append(1))


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=10)


class StepCounted(nn.Module):
    """A ResNet18 whose forward reads a step counter it keeps (as curricula and schedules do): a new Python number
    at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.calls = resnet18(), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x) * (1.0 + 0.0 * self.calls)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                        max_position_embeddings=64))


def vit_checkpointed() -> nn.Module:
    model = vit_tiny(drop_path_rate=0.1)
    model.set_grad_checkpointing()
    return model


def tv_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


def demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1)


def demo_batches(steps: int) -> list[Any]:
    g = gen()
    return [(torch.randint(0, 50, (4, 10), generator=g), torch.randint(0, 50, (4, 10), generator=g))
            for _ in range(steps)]


def demo_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.nll_loss(model(x, y), y.view(-1))


def gpt2_checkpointed(reentrant: bool | None = None) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64))
    model.gradient_checkpointing_enable(None if reentrant is None else {"use_reentrant": reentrant})
    return model


def swa() -> list[pl.Callback]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return [StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=1)]  # and its BatchNorm epoch after epoch 2


SLOW_S = [0.0]  # the busy wait in ``busy``, from CHANGE_STEP on (``slow_helper``)


@torch.compiler.disable
def busy() -> None:
    """Work Dynamo does not trace (a call it skips): it runs eagerly, between two graphs."""
    end = time.perf_counter() + SLOW_S[0]
    while time.perf_counter() < end:
        pass


def helper(x: torch.Tensor) -> torch.Tensor:
    x = x * 2
    busy()
    return x + 1


class WithHelper(nn.Module):
    """A ResNet18 whose logits go through a plain function of the user's with a graph break in it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = resnet18()
        SLOW_S[0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper(self.net(x))


def slow_helper(trainer: pl.Trainer, lit: pl.LightningModule, state: dict) -> None:
    SLOW_S[0] = 0.005


def rowwise(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([r * 2 + 1 for r in x])  # a Python loop over rows, in a plain function


class RowLoop(nn.Module):
    """A small MLP with a Python loop over the batch's rows in a plain function between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3 * 32 * 32, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(rowwise(self.first(x.flatten(1))))


class GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1 = GCNConv(16, 32)
        self.conv2 = GCNConv(32, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def gcn_batches() -> list[Any]:
    g = gen()
    return [(torch.randn(50, 16, generator=g), torch.randint(0, 50, (2, 200), generator=g),
             torch.randint(0, 4, (50,), generator=g))]


def gcn_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, edge_index, y = batch
    return F.cross_entropy(model(x, edge_index), y)


def unet() -> nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=8)


def unet_batches(steps: int) -> list[Any]:
    g = gen()
    return [(torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 3, 16, 16, generator=g)) for _ in range(steps)]


def unet_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    noisy, noise = batch
    timesteps = torch.randint(0, 1000, (noisy.shape[0],))  # the global RNG: the same stream in every run
    return F.mse_loss(model(noisy, timesteps).sample, noise)


def maskrcnn() -> nn.Module:
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    return maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64)


def maskrcnn_batches(steps: int) -> list[Any]:
    g = gen()
    out = []
    for _ in range(steps):
        imgs, targets = [], []
        for count in (1, 2):
            imgs.append(torch.rand(3, 64, 64, generator=g))
            xy = torch.randint(0, 30, (count, 2), generator=g).float()
            wh = torch.randint(10, 30, (count, 2), generator=g).float()
            boxes = torch.cat([xy, xy + wh], dim=1)
            masks = torch.zeros(count, 64, 64, dtype=torch.uint8)
            for i, (x1, y1, x2, y2) in enumerate(boxes.long().tolist()):
                masks[i, y1:y2, x1:x2] = 1
            targets.append({"boxes": boxes, "labels": torch.randint(1, 3, (count,), generator=g), "masks": masks})
        out.append((imgs, targets))
    return out


def maskrcnn_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    imgs, targets = batch
    return sum(model(imgs, targets).values())


def wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    return Wav2Vec2ForCTC(Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=(32, 32), conv_kernel=(10, 3),
                                         conv_stride=(5, 2), vocab_size=32, num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=2))


def wav2vec2_batches(steps: int) -> list[Any]:
    g = gen()
    return [{"input_values": torch.randn(2, 1600, generator=g), "labels": torch.randint(1, 32, (2, 5), generator=g)}
            for _ in range(steps)]


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
                                            output_router_logits=True))


def finetune_model() -> nn.Module:
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return nn.Sequential(backbone, nn.Linear(16, 10))


def finetune_callbacks() -> list[pl.Callback]:
    from lightning.pytorch.callbacks import BackboneFinetuning

    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, vocab_size=128, num_labels=2,
                                                    max_position_embeddings=64))


def padded_batches(steps: int) -> list[Any]:
    g = gen()
    out = []
    for _ in range(steps):
        lengths = torch.randint(5, 13, (4,), generator=g)
        longest = int(lengths.max())
        ids = torch.zeros(4, longest, dtype=torch.long)
        mask = torch.zeros(4, longest, dtype=torch.long)
        for i, n in enumerate(lengths.tolist()):
            ids[i, :n] = torch.randint(1, 128, (n,), generator=g)
            mask[i, :n] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (4,), generator=g)})
    return out


M, P = MID_RUN_STEPS, PLAIN_STEPS
PATTERNS = [
    Pattern("vit_eval_flip", vit_tiny, lambda: images(M, 4, 32), ce, change=eval_flip, steps=M),
    Pattern("drop_path_change", lambda: vit_tiny(drop_path_rate=0.1), lambda: images(M, 4, 32), ce,
            change=drop_path_up, steps=M),
    Pattern("head_swap", resnet18, lambda: images(M, 4, 32), ce, change=head_swap, steps=M),
    Pattern("hook_added", resnet18, lambda: images(M, 4, 32), ce, change=hook_added, steps=M),
    Pattern("efficientnet_buffers", lambda: __import__("timm").create_model("efficientnet_b0", pretrained=False,
                                                                            num_classes=10),
            lambda: images(P, 2, 64), ce),
    Pattern("llama_bf16", llama, lambda: tokens(P, pad_last=4), hf_loss, precision="bf16-mixed"),
    Pattern("vit_grad_checkpointing", vit_checkpointed, lambda: images(P, 4, 32), ce, checkpointing=True),
    Pattern("tv_vit_b16_tiny", tv_vit, lambda: images(P, 4, 32), ce),
    Pattern("lightning_demo_transformer", demo_transformer, lambda: demo_batches(P), demo_loss),
    Pattern("gpt2_grad_checkpointing", gpt2_checkpointed, lambda: tokens(P), hf_loss, checkpointing=True),
    Pattern("gpt2_reentrant_checkpointing", lambda: gpt2_checkpointed(True), lambda: tokens(P), hf_loss,
            checkpointing=True),
    Pattern("pyg_gcn", GCN, gcn_batches, gcn_loss),
    Pattern("diffusers_unet", unet, lambda: unet_batches(P), unet_loss),
    Pattern("maskrcnn_train", maskrcnn, lambda: maskrcnn_batches(M), maskrcnn_loss, steps=M),  # (see MID_RUN_STEPS)
    Pattern("wav2vec2_ctc", wav2vec2, lambda: wav2vec2_batches(P), hf_loss),
    Pattern("mixtral_router_logits", mixtral, lambda: tokens(P), hf_loss),
    Pattern("backbone_finetuning", finetune_model, lambda: images(4, 4, 32), ce, steps=M, lit=LitFinetune,
            callbacks=finetune_callbacks),
    Pattern("dynamic_padding", bert, lambda: padded_batches(P), hf_loss),
    Pattern("gan_no_grad_and_grad", lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)),
            lambda: [torch.randn(16, 16, generator=gen(i)) for i in range(M)], ce, steps=2 * M, lit=LitGAN,
            calls_per_step=2),
    Pattern("step_counter", StepCounted, lambda: images(M, 4, 32), ce, steps=M),
    Pattern("pruning_epoch_end", resnet18, lambda: images(CHANGE_STEP, 4, 32), ce, steps=M,
            callbacks=lambda: [__import__("lightning.pytorch.callbacks", fromlist=["ModelPruning"]).ModelPruning(
                "l1_unstructured", amount=0.5)]),
    Pattern("swa_batchnorm", resnet18, lambda: images(CHANGE_STEP, 4, 32), ce, epochs=2, callbacks=swa),
    Pattern("helper_graph_break_slows", WithHelper, lambda: images(M, 4, 32), ce, change=slow_helper, steps=M),
    Pattern("loop_in_plain_function", RowLoop, lambda: images(P, 16, 32), ce),
]
QUICK = ("vit_eval_flip", "head_swap", "vit_grad_checkpointing", "lightning_demo_transformer")
PACKAGES = {"vit": "timm", "drop_path": "timm", "efficientnet": "timm", "llama": "transformers", "gpt2": "transformers",
            "wav2vec2": "transformers", "mixtral": "transformers", "dynamic_padding": "transformers",
            "pyg": "torch_geometric", "diffusers": "diffusers", "tv_": "torchvision", "head_swap": "torchvision",
            "hook_added": "torchvision", "maskrcnn": "torchvision", "pruning": "torchvision",
            "step_counter": "torchvision", "swa": "torchvision", "helper": "torchvision"}


# ------------------------------------------------------------------ one run


class Change(pl.Callback):
    """Makes the pattern's change once, at the start of step ``CHANGE_STEP``."""

    def __init__(self, change: Callable[..., None] | None, state: dict) -> None:
        self.change, self.state, self.done = change, state, False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.change is not None and not self.done and trainer.global_step == CHANGE_STEP:
            self.change(trainer, pl_module, self.state)
            self.done = True


@dataclass
class Run:
    lit: pl.LightningModule | None = None
    callback: FXProfilerCallback | None = None
    state: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0


def train(pattern: Pattern, capture: str | None) -> Run:
    run = Run()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pl.seed_everything(SEED, verbose=False)
            run.lit = (pattern.lit or Lit)(pattern)
            loader = DataLoader(pattern.batches(), batch_size=1, shuffle=False, collate_fn=lambda b: b[0])
            callbacks: list[pl.Callback] = [Change(pattern.change, run.state), *pattern.callbacks()]
            if capture is not None:
                run.callback = FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=2, repeat=0, module="model",
                                                  capture=capture, pictures=False, dirpath=tmp)
                callbacks.append(run.callback)
            kwargs = {"precision": pattern.precision} if pattern.precision else {}
            kwargs.update({"max_epochs": pattern.epochs} if pattern.epochs else {"max_steps": pattern.steps})
            trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)
            with quiet_stderr(), contextlib.redirect_stdout(io.StringIO()):  # the console sink's lines
                trainer.fit(run.lit, loader)
        except Exception as error:  # one failing pattern must never stop the script
            run.error = f"{type(error).__name__}: {error}".replace("\n", " ")
            run.state["traceback"] = traceback.format_exc()
    run.warnings = [str(w.message) for w in caught if "FXProfilerCallback" in str(w.message)]
    run.seconds = time.perf_counter() - started
    return run


# ------------------------------------------------------------------ comparing


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach(), b.detach()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def bitwise(ref: dict[str, Any], other: dict[str, Any]) -> str:
    names = sorted(set(ref) | set(other))
    differing = sum(1 for n in names if n not in ref or n not in other or not same(ref[n], other[n]))
    return "yes" if differing == 0 else f"NO {differing}/{len(names)}"


def tensors(lit: pl.LightningModule) -> tuple[dict, dict, dict]:
    params = dict(lit.named_parameters())
    return params, dict(lit.named_buffers()), {n: p.grad for n, p in params.items()}


# ------------------------------------------------------------------ the table

COLUMNS = [("pattern", 26), ("capture", 7), ("method", 24), ("rows", 5), ("graphs", 6), ("breaks", 6), ("recap", 5),
           ("whole%", 6), ("timed", 7), ("drop", 4), ("cover", 9), ("W", 10), ("B", 10), ("G", 10), ("ckpt", 4), ("cap s", 6),
           ("warn", 4), ("error", 0)]


def line(values: list[Any]) -> str:
    cells = []
    for (_, width), value in zip(COLUMNS, values):
        text = str(value)
        cells.append(text if width == 0 else (text[:width].ljust(width) if isinstance(value, str) else text.rjust(width)))
    return " ".join(cells)


@dataclass
class Row:
    pattern: str
    capture: str
    method: str = "-"
    node_level: bool = False
    whole: float | None = None
    weights: str = "-"
    buffers: str = "-"
    grads: str = "-"
    ckpt: str = "-"
    crashed: bool = False


def row_for(pattern: Pattern, capture: str, ref: Run, run: Run, details: bool = False) -> tuple[Row, list[str]]:
    row = Row(pattern.name, capture)
    notes = [w for w in run.warnings if details or any(s in w for s in SHOWN)]
    error = run.error or (f"run without the callback failed: {ref.error}" if ref.error else "")
    cycle = run.callback.cycles[-1] if run.callback is not None and run.callback.cycles else None
    how = cycle.capture if cycle is not None else None
    rows = graphs = breaks = recaps = timed = dropped = coverage = "-"
    cap_s = whole = "-"
    if how is not None:
        row.method = how.method
        row.node_level = bool(cycle.nodes) and how.method not in ("module_hooks", "")  # rows timed, not by hooks
        rows, graphs, breaks, recaps = len(cycle.nodes), how.graphs, sum(how.graph_breaks.values()), len(how.recaptures)
        row.whole = max(c.whole_share for c in run.callback.cycles)
        whole = f"{row.whole:.1f}"
        layers = [n.calls for n in cycle.nodes if n.op == "call_module"]
        timed = f"{min(layers)}/{pattern.calls_per_step * len(cycle.steps)}" if layers else "-"  # (no torch.nn layer)
        measured = [run.lit.forward_ms[step] for step in cycle.steps if step in getattr(run.lit, "forward_ms", {})]
        if measured and len(measured) == len(cycle.steps):  # the loss call of the counted steps, as the user times it
            user = sum(measured) / len(measured)
            coverage = f"{cycle.forward_ms_per_step / user:.2f}/{(cycle.forward_wall_ms or 0) / user:.2f}"
        dropped = sum(len(c.dropped_steps) for c in run.callback.cycles) + sum(  # and cycles that counted no step
            len(re.findall(r"\d+", found)) for w in run.warnings for found in re.findall(r"counted no step: it dropped steps \[([\d, ]+)\]", w))
        cap_s = f"{sum(how.capture_s):.2f}"
        if how.method == "module_hooks" and not error:
            error = how.error
        if pattern.checkpointing:
            kept = any(n.op == "recompute" for n in cycle.nodes) and "refused" not in how.error
            row.ckpt = "yes" if kept else "NO"
    elif run.callback is not None and not error:
        error = "no cycle recorded"
    if not run.error and not ref.error and run.lit is not None and ref.lit is not None:
        (pa, ba, ga), (pb, bb, gb) = tensors(ref.lit), tensors(run.lit)
        row.weights, row.buffers, row.grads = bitwise(pa, pb), bitwise(ba, bb), bitwise(ga, gb)
    row.crashed = bool(error) and (bool(run.error) or bool(ref.error))
    if "hook_calls" in run.state or "hook_calls" in ref.state:
        a, b = len(ref.state.get("hook_calls", [])), len(run.state.get("hook_calls", []))
        notes.insert(0, f"hook calls: {b} with the callback, {a} without ({'same' if a == b else 'DIFFERENT'})")
    text = line([pattern.name, capture, row.method, rows, graphs, breaks, recaps, whole, timed, dropped, coverage, row.weights,
                 row.buffers, row.grads, row.ckpt, cap_s, len(run.warnings), error[:120]])
    if details and how is not None:
        notes.append(f"capture: {how.describe()}")
    return row, [text] + [f"    ! {n[:700] if not details else n}" for n in notes]


def versions() -> str:
    def version(name: str) -> str:
        try:
            return __import__(name).__version__
        except Exception:
            return "missing"

    names = ["torch", "lightning", "transformers", "timm", "diffusers", "torch_geometric", "torchvision"]
    return (f"{datetime.datetime.now().isoformat(timespec='seconds')}; "
            + ", ".join(f"{n} {version(n)}" for n in names)
            + f"; {package_state()}; {platform.platform()}, {os.cpu_count()} CPU(s), "
              f"{torch.get_num_threads()} torch thread(s)")


def missing_package(pattern: Pattern) -> str | None:
    for key, package in PACKAGES.items():
        if key in pattern.name:
            try:
                __import__(package)
            except ImportError:
                return package
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="patterns 1, 3, 7 and 9 only")
    parser.add_argument("--only", default=None, help="only the patterns whose name contains this")
    parser.add_argument("--details", action="store_true",
                        help="print every callback warning and capture.describe() under each row")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    patterns = [p for p in PATTERNS if (not args.quick or p.name in QUICK) and (args.only is None or args.only in p.name)]
    started = time.perf_counter()
    print(versions())
    print(line([name for name, _ in COLUMNS]))
    print("-" * 160)
    rows: list[Row] = []
    for pattern in patterns:
        lacking = missing_package(pattern)
        if lacking:
            print(f"{pattern.name}: skipped, {lacking} is not installed")
            continue
        t0 = time.perf_counter()
        try:
            ref = train(pattern, None)
            run = train(pattern, "dynamo")
            row, lines = row_for(pattern, "dynamo", ref, run, args.details)
            rows.append(row)
            print("\n".join(lines), flush=True)
            if run.error and "traceback" in run.state:
                print("    ! " + run.state["traceback"].strip().splitlines()[-1][:300])
        except Exception as error:  # the comparison itself failed
            print(f"{pattern.name}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        print(f"    ({pattern.name}: {time.perf_counter() - t0:.1f} s for the two runs)", flush=True)
    print("-" * 160)
    ckpt = [r for r in rows if r.ckpt != "-"]
    print(f"dynamo: {len(rows)} patterns; node-level {sum(r.node_level for r in rows)}; "
          f"whole% <= 10: {sum(r.whole is not None and r.whole <= 10 for r in rows)}; "
          f"weights bitwise {sum(r.weights == 'yes' for r in rows)}, buffers {sum(r.buffers == 'yes' for r in rows)}, "
          f"grads {sum(r.grads == 'yes' for r in rows)}; "
          f"checkpointing kept {sum(r.ckpt == 'yes' for r in ckpt)}/{len(ckpt)}; "
          f"crashed {sum(r.crashed for r in rows)}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
