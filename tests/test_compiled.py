"""torch.compile'd models (Inductor, CPU): per-layer time from their kernels, through a real Trainer.

Compiling is slow on 2 cores: two tiny models, each trained once without and once with the callback.
"""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer, read_events
from tensorboard.util import tensor_util
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fxprof_lightning import FXProfilerCallback, torch_api
from fxprof_lightning.capture.compiled import CompiledKernels, missing_for_kernels, module_path

ONE_CYCLE = {"skip_first": 1, "wait": 0, "warmup": 1, "active": 2, "repeat": 1}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


class TinyResNet(nn.Module):
    """ResNet18's pieces at toy size: a stem, residual blocks of conv + batch norm, pooling and a head."""

    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.layer1 = nn.Sequential(Block(width), Block(width))
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = self.layer1(torch.relu(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TinyTransformer(nn.Module):
    """Embedding, one pre-norm encoder layer (nn.TransformerEncoderLayer's defaults otherwise) and a head."""

    def __init__(self, vocab: int = 32, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, batch_first=True, norm_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def token_loader(samples: int = 32, batch_size: int = 4, length: int = 6) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (samples, length), generator=generator)
    return DataLoader(TensorDataset(tokens, torch.randint(0, 4, (samples,), generator=generator)), batch_size=batch_size)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def train_compiled_both(tmp_path, make_model, loader_fn, steps=4):
    """The same compiled model trained without and with the profiler; weights bitwise equal, the same
    number of graphs compiled (no recompilation caused by the profiler). Returns the callback."""
    compiled = {}
    for name, callbacks in (("plain", []), ("profiled", [FXProfilerCallback(**ONE_CYCLE, module="model")])):
        torch._dynamo.reset()
        before = unique_graphs()
        pl.seed_everything(3, verbose=False)
        lit = LitClassifier(torch.compile(make_model()))
        make_trainer(tmp_path / name, callbacks, max_steps=steps).fit(lit, loader_fn())
        compiled[name] = (lit.state_dict(), unique_graphs() - before, callbacks)
    (plain, plain_graphs, _), (profiled, profiled_graphs, (callback,)) = compiled["plain"], compiled["profiled"]
    assert all(torch.equal(t, plain[k]) for k, t in profiled.items()), "training was changed"
    assert profiled_graphs == plain_graphs > 0
    return callback


def without_rows(callback, recwarn) -> bool:
    """Where this torch's Inductor cannot trace kernels back to layers (2.6, 2.8): the cycle has the trace alone,
    and the user was told, naming the torch version."""
    if not missing_for_kernels():
        return False
    (cycle,) = callback.cycles
    assert cycle.nodes == [] and len(cycle.trace_paths) == 1
    assert any(f"which torch {torch.__version__} lacks" in str(w.message) for w in recwarn)
    return True


def test_a_compiled_resnet_gets_per_layer_times_from_its_kernels(tmp_path, recwarn):
    callback = train_compiled_both(tmp_path, TinyResNet, image_loader)
    if without_rows(callback, recwarn):
        return
    (cycle,) = callback.cycles
    assert cycle.capture.method == "compiled" and "provenance" in cycle.capture.describe()
    rows = {n.name: n for n in cycle.nodes}
    # Convolutions run as aten kernels: each is its module's row, forward and backward, twice (2 recorded steps).
    for conv in ("stem", "layer1.0.conv", "layer1.1.conv"):
        assert rows[conv].calls == 2 and rows[conv].total_ms > 0 and rows[conv].bwd_total_ms > 0
    assert rows["fc"].module_path == "fc" and rows["fc"].bwd_total_ms > 0
    # Batch norm, the residual add and relu are fused into one kernel per block, shown against the group.
    fused = cycle.capture.fused
    assert any(name.startswith("layer1.0 + layer1.0.bn") for name in fused) and all(fused.values())
    assert sum(n.pct for n in cycle.nodes) == pytest.approx(100.0)
    assert sum(n.bwd_pct for n in cycle.nodes) == pytest.approx(100.0)
    # Rows of backward kernels alone (fused across modules in backward) are in the table too.
    backward_only = [n for n in cycle.nodes if n.total_ms == 0 and n.bwd_total_ms > 0]
    assert backward_only and all(n.name in fused for n in backward_only)
    assert cycle.capture.graph_breaks == {}
    # The module tree puts the fused rows under the block they belong to.
    modules = {m.path: m for m in cycle.modules}
    assert modules["layer1.0"].total_fwd_ms >= modules["layer1.0.conv"].total_fwd_ms > 0
    written = list(csv.DictReader((cycle.directory / "fx_nodes.csv").read_text().splitlines()))
    assert {r["name"] for r in written} == set(rows)
    assert "compiled" in cycle.to_markdown()
    # TensorBoard gets the tracked rows under tags it accepts as they are (no "illegal name" rewrite).
    events = read_events(tmp_path / "profiled" / "logs" / "version_0")
    tags = set(events.Tags()["scalars"])
    assert "fxprof_nodes/layer1.0.conv/forward_ms_per_call" in tags
    assert {t for t in tags if t.startswith("fxprof_nodes/")} and all(" " not in t and "+" not in t for t in tags)
    # The text tables: rows and the module tree, as for an eager graph.
    (layers,) = events.Tensors("fxprof/layers/text_summary")
    (tree,) = events.Tensors("fxprof/modules/text_summary")
    assert "layer1.0.conv" in tensor_util.make_ndarray(layers.tensor_proto).item().decode()
    tree_text = tensor_util.make_ndarray(tree.tensor_proto).item().decode()
    assert "layer1 (Sequential)" in tree_text and "conv (Conv2d)" in tree_text


def test_a_model_compiled_before_the_profiler_started_gets_its_rows_from_the_next_cycle(tmp_path, recwarn):
    """An earlier fit in the same process compiled the model without Inductor's kernel records (a notebook, a test
    suite): the first cycle says so, the graphs compile again, and the next cycle has the rows; training unchanged."""
    torch._dynamo.reset()
    weights = []
    for name, callbacks in (("plain", []), ("profiled", [FXProfilerCallback(**{**ONE_CYCLE, "repeat": 2}, module="model")])):
        pl.seed_everything(3, verbose=False)
        lit = LitClassifier(torch.compile(TinyResNet()))  # the same forward code: its compiled graph is reused
        make_trainer(tmp_path / name, callbacks, max_steps=8).fit(lit, image_loader())
        weights.append(lit.state_dict())
    assert all(torch.equal(t, weights[0][k]) for k, t in weights[1].items()), "training was changed"
    if missing_for_kernels():
        return
    first, second = callbacks[0].cycles
    assert first.nodes == [] and len(first.trace_paths) == 1
    assert any("compiled before the profiler started" in str(w.message) for w in recwarn)
    rows = {n.name: n for n in second.nodes}
    assert rows["stem"].total_ms > 0 and rows["fc"].bwd_total_ms > 0


def test_a_compiled_transformer_gets_per_layer_times_from_its_kernels(tmp_path, recwarn):
    callback = train_compiled_both(tmp_path, TinyTransformer, token_loader)
    if without_rows(callback, recwarn):
        return
    (cycle,) = callback.cycles
    paths = {n.module_path for n in cycle.nodes}
    assert {"encoder.linear1", "encoder.linear2", "head"} <= paths  # the MLP's matmuls and the head, each its own
    assert any(p.startswith("encoder.self_attn") for p in paths)
    assert all(n.calls == 2 for n in cycle.nodes)


def test_module_paths_from_dynamo_sources():
    assert module_path("L['self'].layer1[0].conv1") == "layer1.0.conv1"
    assert module_path("L['self']._modules['blocks']._modules['0'].bn") == "blocks.0.bn"
    assert module_path("L['self']") == ""


class WithGraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.first(x))
        torch._dynamo.graph_break()  # two graphs: each one's kernels go to its own modules
        return self.second(x)


def test_graph_breaks_are_listed_and_both_graphs_timed(tmp_path, recwarn):
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)),
                        batch_size=4)
    callback = train_compiled_both(tmp_path, WithGraphBreak, lambda: loader)
    if without_rows(callback, recwarn):
        return
    (cycle,) = callback.cycles
    assert any("graph_break" in reason for reason in cycle.capture.graph_breaks), cycle.capture.graph_breaks
    rows = {n.module_path: n for n in cycle.nodes}
    for layer in ("first", "second"):
        assert rows[layer].calls == 2 and rows[layer].total_ms > 0 and rows[layer].bwd_total_ms > 0
    assert "graph breaks: " in cycle.capture.describe() and "\n" not in cycle.capture.describe()  # one line


