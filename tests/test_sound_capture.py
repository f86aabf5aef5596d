"""The timed program is the program eager runs (issue 18): Dynamo's capture, verified against eager forward and
backward, captured again when the module changes mid-run, refused when it differs.

Every test trains the same model twice through a real Trainer (or the plain-loop ``Profiler``), once with the
profiler and once without, applies the same mid-run change to both, and asserts that every weight and buffer
ends bitwise equal; then that the change was seen (a recapture, or a refusal) and what the user gets.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.utils.checkpoint
from helpers import image_loader, make_trainer, notices
from lightning.pytorch.callbacks import BackboneFinetuning, Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from fxprof_lightning import FXProfilerCallback, Profiler, torch_api
from fxprof_lightning.capture import dynamo as dynamo_capture
from fxprof_lightning.capture import dynamo_rules
from fxprof_lightning.capture.recaptures import hook_functions

# Cycles over steps 1-3, 5-7, 9-11: warm-up 1, recorded 2 (a change at step 6 lands in a recorded step).
CYCLES = {"skip_first": 0, "wait": 1, "warmup": 1, "active": 2, "repeat": 0}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.bn(self.conv(x))))


class Net(nn.Module):
    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class Lit(pl.LightningModule):
    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model if model is not None else Net()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class At(Callback):
    """Applies ``change(trainer, pl_module)`` before the training step of ``step``, in both runs alike."""

    def __init__(self, step: int, change) -> None:
        self.step, self.change = step, change

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.change(trainer, pl_module)


def train_both(tmp_path, make_lit, changes=list, steps=10, loader_fn=image_loader, trainer_kwargs=None, **kwargs):
    """(profiled LightningModule, callback), after checking every weight and buffer is bitwise the same as
    without the profiler."""
    trainer_kwargs = trainer_kwargs or {}
    pl.seed_everything(3, verbose=False)
    plain = make_lit()
    make_trainer(tmp_path / "plain", [*changes()], max_steps=steps, **trainer_kwargs).fit(plain, loader_fn())
    pl.seed_everything(3, verbose=False)
    profiled = make_lit()
    callback = FXProfilerCallback(**{**CYCLES, "module": "model", **kwargs})
    make_trainer(tmp_path / "profiled", [callback, *changes()], max_steps=steps, **trainer_kwargs).fit(profiled, loader_fn())
    reference = plain.state_dict()
    assert reference.keys() == profiled.state_dict().keys()
    different = [k for k, t in profiled.state_dict().items() if not _bitwise(t, reference[k])]
    assert not different, f"training was changed: {different}"
    return profiled, callback


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def names(cycle) -> set[str]:
    return {n.name for n in cycle.nodes}


def test_the_default_capture_is_dynamo_with_a_row_per_layer(tmp_path):
    _, callback = train_both(tmp_path, Lit, steps=4)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and cycle.capture.graphs == 1 and not cycle.capture.recaptures
    assert {"stem", "blocks_0_conv", "blocks_0_bn", "blocks_0_relu", "blocks_0_drop", "blocks_0_add",
            "blocks_1_conv", "mean", "head"} <= names(cycle)
    bn = next(n for n in cycle.nodes if n.name == "blocks_0_bn")
    assert bn.calls == 2 and bn.bwd_calls == 2  # batch norm and its num_batches_tracked update: one row
    assert "captured by dynamo (torch._dynamo" in cycle.to_markdown()
    # FLOPs and bytes per row, counted on the meta device after the cycle: the head is Linear(8, 4) on a batch of 4
    head, conv = (next(n for n in cycle.nodes if n.name == name) for name in ("head", "blocks_0_conv"))
    assert head.fwd_flops == 2 * 4 * 8 * 4 and head.bwd_flops == 2 * head.fwd_flops
    assert head.fwd_bytes == 4 * (4 * 8 + 8 * 4 + 4 + 4 * 4)  # input, weight, bias, output (float32)
    assert conv.fwd_flops == 2 * 4 * 8 * 8 * 8 * 8 * 9 and conv.bound in ("compute", "memory", "overhead")


@pytest.mark.parametrize("change, seen", [
    (lambda trainer, lit: lit.model.blocks[0].eval(), "training"),  # fine-tuning recipes freeze blocks this way
    (lambda trainer, lit: setattr(lit.model.blocks[1].drop, "p", 0.6), "p"),  # a drop rate raised mid-run
])
def test_a_submodule_changed_mid_run_is_captured_again(tmp_path, change, seen):
    _, callback = train_both(tmp_path, Lit, changes=lambda: [At(6, change)])
    later = callback.cycles[-1].capture
    assert later.method == "dynamo" and later.graphs == 2
    assert len(later.recaptures) == 1 and seen in later.recaptures[0]
    assert callback.cycles[0].capture.recaptures == []  # each report keeps its own description


def test_a_head_replaced_mid_run_is_the_head_that_trains(tmp_path):
    def swap(trainer, lit):
        lit.model.head = nn.Linear(8, 4)
        trainer.optimizers[0].add_param_group({"params": lit.model.head.parameters()})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _profiled, callback = train_both(tmp_path, Lit, changes=lambda: [At(6, swap)])
    # The fit ends in a warm-up step (9): that cycle's trace holds no timed call, and writing its node ranges is no
    # error (it was: "none of the anchor ranges is in the trace").
    assert not [w for w in caught if "node ranges" in str(w.message)]
    # The graph takes the parameters as inputs, read from the module at each call: the same graph runs the new head.
    later = callback.cycles[-1]
    assert later.capture.method == "dynamo" and "head" in names(later)


class Unrolled(Net):
    """``Net`` calling its blocks one by one (as torchvision's ResNet calls its stages), not in a loop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[1](self.blocks[0](self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("model", [pytest.param(Unrolled, marks=pytest.mark.slow), Net])  # (Unrolled: the slow tier)
def test_a_hook_added_mid_run_runs_at_every_step(tmp_path, model):
    seen = {"plain": [], "profiled": []}  # the hook keeps the block's outputs, as activation-inspecting hooks do

    def add_hook(trainer, lit):
        outputs = seen["profiled" if any(isinstance(c, FXProfilerCallback) for c in trainer.callbacks) else "plain"]
        lit.model.blocks[1].register_forward_hook(lambda module, inputs, output: outputs.append(output.detach()))

    # Dynamo guards on what the hook touches (the length of the list it appends to): each call misses the guards of
    # the capture before it, which is seen before the call (``_EntryGuards``), so the call is captured, not untimed.
    with contextlib.ExitStack() as expected:
        if model is Net:
            expected.enter_context(pytest.warns(UserWarning, match="not the program eager runs"))
        _, callback = train_both(tmp_path, lambda: Lit(model()), changes=lambda: [At(5, add_hook)], steps=16)
    assert len(seen["plain"]) == 11  # steps 5-15
    recaptures = max((c.capture.recaptures for c in callback.cycles), key=len)  # the timer's, run-long
    assert "_forward_hooks" in recaptures[0]
    # The hook ran in every step, timed or not (never bypassed), and only there: what it appended in the checking
    # calls of a capture (the module's own forward and the graph, compared) was taken back (``side_effects``).
    assert len(seen["profiled"]) == len(seen["plain"])
    # Missing the guards at every call right after a capture: from then on the hooks run eagerly, between graphs.
    last = callback.cycles[-1]
    if model is Unrolled:  # every layer keeps its rows, the hooked block's too, timed at every call
        assert "forward hooks run eagerly" in recaptures[-1], recaptures
        assert last.capture.method == "dynamo" and last.capture.graphs > 1, last.capture
        assert last.capture.recaptures == recaptures  # no capture after the switch
        assert {"stem", "blocks_1_conv", "blocks_1_bn", "blocks_1_add", "mean", "head"} <= names(last)
        assert all(n.calls == 2 for n in last.nodes if n.name in ("stem", "blocks_1_conv", "head"))
    else:  # the hook's graph break inside the loop over the blocks: Dynamo runs that frame (stem, head) eagerly
        assert last.capture.method == "module_hooks" and "stem, head ran outside Dynamo's graphs" in last.capture.error
        assert "blocks.1" in names(last)


class Reads(Block):
    """A block that reads a value on the host between its layers (a graph break)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if x.abs().max().item() > 1e9:  # never: only the read matters
            x = x * 0
        return x + self.drop(F.relu(self.bn(x)))


class Looped(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Reads(8) for _ in range(3)])


def test_layers_that_run_one_graph_each_have_their_own_rows(tmp_path):
    """The graph break in a block inside the loop over the blocks makes Dynamo run the loop's frame eagerly, and
    each block's forward a frame of its own: one pair of graphs (before and after the read), given each block's
    parameters as inputs, serves all three blocks (as in wav2vec2's encoder). Each block's ops are its own rows."""
    _, callback = train_both(tmp_path, lambda: Lit(Looped()), steps=4)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and cycle.capture.graphs == 2, cycle.capture
    for block in range(3):
        rows = {n.name: n for n in cycle.nodes if n.name.startswith(f"blocks_{block}_")}
        assert {f"blocks_{block}_{layer}" for layer in ("conv", "bn", "relu", "drop", "add")} <= rows.keys(), rows.keys()
        assert all(n.calls == 2 for n in rows.values()), [(n.name, n.calls) for n in rows.values()]
        assert all(rows[f"blocks_{block}_{layer}"].bwd_calls == 2 for layer in ("conv", "bn", "relu", "drop", "add"))
        assert rows[f"blocks_{block}_relu"].module_path == f"blocks.{block}"
    flops = {n.name: n.fwd_flops for n in cycle.nodes if n.name.endswith("_conv")}
    assert flops["blocks_0_conv"] and len(set(flops.values())) == 1, flops  # counted for every block's rows
    assert cycle.capture.host_reads  # the read is named
    # The loop's frame, run eagerly, calls the stem and the head: untimed, and named so.
    assert set(cycle.capture.untimed) == {"stem", "head"} and "untimed, outside the graphs: stem, head" in cycle.to_markdown()


class NormFirst(Reads):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(x)
        if x.abs().max().item() > 1e9:  # never: only the read (a graph break) matters
            x = x * 0
        return x + self.drop(F.relu(self.conv(x)))


class SharedNorm(Looped):
    """Blocks that all run one norm module, first in their forward: its weight, the graphs' first input, tells no
    block from another (each block's rows went to the last block's)."""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.GroupNorm(2, 8)
        self.blocks = nn.ModuleList([NormFirst(8) for _ in range(3)])
        for block in self.blocks:
            block.bn = norm


def test_blocks_sharing_a_module_still_have_their_own_rows(tmp_path):
    _, callback = train_both(tmp_path, lambda: Lit(SharedNorm()), steps=4)
    nodes = callback.cycles[0].nodes
    conv = {n.name: n.calls for n in nodes if n.name.endswith("_conv")}
    assert conv == {"blocks_0_conv": 2, "blocks_1_conv": 2, "blocks_2_conv": 2}, conv
    # The ops before the read (the shared norm's graph) run for every block: given to no block (the norm itself
    # is one module, one row), never all to one block (before: blocks_2_abs with the 6 calls of all three).
    shared = {n.name: n.calls for n in nodes if n.calls == 6}
    # The code after the read (its graph break) is one row for the three blocks, named by its line.
    line = NormFirst.forward.__code__.co_firstlineno + 2
    read = f"NormFirst.forward (test_sound_capture.py:{line}): if x.abs().max().item() > 1e9:  # never:..."
    assert shared.keys() == {"blocks_2_bn", "abs", "max", read}, sorted((n.name, n.calls) for n in nodes)
    assert next(n for n in nodes if n.name == read).module_path == ""


def test_a_block_replaced_mid_run_by_one_of_its_class_gets_its_rows(tmp_path):
    """Dynamo's guards let a new block of the same class through (its parameters are graph inputs): its calls are
    still timed in its own rows, not in another block's."""

    def replace_block(trainer, lit):
        lit.model.blocks[1] = Reads(8)
        trainer.optimizers[0].add_param_group({"params": list(lit.model.blocks[1].parameters())})

    _, callback = train_both(tmp_path, lambda: Lit(Looped()), changes=lambda: [At(4, replace_block)], steps=8)
    conv = {n.name: n.calls for n in callback.cycles[-1].nodes if n.name.endswith("_conv")}
    assert conv == {"blocks_0_conv": 2, "blocks_1_conv": 2, "blocks_2_conv": 2}, conv


def test_the_hooks_run_eagerly_are_the_models_own_functions():
    """A hook that is a module (its ``__call__`` is every module's) is never marked to run eagerly."""
    net, seen = Net(), []

    def keep(module, inputs, output):
        seen.append(output)

    class Counter(nn.Module):
        def forward(self, module, inputs, output):
            return None

    net.head.register_forward_hook(keep)
    net.stem.register_forward_hook(Counter())
    assert hook_functions(net) == (keep,)


def test_the_float_grouped_mm_meta_kernel_is_put_back():
    """Inside the block (Python dispatcher) float32 ``_grouped_mm`` has a meta kernel; after it, fake tensors fail
    on it again as torch's own kernel does, however often the block was entered."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxprof_lightning.timing.flops import float_grouped_mm_meta

    if torch_api.grouped_mm is None:  # (torch < 2.8: no such op, which no model can call) the block changes nothing
        with float_grouped_mm_meta():
            assert not hasattr(torch.ops.aten, "_grouped_mm")
        return

    def fake_call() -> torch.Size:
        with FakeTensorMode():
            a, b, offs = torch.empty(6, 4), torch.empty(2, 4, 5), torch.tensor([3, 6], dtype=torch.int32)
            return torch._grouped_mm(a, b, offs=offs).shape

    with pytest.raises(RuntimeError) as own:  # torch's own meta kernel refuses float32 (its words differ by torch)
        fake_call()
    for _ in range(2):
        with float_grouped_mm_meta(), enable_python_dispatcher():
            assert fake_call() == (6, 5)
        with pytest.raises(RuntimeError, match=re.escape(str(own.value))):
            fake_call()
        with pytest.raises(RuntimeError, match=re.escape(str(own.value))), enable_python_dispatcher():
            fake_call()


def test_a_global_module_hook_added_and_removed_mid_run_is_never_bypassed(tmp_path):
    """``register_module_forward_hook`` reaches every module; Dynamo inlines it at capture and does not guard on it. A
    hook that halves every conv's output, added in a warm-up step and removed in a recorded one, changes training: the
    weights are bitwise those of the run without the profiler only if it ran exactly when it was registered."""
    handles = []

    def add(trainer, lit):
        handles.append(nn.modules.module.register_module_forward_hook(
            lambda module, inputs, output: output * 0.5 if isinstance(module, nn.Conv2d) else None))

    def remove(trainer, lit):
        handles.pop().remove()

    _, callback = train_both(tmp_path, Lit, changes=lambda: [At(5, add), At(10, remove)], steps=14)
    recaptures = [r for c in callback.cycles for r in c.capture.recaptures]
    assert sum("global module hook" in r for r in recaptures) >= 2, "\n".join(recaptures)  # added, removed
    assert all(c.capture.method == "dynamo" for c in callback.cycles)


class Backbone(pl.LightningModule):
    """``BackboneFinetuning`` wants ``pl_module.backbone``; the profiled module is the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.backbone(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.05)


def test_unfreezing_with_backbone_finetuning(tmp_path):
    # 16 samples in batches of 4: epoch 1 starts at step 4, when the backbone is unfrozen.
    _, callback = train_both(tmp_path, Backbone, changes=lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                             loader_fn=lambda: image_loader(samples=16), module=None)
    assert all(c.capture.method == "dynamo" for c in callback.cycles)
    assert any(c.capture.recaptures for c in callback.cycles)  # requires_grad changed: the graph was captured again
    # (named by Dynamo's guard on 2.14+; before, Dynamo misses it and the timer's own check names it)
    assert any("requires_grad" in r for c in callback.cycles for r in c.capture.recaptures), callback.cycles
    assert {"backbone_0", "backbone_1", "head"} <= names(callback.cycles[-1])


class Tokens(Dataset):
    """Sequences of lengths 5 to 8 (padded per batch, as collators do) and a short last batch."""

    def __len__(self):
        return 14

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(i)
        return torch.randint(1, 50, (5 + i % 4,), generator=generator), i % 3


def pad(batch):
    tokens = nn.utils.rnn.pad_sequence([t for t, _ in batch], batch_first=True)
    return tokens, torch.tensor([y for _, y in batch])


class Encoder(nn.Module):
    """torch.nn's composite transformer layer, defaults (dropout 0.1), on padded tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        x = self.layer(self.embed(tokens), src_key_padding_mask=tokens == 0)
        return self.head(x.mean(dim=1))


def test_dynamic_padding_and_a_short_last_batch_with_a_composite_layer(tmp_path):
    _, callback = train_both(tmp_path, lambda: Lit(Encoder()), steps=12,
                             loader_fn=lambda: DataLoader(Tokens(), batch_size=4, collate_fn=pad))
    rows = set().union(*(names(c) for c in callback.cycles))
    # TransformerEncoderLayer is opened: its layers are rows of their own, and so is its attention with a padding mask
    # (F._check_key_padding_mask's message closure broke the graph there: a traceable twin runs while installed).
    assert {"layer_linear1", "layer_linear2", "layer_norm1", "layer_norm2", "layer_dropout1"} <= rows
    assert {"layer_self_attn_linear", "layer_self_attn_linear_1", "layer_self_attn_scaled_dot_product_attention"} <= rows
    assert not any("multi_head_attention_forward" in row for row in rows)
    assert not any(c.capture.graph_breaks for c in callback.cycles)
    assert all(c.capture.leaves == {} and c.whole_share == 0 for c in callback.cycles)
    assert F._check_key_padding_mask.__code__ is not dynamo_rules._check_key_padding_mask.__code__  # put back
    assert any(c.capture.recaptures for c in callback.cycles)  # a new length (or the short batch) was captured again


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 16)
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x.flatten(2).transpose(1, 2))  # an image of 8 x 8 pixels as 64 tokens of 3 channels
        return self.head(self.attn(x, x, x)[0].mean(dim=1))


def test_multi_head_attention_is_opened(tmp_path):
    """``F.multi_head_attention_forward`` (one call in Dynamo's graph) is traced into: its ops are rows."""
    _, callback = train_both(tmp_path, lambda: Lit(Attention()), steps=4)
    rows = names(callback.cycles[0])
    assert {"attn_linear", "attn_bmm", "attn_softmax", "attn_dropout", "attn_linear_1"} <= rows, rows
    assert not any("multi_head_attention_forward" in row for row in rows)


class DemoTransformer(pl.LightningModule):
    """Lightning's own demo model (``lightning.pytorch.demos.Transformer``: ``nn.Transformer`` with a causal mask),
    trained as its demo trains it, on random tokens."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(self.model(x, y), y.view(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_loader():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (32, 2, 10), generator=generator)
    return DataLoader(torch.utils.data.TensorDataset(tokens[:, 0], tokens[:, 1]), batch_size=4)


def test_lightning_demo_transformer_is_timed_layer_by_layer(tmp_path):
    """``nn.Transformer``'s causal-mask check (``.item()``) breaks Dynamo's graph, after which torch's own frames would
    run untimed: the capture follows them, and every layer of the encoder and decoder, attention included, is rows."""
    _, callback = train_both(tmp_path, DemoTransformer, steps=4, loader_fn=token_loader)
    cycle = callback.cycles[0]
    rows = names(cycle)
    assert cycle.capture.method == "dynamo" and cycle.capture.graph_breaks
    assert {"transformer_encoder_layers_0_linear1", "transformer_encoder_layers_0_self_attn_scaled_dot_product_attention",
            "transformer_decoder_layers_0_multihead_attn_linear", "transformer_decoder_layers_0_norm3", "decoder"} <= rows
    assert not any("multi_head_attention_forward" in row for row in rows)
    assert cycle.capture.leaves == {} and cycle.whole_share == 0
    typical = {n.name: n.min_ms * n.calls for n in cycle.nodes}  # (fastest calls: a call stalled by load is no share)
    whole = sum(typical[n.name] for n in cycle.nodes if n.module_path == "" and n.name not in ("decoder", "log_softmax"))
    assert whole < 0.2 * sum(typical.values())


def checkpointed_llama(reentrant: bool | None = None):
    from hf_models import tiny_llama

    model = tiny_llama()
    # every decoder layer through torch.utils.checkpoint: HF's default kwargs (use_reentrant=False since
    # transformers 5; True before), or reentrant as asked
    model.gradient_checkpointing_enable(None if reentrant is None else {"use_reentrant": reentrant})
    return model


@pytest.mark.slow  # (4-6 s each: the quick loop stays under 3 minutes)
@pytest.mark.parametrize("reentrant", [None, True])
def test_hf_gradient_checkpointing_is_kept_and_opened(tmp_path, reentrant):
    from hf_models import LitHF, lm_loader

    _, callback = train_both(tmp_path, lambda: LitHF(lambda: checkpointed_llama(reentrant)), steps=4, loader_fn=lm_loader)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and "refused" not in cycle.capture.error
    rows = names(cycle)
    assert {"model_layers_0_self_attn_q_proj", "model_layers_1_mlp_down_proj"} <= rows
    if torch_api.RESUMES_IN_LOOPS:
        assert "lm_head" in rows
    else:  # (torch 2.6: a graph break in a loop runs the frame that calls lm_head eagerly) untimed, and said so
        assert "graph break inside a loop" in cycle.capture.untimed["lm_head"]
    assert {n.name for n in cycle.nodes if n.op == "recompute"} == {"model_layers_0_recompute", "model_layers_1_recompute"}
    assert cycle.whole_share == 0
    projection = next(n for n in cycle.nodes if n.name == "model_layers_1_mlp_down_proj")
    assert projection.calls == projection.bwd_calls == 2 and projection.bwd_mean_ms > 0  # its backward is its own


def test_llama_in_bf16_with_a_padding_mask(tmp_path):
    """HF builds its attention mask differently while Dynamo traces (``is_torchdynamo_compiling()``): in bf16 the
    gradients could differ from eager's. Either the graph is bitwise eager's and used, or it is refused with the
    first differing tensor named; training is unchanged either way."""
    from hf_models import LitHF, lm_loader, tiny_llama

    _, callback = train_both(tmp_path, lambda: LitHF(tiny_llama), steps=4, loader_fn=lm_loader,
                             trainer_kwargs={"precision": "bf16-mixed"})
    capture = callback.cycles[0].capture
    assert capture.method == "dynamo" or "differs from eager" in capture.error, capture.error
    # HF asks torch.compiler.is_exporting() in a try/except; torch 2.6 has none, and is lent one only while installed.
    assert not any(hasattr(owner, name) for owner, name in torch_api._LENT)


class CheckpointFirst(nn.Module):
    """A checkpointed region before the graph's first timed op (its rows continue the call after the region)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.1))
        self.mid, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(torch.relu(self.mid(x)))


def train_plain_loop(tmp_path, make, batches, **schedule):
    """(profiler, model) after an SGD loop with the plain-loop Profiler, its weights checked bitwise against the
    same loop without it."""
    models = []
    for profiled in (False, True):
        torch.manual_seed(0)
        model = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prof = Profiler(model, dirpath=tmp_path, torch_profiler=False, pictures=False, sinks=[], **schedule) if profiled else None
        with prof if prof is not None else contextlib.nullcontext():
            for x, y in batches:
                F.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if prof is not None:
                    prof.step()
        models.append((prof, model))
    (_, plain), (prof, model) = models
    assert all(_bitwise(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))
    return prof, model


def test_a_checkpointed_region_first_in_the_graph(tmp_path):
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(6)]
    prof, _ = train_plain_loop(tmp_path, CheckpointFirst, batches, wait=1, warmup=1, active=3, repeat=1)
    (cycle,) = prof.cycles
    rows = {n.name: n for n in cycle.nodes}
    assert {"block_0", "block_1", "block_2", "mid", "relu", "head", "block_recompute"} <= set(rows)
    assert all(rows[name].calls == 3 and rows[name].bwd_calls == 3 for name in ("block_0", "mid", "head"))


def test_a_short_last_batch_every_epoch_is_captured_again_never_refused(tmp_path):
    generator = torch.Generator().manual_seed(0)
    data, target = torch.randn(10, 8, generator=generator), torch.randn(10, 4, generator=generator)
    batches = [(data[s:s + 4], target[s:s + 4]) for _ in range(5) for s in range(0, 10, 4)]  # 4, 4, 2 per epoch
    prof, _ = train_plain_loop(tmp_path, lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), batches,
                               wait=0, warmup=1, active=14, repeat=1)
    (cycle,) = prof.cycles
    assert cycle.capture.method == "dynamo" and "refused" not in cycle.capture.error
    assert {n.name for n in cycle.nodes} == {"0", "1", "2"} and all(n.calls >= 9 for n in cycle.nodes)


def test_a_recapture_in_a_recorded_step_adds_no_recompute_of_its_check(tmp_path):
    """A smaller batch in a recorded step: captured again, and checked with a backward of its own, whose recompute
    is not the training step's (the region's recompute row has one backward per recorded step, as its layers)."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4 if i < 2 else 3, 8, generator=generator), torch.randn(4 if i < 2 else 3, 4, generator=generator))
               for i in range(6)]
    prof, _ = train_plain_loop(tmp_path, CheckpointFirst, batches, wait=0, warmup=1, active=4, repeat=1)
    (cycle,) = prof.cycles
    assert cycle.capture.recaptures  # the 3-row batch
    rows = {n.name: n for n in cycle.nodes}
    # the step whose call missed the guards (the first 3-row batch) captured again: dropped, and the next step recorded
    assert cycle.steps == [1, 3, 4, 5] and list(cycle.dropped_steps) == [2] and "size mismatch" in cycle.dropped_steps[2]
    assert not cycle.partial and cycle.capture_s > 0
    assert rows["block_recompute"].bwd_calls == rows["head"].bwd_calls == rows["head"].calls == 4


@notices("another profiler is running")
def test_checkpointed_regions_under_the_users_own_profiler(tmp_path):
    """Another profiler runs, so backward is timed by hooks (another instrumented graph): a checkpointed model is
    not captured again at each cycle for it."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(9)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        prof, _ = train_plain_loop(tmp_path, CheckpointFirst, batches, wait=0, warmup=1, active=2, repeat=3)
    assert len(prof.cycles) == 3
    assert all(c.capture.method == "dynamo" and not c.capture.recaptures and c.nodes for c in prof.cycles)


@pytest.mark.slow  # (7 s)
@notices("FLOPs not counted")
@notices("counted no step")  # (2.6: LayerDrop's first count mismatch and the capture after it fill cycle 0)
def test_wav2vec2_with_its_numpy_masks(tmp_path):
    """SpecAugment draws its masks with NumPy's random functions: they must draw from NumPy's own state, as in eager
    (Dynamo's default draws them from torch's, and the graph was refused)."""
    from hf_models import LitHF, audio_loader, tiny_wav2vec2

    _, callback = train_both(tmp_path, lambda: LitHF(tiny_wav2vec2), steps=8, loader_fn=lambda: audio_loader(8),
                             repeat=2)
    cycle = callback.cycles[-1]
    assert cycle.capture.method == "dynamo" and "refused" not in cycle.capture.error
    assert any(name.startswith("wav2vec2_feature_extractor_conv_layers_0") for name in names(cycle))


@notices("FLOPs not counted")
def test_a_hf_model_whose_first_call_installs_its_hooks_is_captured_at_the_next_call(tmp_path):
    """transformers (5.x) installs its output-capturing hooks at a model's first call; on torch 2.6, Dynamo fails while
    tracing that installation (``cannot create weak reference to 'dict' object``). A capture at the module's very first
    call that fails so is tried again at the next call (the first ran eagerly and installed the hooks): Dynamo's rows,
    not module hooks for the whole run."""
    from hf_models import audio_loader, tiny_wav2vec2

    torch.manual_seed(0)
    model = tiny_wav2vec2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Profiler(model, wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, torch_profiler=False, sinks=[],
                  pictures=False) as prof:
        for batch in audio_loader(6):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    (cycle,) = prof.cycles
    assert cycle.capture.method == "dynamo" and cycle.nodes, cycle.capture.error


def unpadded_lm_loader():
    """Causal LM batches with no padding: an all-ones attention mask, which HF drops in eager (sdpa with is_causal)
    but keeps while Dynamo traces (``is_tracing``)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(6):
        ids = torch.randint(3, 64, (4, 12), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return DataLoader(batches, batch_size=None)


@pytest.mark.slow  # (6 s)
def test_llama_without_padding_is_captured_on_the_branches_eager_takes(tmp_path):
    """The first capture keeps the mask, saves other tensors than eager and is refused; the capture made again
    with is_compiling() answered False takes eager's branches (the mask check breaks the graph) and is used."""
    from hf_models import LitHF, tiny_llama

    _, callback = train_both(tmp_path, lambda: LitHF(tiny_llama), steps=4, loader_fn=unpadded_lm_loader)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and "refused" not in cycle.capture.error
    assert {"model_layers_0_self_attn_q_proj", "model_layers_1_mlp_down_proj"} <= names(cycle)
    if torch_api.RESUMES_IN_LOOPS:
        assert "lm_head" in names(cycle)
    else:  # (torch 2.6: a graph break in a loop runs the frame that calls lm_head eagerly) untimed, and said so
        assert "graph break inside a loop" in cycle.capture.untimed["lm_head"]


@notices("counted no step", "FLOPs not counted")  # (Wav2Vec2's own: LayerDrop on 2.6, its masks' nonzero)
def test_a_model_profiled_after_another_in_one_process_is_captured_as_if_alone(tmp_path):
    """Before torch 2.8 a frame Dynamo skips (2.6: a graph break inside a loop) stays skipped for every later capture:
    after a Wav2Vec2 was profiled, a Llama in the same process had every layer untimed, not only ``lm_head`` (the
    suite's order found it). A run's end now lets go of the skips its capture made (``torch_api.codes_unskipped``)."""
    from hf_models import LitHF, audio_loader, tiny_llama, tiny_wav2vec2

    train_both(tmp_path / "wav2vec2", lambda: LitHF(tiny_wav2vec2), steps=4, loader_fn=audio_loader)
    _, callback = train_both(tmp_path / "llama", lambda: LitHF(tiny_llama), steps=4, loader_fn=unpadded_lm_loader)
    untimed = callback.cycles[0].capture.untimed
    assert {"model_layers_0_self_attn_q_proj", "model_layers_1_mlp_down_proj"} <= names(callback.cycles[0]), untimed
    assert set(untimed) <= {"lm_head"}, untimed


def tiny_mixtral() -> nn.Module:
    """MixtralForCausalLM from its default config with ``output_router_logits=True`` (its auxiliary load-balancing
    loss, as MoE training recipes set it), only the sizes shrunk."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            num_experts_per_tok=2, vocab_size=64, max_position_embeddings=32,
                                            output_router_logits=True))


@pytest.mark.slow
def test_mixtral_with_router_logits_is_timed_expert_by_expert(tmp_path):
    """HF's MoE experts run ``torch._grouped_mm``, whose meta kernel takes bfloat16 and float16 only while the CPU
    kernel computes float32: on eager's branches Dynamo could not trace it (before 2026-11-25: refused, module
    hooks, no FLOPs). The router logits' output-capturing hooks break the graph (a ContextVar), nothing is left whole."""
    from hf_models import LitHF

    _, callback = train_both(tmp_path, lambda: LitHF(tiny_mixtral), steps=4, loader_fn=unpadded_lm_loader)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and "refused" not in cycle.capture.error, cycle.capture.describe()
    assert not cycle.capture.untimed and not cycle.capture.leaves
    rows = {n.name: n for n in cycle.nodes}
    assert {"model_layers_0_mlp_gate_linear", "model_layers_1_self_attn_q_proj", "lm_head"} <= rows.keys()
    experts = [n for n in cycle.nodes if n.module_path == "model.layers.1.mlp.experts" and n.target.endswith("grouped_mm")]
    assert experts and all(n.calls == 2 for n in experts), [(n.name, n.target) for n in experts]
    # 48 tokens, 2 experts each, through gate_up (32 -> 128) and down (64 -> 32)
    assert sum(n.fwd_flops for n in experts) == 2 * 48 * 2 * (32 * 128 + 64 * 32), [(n.name, n.fwd_flops) for n in experts]
    assert all(n.bwd_flops == 2 * n.fwd_flops for n in experts)


