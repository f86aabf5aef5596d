"""Per-layer numbers: backward per node, module tree, FLOPs, module hooks where Dynamo cannot be used, and awkward models.

Every model here trains through a real Trainer to the end, reports how it was captured, and
ends with weights bitwise equal to the same model trained without the profiler.
"""

from __future__ import annotations

import csv
import gzip
import json

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    LitClassifier,
    SmallNet,
    image_loader,
    make_trainer,
    notices,
    own_forward,
    read_events,
    resnet18,
    trace_module,
)
from tensorboard.util import tensor_util
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from fxprof_lightning import FXProfilerCallback, Profiler
from fxprof_lightning.timing.fx_timer import FxNodeTimer

ONE_CYCLE = {"skip_first": 1, "wait": 0, "warmup": 1, "active": 2, "repeat": 1}


def train_both(tmp_path, make_lit, loader_fn=image_loader, steps=4, extra_callbacks=(), **callback_kwargs):
    """The same model trained without and with the profiler: (profiled module, callback), after
    checking the weights are bitwise equal."""
    pl.seed_everything(3, verbose=False)
    plain = make_lit()
    make_trainer(tmp_path / "plain", [], max_steps=steps).fit(plain, loader_fn())
    pl.seed_everything(3, verbose=False)
    profiled = make_lit()
    callback = FXProfilerCallback(**{**ONE_CYCLE, "module": "model", **callback_kwargs})
    make_trainer(tmp_path / "profiled", [callback, *extra_callbacks], max_steps=steps).fit(profiled, loader_fn())
    reference = plain.state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in profiled.state_dict().items()), "training was changed"
    assert own_forward(profiled.model)
    return profiled, callback


def by_name(cycle):
    return {n.name: n for n in cycle.nodes}


def test_backward_per_node_reaches_report_csv_and_tensorboard(tmp_path):
    _, callback = train_both(tmp_path, LitClassifier)
    (cycle,) = callback.cycles
    nodes = by_name(cycle)
    for name in ("conv", "bn", "relu", "mean", "head"):  # every node that created autograd nodes
        assert nodes[name].bwd_calls == 2 and nodes[name].bwd_mean_ms > 0
    assert nodes["drop"].bwd_calls == 2  # dropout's mask multiply
    assert sum(n.bwd_pct for n in cycle.nodes) == pytest.approx(100.0)
    assert cycle.backward_wall_ms > 0 and cycle.backward_ms_per_step <= cycle.backward_wall_ms
    assert "bwd ms/call" in cycle.to_markdown()

    rows = list(csv.DictReader((cycle.directory / "fx_nodes.csv").read_text().splitlines()))
    assert {"bwd_mean_ms", "bwd_median_ms", "bwd_total_ms", "bwd_pct", "fwd_flops", "bwd_flops"} <= set(rows[0])
    events = read_events(tmp_path / "profiled" / "logs" / "version_0")
    tags = set(events.Tags()["scalars"])
    assert {"fxprof/backward_ms_per_step", "fxprof_nodes/conv/backward_ms_per_call",
            "fxprof_nodes/head/backward_ms_per_call"} <= tags
    assert [e.step for e in events.Scalars("fxprof/backward_ms_per_step")] == [3]


def test_backward_timing_can_be_turned_off(tmp_path):
    _, callback = train_both(tmp_path, LitClassifier, backward_timing=False)
    (cycle,) = callback.cycles
    assert all(n.bwd_calls == 0 and n.calls == 2 for n in cycle.nodes)
    nodes_part = cycle.to_markdown().splitlines()[0]  # (the header: the whole step, which has a backward, is below)
    assert cycle.backward_ms_per_step == 0 and "backward" not in nodes_part