@pytest.mark.skipif(not torch_api.PROVENANCE_LEVEL or missing_for_kernels() is not None, reason="no provenance record")
def test_each_graph_gets_the_kernels_added_to_the_record_after_its_post_grad_pass(monkeypatch):
    """torch 2.11-2.13 keep one record of kernels per compile_fx call, and the module's own for a backward compiled
    lazily; handles count up in each. A graph's kernels are those after its pass, up to the next pass's."""
    monkeypatch.setattr("fxprof_lightning.capture.compiled._timeline", lambda: False)
    kernels = CompiledKernels()
    compile_fx = {"cpp_fused_relu_0:1": ["relu"], "extern_kernels.addmm:2": ["addmm"], "extern_kernels.mm:3": ["mm"]}
    lazy = {"cpp_fused_sum_0:1": ["sum_1"], "extern_kernels.mm:2": ["mm_1"], "extern_kernels.mm:3": ["mm_2"]}
    kernels.records += [(("0/0", False), compile_fx, 0), (("0/0", True), lazy, 0), (("1/0", False), compile_fx, 2),
                        (("1/0", True), lazy, 2)]
    found = {key: [k.event for k in graph] for key, graph in kernels.kernels().items()}
    assert found == {("0/0", False): ["cpp_fused_relu_0", "aten::addmm"], ("0/0", True): ["cpp_fused_sum_0", "aten::mm"],
                     ("1/0", False): ["aten::mm"], ("1/0", True): ["aten::mm"]}