class TensorChecks(nn.Module):
    """Libraries check their inputs' types (diffusers, torchvision detection, PyG): torch.fx's proxies fail them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x):
        if not torch.is_tensor(x) or not isinstance(x, torch.Tensor):
            raise TypeError("x must be a tensor")
        return self.net(x)


def test_isinstance_checks_see_tensors(tmp_path):
    _, callback = train_both(tmp_path, lambda: Lit(TensorChecks()), steps=4)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo"
    assert {"net_stem", "net_blocks_0_conv", "net_head"} <= names(cycle)


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d pattern: the batch-norm forward written out, ``num_batches_tracked`` updated in place,
    cumulative averages (``momentum=None``)."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps)
        return F.silu(x)


@notices("counted no step")
def test_buffer_updates_in_the_model_code_happen_at_every_step(tmp_path):
    def model():
        return Lit(nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct(8, momentum=None), nn.Flatten(), nn.LazyLinear(4)))
    profiled, callback = train_both(tmp_path, model, steps=5)
    assert profiled.model[1].num_batches_tracked.item() == 5
    # ``float(self.num_batches_tracked)`` is a new constant for Dynamo at every call: each call misses the guards or
    # captures again, so no recorded step counts (and the user is told, rather than shown the captures' times).
    assert callback.cycles == []
    # The run's index of cycles says so too, and ``fxprof report`` would: each selected cycle is there or named absent
    (index,) = (tmp_path / "profiled").rglob("fxprof_cycles.jsonl")
    absent = [json.loads(line) for line in index.read_text().splitlines() if "absent" in line]
    assert absent and all("dropped steps" in line["why"] for line in absent), absent


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_regions_are_kept_and_opened(tmp_path, reentrant):
    # Dropout inside the checkpointed blocks: its recompute must draw the same mask (preserve_rng_state, as eager).
    _, callback = train_both(tmp_path, lambda: Lit(Checkpointed(reentrant)), steps=4)
    cycle = callback.cycles[0]
    # verified against eager: the same tensors saved for backward (count and bytes), so checkpointing is kept
    assert cycle.capture.method == "dynamo" and "refused" not in cycle.capture.error
    # the layers inside each region are rows, and each region's recompute in backward is a row of its own
    assert {"stem", "blocks_0_conv", "blocks_0_bn", "blocks_0_drop", "blocks_1_conv", "head"} <= names(cycle)
    recompute = {n.name: n for n in cycle.nodes if n.op == "recompute"}
    assert set(recompute) == {"blocks_0_recompute", "blocks_1_recompute"}
    assert all(n.calls == 0 and n.bwd_calls == 2 and n.bwd_mean_ms > 0 and n.module_path.startswith("blocks.")
               for n in recompute.values())
    conv = next(n for n in cycle.nodes if n.name == "blocks_1_conv")  # FLOPs counted inside the regions too
    assert conv.fwd_flops == 2 * 4 * 8 * 8 * 8 * 8 * 9
    # Each op's backward is its own row's, also in a reentrant region (whose autograd graph its recompute builds),
    # and a recompute is no forward call.
    assert conv.calls == conv.bwd_calls == 2 and conv.bwd_mean_ms > 0
    assert cycle.backward_outside_ms < sum(n.bwd_total_ms for n in recompute.values()) / len(cycle.steps)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_regions_through_the_plain_loop_keep_their_saved_tensors(tmp_path, reentrant):
    """The saved tensors of a step through the timed graph are those of eager: count and bytes."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = torch.randn(4, 3, 8, 8)

    def saved_by_one_step() -> tuple[int, int]:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(x).sum()
        loss.backward()
        return len(sizes), sum(sizes)

    eager = saved_by_one_step()
    seen = []
    with Profiler(model, wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, torch_profiler=False,
                  pictures=False, sinks=[]) as prof:
        for _ in range(3):
            seen.append(saved_by_one_step())
            prof.step()
    assert prof.cycles[0].capture.method == "dynamo"
    assert seen[1:] == [eager, eager]  # the warm-up step captured (and checked); the recorded steps ran the graph