@pytest.mark.parametrize("torch_profiler", [False, pytest.param(True, marks=pytest.mark.slow)])  # events of our
# backward-only profiler / of the trace (the slow tier: the same model and checks, the events from the trace)
def test_backward_covers_resnet18_and_in_place_relu_is_fine(tmp_path, torch_profiler, two_threads):
    def resnet():
        return LitClassifier(resnet18(num_classes=4))  # ReLU(inplace=True) throughout

    _, callback = train_both(
        tmp_path, resnet, lambda: image_loader(samples=32, batch_size=8, size=32), steps=8,
        skip_first=1, wait=0, warmup=1, active=2, repeat=2, torch_profiler=torch_profiler,
    )
    coverage = [c.backward_ms_per_step / c.backward_wall_ms for c in callback.cycles]
    assert max(coverage) >= 0.9, coverage  # node backward times account for the step's backward
    assert all(n.bwd_calls for n in callback.cycles[-1].nodes if n.op == "call_module" and "conv" in n.name)


class UserProfiler(pl.Callback):
    """The user's own torch.profiler, from the given training step (None: the start of training) to the end."""

    def __init__(self, from_step=None):
        self.from_step = from_step
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def on_train_start(self, trainer, pl_module):
        if self.from_step is None:
            self.profiler.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.from_step:
            self.profiler.start()

    def on_train_end(self, trainer, pl_module):
        self.profiler.stop()


@notices("another profiler is running")
@pytest.mark.parametrize("torch_profiler", [False, True])
def test_another_profiler_running_means_backward_by_hooks_and_training_unchanged(tmp_path, torch_profiler):
    user = UserProfiler()
    with pytest.warns(UserWarning, match="another profiler is running, so this cycle's backward times come from hooks"):
        _, callback = train_both(tmp_path, LitClassifier, torch_profiler=torch_profiler, extra_callbacks=[user])
    (cycle,) = callback.cycles
    assert cycle.trace_paths == []  # with torch_profiler=True: a trace would have cancelled the user's profiler
    assert all(n.calls == 2 for n in cycle.nodes)
    assert all(n.bwd_calls == 2 and n.bwd_mean_ms > 0 for n in cycle.nodes)
    assert 0 < cycle.backward_ms_per_step <= cycle.backward_wall_ms
    assert any(e.name == "aten::convolution" for e in user.profiler.events())  # the user's profile is intact


def test_a_profiler_started_during_a_cycle_keeps_its_session(tmp_path):
    user = UserProfiler(from_step=3)  # the cycle records steps 2 and 3
    with pytest.warns(UserWarning, match="another profiler started while this cycle recorded and took over"):
        _, callback = train_both(tmp_path, LitClassifier, torch_profiler=False, extra_callbacks=[user], steps=5)
    (cycle,) = callback.cycles
    assert all(n.calls == 2 and n.bwd_calls == 0 for n in cycle.nodes)
    assert any(e.name == "aten::convolution" for e in user.profiler.events())  # its session was not stopped by us
    assert not torch.autograd.profiler._is_profiler_enabled


def test_module_tree_self_and_total_without_double_counting(tmp_path):
    def resnet():
        return LitClassifier(resnet18(num_classes=4))

    _, callback = train_both(tmp_path, resnet, lambda: image_loader(samples=16, batch_size=4, size=32), module_depth=2)
    (cycle,) = callback.cycles
    modules = {m.path: m for m in cycle.modules}
    nodes = cycle.nodes
    root = modules[""]
    assert root.type_name == "ResNet" and root.calls_per_step == 1
    assert root.total_fwd_ms == pytest.approx(sum(n.total_ms for n in nodes) / 2)
    assert root.total_bwd_ms == pytest.approx(sum(n.bwd_total_ms for n in nodes) / 2)
    assert sum(m.self_fwd_ms for m in cycle.modules) == pytest.approx(root.total_fwd_ms)  # each node once
    layer1 = [n for n in nodes if n.module_path.startswith("layer1")]
    assert modules["layer1"].total_fwd_ms == pytest.approx(sum(n.total_ms for n in layer1) / 2)
    assert modules["layer1.0"].self_fwd_ms == pytest.approx(by_name(cycle)["layer1_0_iadd"].total_ms / 2)  # the residual add
    assert modules["layer1.0.relu"].calls_per_step == 2  # a ReLU used twice in BasicBlock
    assert modules["layer1.0.conv1"].type_name == "Conv2d"

    text = cycle.modules_to_text(depth=2)
    assert "layer1 (Sequential)" in text and "  0 (BasicBlock)" in text and "conv1 (Conv2d)" in text
    assert "layer1.0.conv1" not in text and "    conv1 (Conv2d)" not in cycle.modules_to_text(depth=1)
    header, first = (line for line in text.splitlines() if line.startswith(("module ", "(root)")))
    assert header.split()[1:] == ["self", "fwd", "total", "fwd", "self", "bwd", "total", "bwd", "calls/step",
                                  "MB", "saved", "MB", "params", "MB", "grads", "MB", "optim"]  # (memory: test_memory)
    assert len(header) == len(first)  # the numbers sit under their column names
    events = read_events(tmp_path / "profiled" / "logs" / "version_0")
    (logged,) = events.Tensors("fxprof/modules/text_summary")
    assert tensor_util.make_ndarray(logged.tensor_proto).item().decode() == text
    rows = list(csv.DictReader((cycle.directory / "fx_modules.csv").read_text().splitlines()))
    assert rows[0]["path"] == "" and {"self_fwd_ms", "total_fwd_ms", "self_bwd_ms", "total_bwd_ms", "calls_per_step"} <= set(rows[0])


def test_flops_and_output_bytes_match_flop_counter(tmp_path):
    _, callback = train_both(tmp_path, LitClassifier)
    (cycle,) = callback.cycles
    nodes = by_name(cycle)
    x = torch.randn(4, 3, 8, 8)  # batch 4 of 3x8x8, as image_loader gives
    reference = SmallNet()
    with FlopCounterMode(display=False) as conv_forward:
        reference.conv(x)
    assert nodes["conv"].fwd_flops == conv_forward.get_total_flops() == 2 * 4 * 16 * 8 * 8 * 3 * 9
    assert nodes["head"].fwd_flops == 2 * 4 * 16 * 4
    assert nodes["conv"].out_bytes == 4 * 16 * 8 * 8 * 4
    assert nodes["conv"].bwd_flops > 0 and nodes["relu"].fwd_flops == 0
    assert nodes["conv"].fwd_gflops_per_s == pytest.approx(nodes["conv"].fwd_flops / (nodes["conv"].mean_ms * 1e6))
    assert cycle.capture.graphs == 1  # counted on the one graph captured


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, features, scale):
        return self.head(F.gelu(self.embed(features)) * scale)


class LitDict(LitClassifier):
    def __init__(self):
        super().__init__(DictInput())

    def training_step(self, batch, batch_idx):
        x, y = batch
        inputs = {"features": x.flatten(1)[:, :8], "scale": 0.5}
        return F.cross_entropy(self.model(**inputs), y)  # HuggingFace-style call with keywords


def test_forward_called_with_keyword_arguments(tmp_path):
    _, callback = train_both(tmp_path, LitDict)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "dynamo"
    assert {"embed", "gelu", "mul", "head"} == set(by_name(cycle))


class LitTwice(LitClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y) + F.cross_entropy(self.model(x.flip(0)), y.flip(0))


def test_a_forward_called_twice_per_step_counts_two_calls(tmp_path):
    _, callback = train_both(tmp_path, LitTwice)
    (cycle,) = callback.cycles
    assert all(n.calls == 4 and n.bwd_calls == 4 for n in cycle.nodes)  # 2 recorded steps x 2 forwards
    assert {m.path: m.calls_per_step for m in cycle.modules}["head"] == 2


class NothingTraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for _ in range(int(x.abs().sum() > 0) + 1):  # data-dependent loop in the top forward
            x = x * 1.0
        return self.head(self.body(x).mean(dim=(2, 3)))