class CompilerAware(Net):
    """Libraries branch on ``torch.compiler.is_compiling()``: under Dynamo this takes another path than eager."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            x = x * 2
        return super().forward(x)


def test_a_model_that_branches_on_is_compiling_is_captured_on_the_branch_eager_takes(tmp_path):
    # The first capture differs from eager (output tensor 0): captured again with is_compiling() answered False.
    _, callback = train_both(tmp_path, lambda: Lit(CompilerAware()), steps=4)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and {"stem", "blocks_0_conv", "head"} <= names(cycle)
    assert not any(n.name.startswith("mul") for n in cycle.nodes)  # the x * 2 of the compiling branch is not there


class RandomScale(Net):
    """A Python random number in the forward: Dynamo turns it into a tensor input, so the graph saves one more
    tensor for backward than eager (the values are the same)."""

    def forward(self, x):
        return super().forward(x) * random.random()


def test_a_graph_that_is_not_the_eager_program_is_refused(tmp_path):
    if not torch_api.TRACES_RANDOM_RANDOM:
        return _random_drawn_between_graphs(tmp_path)
    with pytest.warns(UserWarning, match="not the program eager runs: tensors saved for backward: 25"):
        _, callback = train_both(tmp_path, lambda: Lit(RandomScale()), steps=4)
    capture = callback.cycles[0].capture
    assert capture.method == "module_hooks" and "refused: tensors saved for backward" in capture.error
    assert "blocks.0" in names(callback.cycles[0])  # module hooks time the modules


def _random_drawn_between_graphs(tmp_path):
    """Dynamo < 2.14 breaks the graph at ``random.random()`` and draws it eagerly: the captured program is eager's,
    and accepted. The frame resumed after the break takes the drawn float as a constant; the next value misses its
    guard (that call runs untimed) and the capture after it makes the float an input of the graph (automatic dynamic,
    ``specialize_float`` off): every call after is timed (here the two recorded steps, after three warm-up ones)."""
    _, callback = train_both(tmp_path, lambda: Lit(RandomScale()), steps=6, warmup=3)
    cycle = callback.cycles[0]
    assert cycle.capture.method == "dynamo" and cycle.capture.graphs >= 2, cycle.capture
    assert any("random" in why for why in cycle.capture.graph_breaks), cycle.capture.graph_breaks
    assert len(cycle.capture.recaptures) == 1 and "a guard failed" in cycle.capture.recaptures[0], cycle.capture
    assert {"stem", "blocks_0_conv", "head"} <= names(cycle)
    assert len(cycle.steps) == 2 and not cycle.dropped_steps, cycle.dropped_steps


def test_bf16_autocast(tmp_path):
    _, callback = train_both(tmp_path, Lit, steps=4, trainer_kwargs={"precision": "bf16-mixed"})
    assert callback.cycles[0].capture.method == "dynamo"


def test_plain_loop_eval_flip_and_head_swap(tmp_path):
    def run(profiled: bool):
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = image_loader(samples=48)
        profiler = Profiler(model, **CYCLES, dirpath=tmp_path / "fxprof", sinks=[]) if profiled else None
        if profiler:
            profiler.start()
        for step, (x, y) in enumerate(loader):
            if step == 5:
                model.blocks[0].eval()
            if step == 6:
                model.head = nn.Linear(8, 4)
                optimizer.add_param_group({"params": model.head.parameters()})
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if profiler:
                profiler.step()
        if profiler:
            profiler.stop()
        return model, profiler

    plain, _ = run(False)
    profiled, profiler = run(True)
    reference = plain.state_dict()
    assert all(_bitwise(t, reference[k]) for k, t in profiled.state_dict().items())
    assert len(profiler.cycles[1].capture.recaptures) == 1  # the eval flip (the new head is read at each call)


def test_the_dynamo_wrapper_is_made_once_per_forward_and_again_when_forward_changes():
    """install() wraps the module's forward in the Dynamo context once (70-370 us each time, per traced step before),
    and again when the forward it finds is another function: an instance's own forward, a class's new one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    timer = dynamo_capture.DynamoTimer(True)
    x = torch.randn(2, 4)
    timer.install(model)
    model(x).sum().backward()
    first = timer._compiled
    timer.uninstall(model)
    timer.install(model)
    assert timer._compiled is first
    timer.uninstall(model)
    doubled = nn.Sequential.forward

    def forward(self, input):
        return 2 * doubled(self, input)

    model.forward = forward.__get__(model)
    timer.install(model)
    assert timer._compiled is not first
    out = model(x)
    timer.uninstall(model)
    assert torch.equal(out, 2 * nn.Sequential.forward(model, x))


def test_a_one_graph_capture_asks_the_guards_once_per_call_and_captures_a_new_state_on_its_call(monkeypatch):
    """A capture that is one graph of the forward's frame asks the guards once before a timed call
    (``EntryGuards.fitting``) and runs the code Dynamo made for that state directly, without Dynamo's frame evaluation
    (which would ask them again); a call in a state not captured yet (no grad, a new batch size) still runs nothing
    untimed: it is captured on that call, and gives what eager gives. A capture with a graph break asks
    ``EntryGuards`` first, then Dynamo, as before."""
    class Small(nn.Module):  # (a forward of its own: Dynamo's shape history of nn.Sequential's is the suite's)
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Small()
    x = torch.randn(4, 8)
    asked, fitted = [], []
    check, fitting = dynamo_capture.EntryGuards.check, dynamo_capture.EntryGuards.fitting
    monkeypatch.setattr(dynamo_capture.EntryGuards, "check", lambda self, *a: asked.append(1) or check(self, *a))
    monkeypatch.setattr(dynamo_capture.EntryGuards, "fitting", lambda self, *a: fitted.append(1) or fitting(self, *a))
    timer = dynamo_capture.DynamoTimer(True)
    timer.install(model)
    model(x).sum().backward()  # captured
    through_dynamo, compiled = [], timer._compiled
    timer._compiled = lambda *a, **k: through_dynamo.append(1) or compiled(*a, **k)
    asked.clear()
    for _ in range(3):
        model(x).sum().backward()
    assert asked == [] and fitted == [1, 1, 1] and through_dynamo == [] and timer._one_frame
    with torch.no_grad():
        out = model(x)  # a new state: Dynamo's check refuses it before it runs, and it is captured on this call
    assert len(timer.recaptures) == 1 and "grad_mode" in timer.recaptures[0]
    short = model(x[:2])
    timer.uninstall(model)
    assert timer._misses == 0 and not timer.untimed  # no call ran untimed
    assert len(timer.recaptures) == 2 and {len(samples) for samples in timer.samples.fwd} == {6}  # every call timed
    with torch.no_grad():
        assert torch.equal(out, model(x))
    assert torch.equal(short, model(x[:2]))

    class Broken(nn.Module):  # a graph break: two graphs and the frame Dynamo resumes after it
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    broken = Broken()
    timer = dynamo_capture.DynamoTimer(True)
    timer.install(broken)
    broken(x).sum().backward()
    asked.clear()
    broken(x).sum().backward()
    timer.uninstall(broken)
    assert asked == [1] and timer._one_frame is False