def test_where_dynamo_cannot_be_used_module_hooks_time_the_model(tmp_path, monkeypatch):
    from fxprof_lightning.capture import timers

    monkeypatch.setattr(timers, "missing_for_dynamo", lambda: "torch._dynamo.optimize has no isolate_recompiles")
    with pytest.warns(UserWarning, match="layers of NothingTraceable are timed by module hooks"):
        profiled, callback = train_both(tmp_path, lambda: LitClassifier(NothingTraceable()))
    (cycle,) = callback.cycles
    assert cycle.capture.method == "module_hooks"
    nodes = by_name(cycle)
    assert set(nodes) == {"(root)", "body", "body.0", "body.1", "head"}
    assert nodes["body.0"].bwd_calls == 2 and nodes["head"].bwd_mean_ms > 0
    assert nodes["(root)"].bwd_calls == 2  # the multiplications in the root's own forward
    modules = {m.path: m for m in cycle.modules}
    assert modules[""].total_fwd_ms == pytest.approx(sum(n.total_ms for n in cycle.nodes) / 2)
    assert modules["body"].total_fwd_ms == pytest.approx((nodes["body"].total_ms + nodes["body.0"].total_ms + nodes["body.1"].total_ms) / 2)
    assert not profiled.model._forward_hooks and not profiled.model.body[0]._forward_pre_hooks  # hooks removed
    trace = json.loads(gzip.decompress(cycle.trace_paths[0].read_bytes()))
    assert {"(root)", "body", "body.0", "head"} <= {e.get("name") for e in trace["traceEvents"]}  # ranges per module


class LitValidated(LitClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))


@notices("profiler is still running")
def test_train_and_eval_mode_each_get_their_own_graph(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=2, module="model", profile_validation=True)
    make_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0).fit(
        LitValidated(), image_loader(samples=16), image_loader(samples=16, seed=1)
    )
    assert set(callback.profiler.timers.chosen) == {True, False}
    assert callback.cycles and callback.val_cycles
    assert by_name(callback.val_cycles[0])["drop"].bwd_calls == 0  # eval: no autograd, no backward


def test_a_module_compiled_by_another_backend_than_inductor_gets_a_clear_message_and_traces_only(tmp_path):
    # Inductor-compiled modules get per-layer times from their kernels: tests/test_compiled.py.
    lit = LitClassifier(torch.compile(SmallNet(), backend="eager"))
    callback = FXProfilerCallback(**ONE_CYCLE, module="model")
    with pytest.warns(UserWarning, match="torch.compile'd, but no Inductor-compiled graph ran") as warned:
        make_trainer(tmp_path, [callback], max_steps=4).fit(lit, image_loader())
    assert not any("did not run" in str(w.message) for w in warned)  # it did run, compiled by another backend
    (cycle,) = callback.cycles
    assert cycle.nodes == [] and len(cycle.trace_paths) == 1


def test_a_compiled_module_without_torch_profiler_gets_a_clear_message(tmp_path):
    lit = LitClassifier(torch.compile(SmallNet(), backend="eager"))
    callback = FXProfilerCallback(**ONE_CYCLE, module="model", torch_profiler=False)
    with pytest.warns(UserWarning, match="torch_profiler=False turns that off, so node timing is off too"):
        make_trainer(tmp_path, [callback], max_steps=4).fit(lit, image_loader())
    (cycle,) = callback.cycles
    assert cycle.nodes == [] and cycle.trace_paths == []


@notices("lacks what the Dynamo capture needs")
def test_a_torch_without_what_dynamo_capture_needs_is_timed_by_module_hooks_and_told_once(tmp_path, monkeypatch, recwarn):
    # As torch 2.11 on the H200 we were lent (2026-11-26): no isolate_recompiles, and the capture raised TypeError.
    from fxprof_lightning.capture import timers

    monkeypatch.setattr(timers, "missing_for_dynamo", lambda: "torch._dynamo.optimize has no isolate_recompiles")
    _, callback = train_both(tmp_path, LitClassifier)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "module_hooks" and {n.name for n in cycle.nodes} >= {"conv", "bn", "head"}
    assert "has no isolate_recompiles" in cycle.capture.describe()
    told = [str(w.message) for w in recwarn if "lacks what the Dynamo capture needs" in str(w.message)]
    assert len(told) == 1 and f"torch {torch.__version__} lacks" in told[0]
    assert "has no isolate_recompiles; torch 2.14 has it), so the layers of SmallNet are timed by module hooks" in told[0]