def test_the_guards_of_a_forward_of_torchs_own_are_given_its_frame_as_it_starts():
    """An ``nn.Sequential``'s forward runs in Dynamo's ``wrap_inline`` frame, ``inner(*args, **kwargs)``: the guards are
    given ``args`` and ``kwargs`` whole (as ``Signature.bind`` gives them, without its cost), and a call in the
    captured state passes them."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    timer = dynamo_capture.DynamoTimer(True)
    timer.install(model)
    try:
        model(x).sum().backward()  # captured
        entry = timer._entry
        bound = entry.signature.bind(x, flag=True)
        assert entry._starred == ("args", "kwargs")
        assert entry._locals((x,), {"flag": True}) == {**bound.arguments, **entry.free}
        assert entry.fitting((x,), {})[1] is not None and entry.check((x,), {})[1] == ""
    finally:
        timer.uninstall(model)


class Recurrent(nn.Module):
    """An LSTM over token embeddings (torch.nn's RNNs: Dynamo skips their frames unless ``allow_rnn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm, self.head = nn.Embedding(50, 16), nn.LSTM(16, 32, num_layers=2, batch_first=True), nn.Linear(32, 4)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


def test_an_lstm_is_captured_by_dynamo_and_trains_as_in_eager(tmp_path):
    """Was timed by module hooks: Dynamo skipped the frame (``allow_rnn`` off), and once it followed torch's frames
    it traced the verifier's saved-tensor hook and failed there."""
    def loader():
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 50, (32, 12), generator=generator)
        return DataLoader(torch.utils.data.TensorDataset(tokens, tokens[:, 0] % 4), batch_size=4)

    _, callback = train_both(tmp_path, lambda: Lit(Recurrent()), steps=8, loader_fn=loader)
    cycle = callback.cycles[-1]
    assert cycle.capture.method == "dynamo" and {"embed", "lstm", "head"} <= names(cycle), names(cycle)
    assert all(n.bwd_calls for n in cycle.nodes if n.name in ("embed", "lstm", "head"))