@notices("which torch")
def test_a_compiled_module_without_inductor_provenance_gets_its_trace_alone(tmp_path, monkeypatch):
    from fxprof_lightning import torch_api
    from fxprof_lightning.engine import core as engine

    monkeypatch.setattr(engine, "missing_for_kernels", lambda: "trace.provenance_tracking_to_timeline")
    monkeypatch.setattr(torch_api, "compile_backend", lambda module: "inductor")  # (as Inductor's, without its compile)
    lit = LitClassifier(torch.compile(SmallNet(), backend="eager"))
    callback = FXProfilerCallback(**ONE_CYCLE, module="model")
    with pytest.warns(UserWarning, match=r"provenance_tracking_to_timeline, which torch .* lacks .* node timing is off"):
        make_trainer(tmp_path, [callback], max_steps=4).fit(lit, image_loader())
    (cycle,) = callback.cycles
    assert cycle.nodes == [] and len(cycle.trace_paths) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_time_and_memory_leave_results_unchanged():
    model = SmallNet().cuda()
    x = torch.randn(4, 3, 8, 8, device="cuda")
    torch.manual_seed(1)  # the same dropout mask in both calls
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    timer = FxNodeTimer(trace_module(model), device="cuda")
    timer.install(model)
    torch.manual_seed(1)
    out = model(x)
    out.sum().backward()
    timer.uninstall(model)
    timer.samples.resolve()
    assert torch.equal(out, expected) and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(isinstance(ns, int) and ns > 0 for samples in timer.samples.fwd for ns in samples)
    assert all(sum(timer.samples.bwd_ns(i)) > 0 for i, n in enumerate(timer.samples.nodes) if n.name in ("conv", "head"))
    assert all(len(deltas) == 1 for deltas in timer.samples.mem_delta)


class RowsInAFunction(nn.Module):
    """A Sequential's layers, then ops in a plain function of the user's (outside every submodule)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 4))

    def forward(self, x):
        return scaled(self.body(x))


def scaled(x):
    return F.softplus(x) * 2 + F.softplus(x)


def test_rows_are_named_as_the_code_names_them(tmp_path, capsys):
    # Issue 31: ``slowest 0 (49%)`` and ``| 0 | module |`` for a Sequential's first child read like a bug.
    model = RowsInAFunction()
    with Profiler(model, dirpath=tmp_path, wait=1, warmup=1, active=2, repeat=1, torch_profiler=False,
                  pictures=False) as prof:
        for _ in range(4):
            model(torch.randn(64, 64)).sum().backward()
            prof.step()
    (cycle,) = prof.cycles
    line = next(text for text in capsys.readouterr().out.splitlines() if text.startswith("Profiler: cycle 0"))
    assert f"; slowest {cycle.nodes[0].layer}: " in line, line
    where = f"scaled (test_layers.py:{scaled.__code__.co_firstlineno + 1})"
    # (a label two rows share gets each row's call number)
    expected = {"body.0 (Linear)", "body.1 (ReLU)", "body.2 (Linear)", f"F.softplus in {where} #1",
                f"F.softplus in {where} #2", f"x * y in {where}", f"x + y in {where}"}
    assert {n.layer for n in cycle.nodes} == expected
    markdown = cycle.to_markdown()
    assert "| layer | op |" in markdown and "| bound | node |" in markdown and all(f"| `{layer}` |" in markdown for layer in expected)
    table = list(csv.DictReader((cycle.directory / "fx_nodes.csv").open()))
    assert {row["layer"] for row in table} == expected and {row["name"] for row in table} == {n.name for n in cycle.nodes}
