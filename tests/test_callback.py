"""FXProfilerCallback through real Trainers and a real TensorBoardLogger: what users read back."""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import LitClassifier, SmallNet, image_loader, make_trainer, notices, own_forward, read_events
from lightning.pytorch.callbacks import TQDMProgressBar
from tensorboard.util import tensor_util
from torch import nn

from fxprof_lightning import CsvSink, FXProfilerCallback, Profiler, torch_api
from fxprof_lightning.outputs.runs import load_cycle
from fxprof_lightning.report import UNOWNED_ENGINE, UNOWNED_FORWARD, UNOWNED_OUTSIDE

TRACE_NAME = re.compile(r"^rank0\.\d+\.pt\.trace\.json\.gz$")
SMALLNET_NODES = {"conv", "bn", "relu", "mean", "drop", "head"}


def scalar_steps(events, tag):
    return [e.step for e in events.Scalars(tag)]


class RecordsInstrumentation(LitClassifier):
    """Notes, at each training step, whether the profiler's instrumented forward is installed."""

    def __init__(self):
        super().__init__()
        self.instrumented_steps = []
        self.steps_seen = 0
        self.model_class = type(self.model)

    def training_step(self, batch, batch_idx):
        if type(self.model) is not self.model_class or "forward" in self.model.__dict__:  # (``forward_swap``)
            self.instrumented_steps.append(self.steps_seen)
        self.steps_seen += 1
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """Two cycles (skip_first=2, wait=1, warmup=1, active=2) over 2 epochs of 8 batches."""
    root = tmp_path_factory.mktemp("run")
    callback = FXProfilerCallback(skip_first=2, wait=1, warmup=1, active=2, repeat=2, module="model", top_k=3)
    model = RecordsInstrumentation()
    trainer = make_trainer(root, [callback], max_steps=14)
    trainer.fit(model, image_loader(samples=32))  # 8 batches per epoch: cycle 1 spans the epoch boundary
    return root, trainer, callback, model


def test_cycles_report_recorded_steps_and_nodes(profiled_run):
    _, _, callback, _ = profiled_run
    assert [c.index for c in callback.cycles] == [0, 1]
    assert [c.steps for c in callback.cycles] == [[4, 5], [8, 9]]
    for cycle in callback.cycles:
        assert not cycle.partial
        assert {n.name for n in cycle.nodes} == SMALLNET_NODES
        head = next(n for n in cycle.nodes if n.name == "head")
        assert (head.op, head.target, head.module_path, head.calls) == ("call_module", "head", "head", 2)
        relu = next(n for n in cycle.nodes if n.name == "relu")
        assert (relu.op, relu.target, relu.module_path) == ("call_function", "torch.nn.functional.relu", "")
        for n in cycle.nodes:
            assert 0 < n.min_ms <= n.median_ms <= n.max_ms and n.min_ms <= n.mean_ms <= n.max_ms
        assert sum(n.pct for n in cycle.nodes) == pytest.approx(100.0)
        costs = [n.total_ms + n.bwd_total_ms for n in cycle.nodes]
        assert costs == sorted(costs, reverse=True)  # slowest forward + backward first
        markdown = cycle.to_markdown()
        assert "| layer | op | fwd ms/call | bwd ms/call | fwd+bwd ms/step | % of fwd+bwd | calls/step |" in markdown
        assert all(f"`{name}`" in markdown for name in SMALLNET_NODES)


def test_module_runs_its_own_forward_outside_traced_steps(profiled_run):
    _, _, _, model = profiled_run
    assert model.instrumented_steps == [3, 4, 5, 7, 8, 9]  # warm-up and recorded steps only
    assert own_forward(model.model) and type(model.model) is model.model_class


def test_cycle_directories_hold_one_trace_and_the_csv(profiled_run):
    root, _, callback, _ = profiled_run
    fxprof = root / "logs" / "version_0" / "fxprof"
    assert sorted(p.name for p in fxprof.iterdir()) == ["cycle_0000", "cycle_0001", "fxprof_cycles.jsonl", "fxprof_job.json"]  # and the run's own files
    assert (fxprof / "cycle_0001" / "trend.png").read_bytes().startswith(b"\x89PNG")  # the last cycle's, at the end
    for cycle in callback.cycles:
        assert cycle.directory == fxprof / f"cycle_{cycle.index:04d}"
        assert sorted(p.name for p in cycle.directory.iterdir() if not TRACE_NAME.match(p.name) and p.name != "trend.png") == [
            "cycle.jsonl", "fx_modules.csv", "fx_nodes.csv", "fx_step.csv", "module_tree.png", "slowest_layers.png"]
        # The rest of the step beside the node rows: its phases and what no node row owns, ms per step.
        step = {(r["kind"], r["name"], r["side"]): float(r["ms_per_step"])
                for r in csv.DictReader((cycle.directory / "fx_step.csv").read_text().splitlines())}
        assert {("phase", p, "") for p in ("data", "training_step", "backward", "optimizer")} <= set(step)
        assert ("unowned", UNOWNED_FORWARD, "forward") in step and all(ms >= 0 for ms in step.values())
        assert step[("phase", "backward", "")] == pytest.approx(cycle.phases["backward"], abs=1e-6)
        summary = json.loads((cycle.directory / "cycle.jsonl").read_text())
        assert (summary["index"], summary["steps"], summary["trace_files"]) == (cycle.index, cycle.steps,
                                                                                [cycle.trace_paths[0].name])
        assert [p.parent for p in cycle.trace_paths] == [cycle.directory]
        assert TRACE_NAME.match(cycle.trace_paths[0].name)
        trace = json.loads(gzip.decompress(cycle.trace_paths[0].read_bytes()))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {f"ProfilerStep#{s}" for s in cycle.steps} <= names  # steps numbered as in training
        assert SMALLNET_NODES <= names  # every FX node is a record_function range
        assert "Framework" not in trace  # the plugin's Lightning mode would hide python events

        with open(cycle.directory / "fx_nodes.csv") as f:
            rows = list(csv.DictReader(f))
        assert {r["name"] for r in rows} == SMALLNET_NODES
        assert {"name", "op", "target", "module_path", "calls", "mean_ms", "median_ms", "min_ms", "max_ms", "pct"} <= set(rows[0])
        assert rows[0]["name"] == cycle.nodes[0].name
        assert float(rows[0]["mean_ms"]) == pytest.approx(cycle.nodes[0].mean_ms, abs=1e-6)


def test_scalars_and_text_reach_tensorboard(profiled_run):
    root, _, callback, _ = profiled_run
    events = read_events(root / "logs" / "version_0")
    tags = set(events.Tags()["scalars"])
    assert scalar_steps(events, "fxprof/forward_ms_per_step") == [5, 9]
    per_node = {t for t in tags if t.startswith("fxprof_nodes/") and t.endswith("/forward_ms_per_call")}
    tracked = [n.name for n in callback.cycles[0].nodes[:3]]  # the first cycle's top_k, tracked for the whole run
    assert per_node == {f"fxprof_nodes/{name}/forward_ms_per_call" for name in tracked}
    for cycle in callback.cycles:
        assert cycle.tracked == tracked
        by_name = {n.name: n for n in cycle.nodes}
        logged = {t: v for t in per_node for e in events.Scalars(t) if e.step == cycle.steps[-1] for v in [e.value]}
        assert logged == pytest.approx({f"fxprof_nodes/{name}/forward_ms_per_call": by_name[name].mean_ms
                                        for name in tracked})  # a point in every cycle: no gaps
        total = next(e.value for e in events.Scalars("fxprof/forward_ms_per_step") if e.step == cycle.steps[-1])
        assert total == pytest.approx(sum(n.total_ms for n in cycle.nodes) / 2, rel=1e-5)

    texts = events.Tensors("fxprof/layers/text_summary")  # add_text appends /text_summary
    assert [t.step for t in texts] == [5, 9]
    for text, cycle in zip(texts, callback.cycles, strict=True):
        markdown = tensor_util.make_ndarray(text.tensor_proto).item().decode()
        assert markdown == cycle.to_markdown(3)
        assert markdown.count("\n| `") == 3  # top_k rows


def test_summary_printed_at_end_of_fit(tmp_path, capsys):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=2, repeat=1, module="model")
    make_trainer(tmp_path, [callback], max_steps=4).fit(LitClassifier(), image_loader())
    out = capsys.readouterr().out
    assert "FXProfilerCallback: 1 cycle(s) recorded" in out
    assert "Slowest nodes of cycle 0 (steps 1-2), mean ms per call (share of all nodes):" in out
    assert re.search(r"  conv \(Conv2d\) +forward +\d+\.\d{3} \( *\d+\.\d %\)  backward +\d+\.\d{3} \( *\d+\.\d %\)", out)
    assert f"tensorboard --logdir {tmp_path / 'logs'}" in out
    # the commands run as printed, from where the user is, with or without their venv activated (issue 40 item 6)
    look = out.split("Look first: ", 1)[1].split("  (", 1)[0]
    ran = subprocess.run(look, shell=True, capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0 and Path(look.split(" report ", 1)[1].split(" --html")[0], "fxprof_report.html").is_file(), \
        (look, ran.stdout, ran.stderr)
    tensorboard = out.split("TensorBoard: ", 1)[1].split(" --logdir", 1)[0]
    assert shutil.which(tensorboard) is not None, tensorboard


def _train(root, callbacks, steps=10, model=None):
    pl.seed_everything(7, verbose=False)
    model = model or LitClassifier(SmallNet())
    make_trainer(root, callbacks, max_steps=steps).fit(model, image_loader())
    return model


def test_training_is_bitwise_unchanged(tmp_path):
    plain = _train(tmp_path / "plain", [])
    callback = FXProfilerCallback(skip_first=1, wait=1, warmup=1, active=2, module="model")
    profiled = _train(tmp_path / "profiled", [callback])
    assert [len(c.nodes) for c in callback.cycles] == [6, 6]  # steps 3-4 and 7-8 timed, with dropout and batch norm
    reference = plain.state_dict()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in profiled.state_dict().items())


def test_torch_profiler_only_and_fx_only(tmp_path):
    traces_only = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, fx_timing=False)
    _train(tmp_path / "a", [traces_only], steps=3)
    (cycle,) = traces_only.cycles
    assert cycle.nodes == [] and len(cycle.trace_paths) == 1
    assert not (cycle.directory / "fx_nodes.csv").exists()

    fx_only = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, torch_profiler=False, module="model")
    _train(tmp_path / "b", [fx_only], steps=3)
    (cycle,) = fx_only.cycles
    assert cycle.trace_paths == [] and {n.name for n in cycle.nodes} == SMALLNET_NODES
    assert sorted(p.name for p in cycle.directory.iterdir()) == [
        "cycle.jsonl", "fx_modules.csv", "fx_nodes.csv", "fx_step.csv", "module_tree.png", "slowest_layers.png"]  # one cycle: no trend


def test_node_ranges_can_be_left_out_of_the_trace(tmp_path):
    names = {}
    for ranges in (True, False):
        profiler = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, module="model", node_ranges=ranges)
        _train(tmp_path / str(ranges), [profiler], steps=3)
        (cycle,) = profiler.cycles
        assert {n.name for n in cycle.nodes} == SMALLNET_NODES and all(n.bwd_calls for n in cycle.nodes)
        events = json.loads(gzip.decompress(cycle.trace_paths[0].read_bytes()))["traceEvents"]
        names[ranges] = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert SMALLNET_NODES <= names[True] and not SMALLNET_NODES & names[False]


def test_a_forward_the_training_step_does_not_call_gives_way_to_the_children_it_calls(tmp_path):
    """LitClassifier has a forward, and its training_step calls ``self.model`` itself (as Lightning's autoencoder
    example calls its encoder and decoder): without module=, the forward sits the warm-up step out, and the children
    are timed from the next step (before: a warning, and no row). The first recorded step holds their capture: it is
    replaced by the next one, and said so."""
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=2, repeat=1, pictures=False)
    _train(tmp_path, [callback], steps=5)
    (cycle,) = callback.cycles
    assert {n.name for n in cycle.nodes} == {f"model_{name}" for name in SMALLNET_NODES}
    assert "LitClassifier.forward did not run in the warm-up step" in cycle.capture.describe()
    assert cycle.steps == [2, 3] and cycle.dropped_steps.keys() == {1}


def test_cycles_with_no_node_say_so_in_the_end_summary(tmp_path, capsys):
    """Cycles back to back with no warm-up step: the forward the training step does not call has no step to sit out
    before the recorded ones, so the first cycle times nothing and says so (a warning, and the end summary); the
    next one times the children (its first step holds their capture, and is replaced)."""
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=0, active=2, repeat=2, pictures=False)
    with pytest.warns(UserWarning, match=r"LitClassifier.forward did not run in the recorded steps \[0, 1\]"):
        _train(tmp_path, [callback], steps=6)
    assert [len(c.nodes) for c in callback.cycles] == [0, len(SMALLNET_NODES)]
    assert callback.cycles[1].steps == [3, 4] and callback.cycles[1].dropped_steps.keys() == {2}
    summary = capsys.readouterr().out
    assert ("No node timed in cycle(s) 0: LitClassifier.forward did not run in the recorded steps [0, 1], so no node "
            "was timed. If the training step calls a submodule instead, profile that submodule (the Lightning callback: "
            "module='model'; its child modules are: model). From the next cycle on, the children it calls are timed "
            "instead.") in summary, summary


def test_a_target_forward_that_never_runs_is_reported(tmp_path):
    """A plain loop that profiles a module and calls its layers itself: a warning names the children (the callback
    takes them itself: the test above)."""
    model = SmallNet()
    with pytest.warns(UserWarning, match=r"SmallNet.forward did not run in the recorded steps \[1\].*its child modules "
                                         r"are: conv, bn, drop, head"), \
            Profiler(model, wait=0, warmup=1, active=1, repeat=1, dirpath=tmp_path, torch_profiler=False, pictures=False,
                     sinks=[]) as prof:
        for _ in range(3):
            model.head(torch.randn(4, 16)).sum().backward()
            prof.step()
    assert [c.nodes for c in prof.cycles] == [[]]


class NoForward(LitClassifier):
    """As in the README's quickstart: no forward of its own, ``training_step`` calls ``self.model``."""

    forward = pl.LightningModule.forward


@notices("the Trainer has no logger")
def test_without_module_the_one_child_training_step_calls_is_timed(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, pictures=False)
    make_trainer(tmp_path, [callback], max_steps=3, logger=False).fit(NoForward(), image_loader())
    assert {n.name for n in callback.cycles[0].nodes} == SMALLNET_NODES


class TwoModels(NoForward):
    """Two models, both called in every training step (as a GAN's generator and discriminator are)."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.critic_calls = 0
        self.critic.register_forward_hook(self.count)

    def count(self, module, args, output):
        self.critic_calls += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return torch.nn.functional.cross_entropy(logits, y) + 0.1 * self.critic(logits).mean()


@notices("the Trainer has no logger")
def test_without_module_each_child_the_training_step_calls_is_timed(tmp_path):
    """No forward of its own and several children: each child the step calls is captured by Dynamo on its own, its
    rows named under it as a capture of the whole would name them (before: module hooks, module by module), and
    training is bitwise what it is without the profiler, the user's hook run once a step."""
    runs = []
    for profiled in (False, True):
        torch.manual_seed(0)
        lit = TwoModels()
        callbacks = [FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=2, repeat=1, pictures=False)] if profiled else []
        make_trainer(tmp_path / str(profiled), callbacks, max_steps=4, logger=False).fit(lit, image_loader())
        runs.append((lit, callbacks))
    (plain, _), (lit, (callback,)) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), lit.state_dict().values(), strict=True))
    assert lit.critic_calls == plain.critic_calls == 4  # the user's hook: once a step
    (cycle,) = callback.cycles
    assert cycle.capture.method == "dynamo" and "each child its steps call (model, critic)" in cycle.capture.describe()
    called = {n.name: n.calls for n in cycle.nodes if n.calls}
    assert {"critic_0", "critic_1", "critic_2", *(f"model_{name}" for name in SMALLNET_NODES)} == set(called), called
    assert all(calls == len(cycle.steps) for calls in called.values()), called
    layers = {n.name: n.layer for n in cycle.nodes}
    assert layers["critic_0"] == "critic.0 (Linear)" and layers["model_conv"] == "model.conv (Conv2d)", layers
    assert all(n.bwd_calls == n.calls for n in cycle.nodes if n.name in called)
    tree = {m.path for m in cycle.modules}
    assert {"", "model", "model.conv", "critic", "critic.0"} <= tree, tree

class GAN(pl.LightningModule):
    """Lightning's GAN example, shrunk: a generator with BatchNorm, a discriminator, two Adam optimizers stepped by
    hand (``toggle_optimizer`` flips the other model's ``requires_grad``), the discriminator called three times a step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.LeakyReLU(0.2), nn.Linear(64, 32), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1), nn.Sigmoid())

    def training_step(self, batch, batch_idx):
        (x,) = batch
        g_opt, d_opt = self.optimizers()
        z, real, fake = torch.randn(x.shape[0], 16), torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        self.toggle_optimizer(g_opt)
        g_loss = nn.functional.binary_cross_entropy(self.discriminator(self.generator(z)), real)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = (nn.functional.binary_cross_entropy(self.discriminator(x), real)
                  + nn.functional.binary_cross_entropy(self.discriminator(self.generator(z).detach()), fake)) / 2
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)))


@notices("the Trainer has no logger")
def test_a_gan_optimized_by_hand_has_rows_for_both_models_and_trains_as_without_us(tmp_path):
    """The callback as a GAN's user adds it (no module=): both models' layers have rows, each call of the
    discriminator counted, and the weights, BatchNorm statistics and optimizer steps are bitwise those of training
    without the profiler. On torch 2.14+ each model is captured by Dynamo on its own; below, where Dynamo does not guard
    on the requires_grad that toggle_optimizer flips, by module hooks (and the capture record says why)."""
    runs = []
    for profiled in (False, True):
        torch.manual_seed(0)
        gan = GAN()
        callbacks = [FXProfilerCallback(wait=1, warmup=1, active=3, repeat=1, pictures=False)] if profiled else []
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 32)), batch_size=16)
        make_trainer(tmp_path / str(profiled), callbacks, max_steps=14, logger=False).fit(gan, data)
        runs.append((gan, callbacks))
    (plain, _), (gan, (callback,)) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), gan.state_dict().values(), strict=True))
    (cycle,) = callback.cycles
    if torch_api.PARAMETER_FLAGS_GUARDED:
        assert cycle.capture.method == "dynamo" and "(generator, discriminator)" in cycle.capture.describe()
        calls = {n.layer: n.calls // len(cycle.steps) for n in cycle.nodes}
        assert calls["generator.1 (BatchNorm1d)"] == 2 and calls["discriminator.0 (Linear)"] == 3, calls
        # the trace has a range per call of each row, forward and backward (the children's, in the order they ran)
        events = []
        for path in cycle.trace_paths:
            with gzip.open(path) as trace:
                events += [e.get("name") for e in json.load(trace)["traceEvents"]]
        for n in cycle.nodes:
            assert (events.count(n.name), events.count(f"{n.name} backward")) == (n.calls, n.bwd_calls), n.name
    else:
        assert cycle.capture.method == "module_hooks" and "optimizes by hand" in cycle.capture.describe()
    layers = {n.layer or n.name for n in cycle.nodes if n.calls}
    assert any(name.startswith("generator.") for name in layers), layers
    assert any(name.startswith("discriminator.") for name in layers), layers



def test_no_logger_warns_and_still_writes_files(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, module="model")
    with pytest.warns(UserWarning, match="no logger"):
        make_trainer(tmp_path, [callback], max_steps=3, logger=False).fit(LitClassifier(), image_loader())
    assert (tmp_path / "fxprof" / "cycle_0000" / "fx_nodes.csv").exists()
    assert len(callback.cycles[0].trace_paths) == 1


def test_where_dynamo_cannot_be_used_the_model_is_timed_by_module_hooks(tmp_path, monkeypatch):
    from fxprof_lightning.capture import timers

    monkeypatch.setattr(timers, "missing_for_dynamo", lambda: "torch._dynamo.optimize has no isolate_recompiles")
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, module="model")
    with pytest.warns(UserWarning, match=r"lacks what the Dynamo capture needs .* SmallNet are timed by module hooks"):
        _train(tmp_path, [callback], steps=4, model=LitClassifier(SmallNet()))
    (cycle,) = callback.cycles
    assert cycle.capture.method == "module_hooks" and len(cycle.trace_paths) == 1
    assert {n.name for n in cycle.nodes} == {"(root)", "conv", "bn", "drop", "head"}
    assert "fxprof/forward_ms_per_step" in read_events(tmp_path / "logs" / "version_0").Tags()["scalars"]


def test_capture_fx_is_refused_with_what_to_do_instead():
    with pytest.raises(ValueError, match=r"torch.fx capture was removed.*Dynamo capture .* works on torch 2\.6 and newer"
                                         r".*Drop the capture argument"):
        FXProfilerCallback(capture="fx")
    assert FXProfilerCallback(capture="dynamo").profiler.settings.capture == "dynamo"  # still accepted


def test_a_failing_profiler_never_ends_training(tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, dirpath=blocker)
    with pytest.warns(UserWarning, match="FXProfilerCallback failed while starting a profiled step.*training goes on"):
        model = _train(tmp_path, [callback], steps=6)
    assert callback.cycles == []
    assert own_forward(model.model)


def test_missing_module_path_raises_at_setup_listing_children(tmp_path):
    with pytest.raises(ValueError, match=r"LitClassifier has no submodule 'backbone'. Its child modules are: model"):
        _train(tmp_path, [FXProfilerCallback(module="backbone")])
    with pytest.raises(ValueError, match=r"model has no submodule 'body'. Its child modules are: conv, bn, drop, head"):
        _train(tmp_path, [FXProfilerCallback(module="model.body")])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"profiler_kwargs": {"schedule": None}}, "may not set schedule"),
        ({"profiler_kwargs": {"on_trace_ready": print}}, "may not set on_trace_ready"),
        ({"profiler_kwargs": {"record_shape": True}}, r"unknown torch.profiler.profile arguments \['record_shape'\]"),
        ({"profiler_kwargs": ["with_stack"]}, "profiler_kwargs must be a dict"),
        ({"torch_profiler": False, "fx_timing": False}, "turn at least one on"),
        ({"top_k": 0}, "top_k must be an int >= 1"),
        ({"module": ""}, "module must be a dotted attribute path"),
        ({"keep_cycles": 0}, r"keep_cycles must be an int >= 1 or None"),
        ({"sinks": [print]}, r"sinks: <built-in function print> is not a sink: a sink has write_cycle"),
        ({"sinks": [CsvSink]}, r"sinks: CsvSink is a class: pass an instance, CsvSink\(...\)"),
        ({"sinks": CsvSink()}, r"sinks must be a list of sinks, got .*: pass sinks=\[CsvSink\(...\)\]"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FXProfilerCallback(**kwargs)


class JsonLinesSink:
    """A sink of the user's own, written here with no package file changed: one JSON line per cycle."""

    def __init__(self, path) -> None:
        self.path, self.closed = path, None

    def write_cycle(self, report, display) -> None:
        line = {"cycle": report.label, "steps": report.steps, "forward_ms": report.forward_ms_per_step,
                "slowest": report.nodes[0].layer, "by": display.name}
        with open(self.path, "a") as file:
            file.write(json.dumps(line) + "\n")

    def close(self, run) -> None:
        self.closed = len(run.cycles)


def test_a_sink_of_the_users_own_gets_every_cycle_after_the_callbacks_own(tmp_path):
    sink = JsonLinesSink(tmp_path / "cycles.jsonl")
    callback = FXProfilerCallback(skip_first=1, wait=1, warmup=1, active=2, module="model", sinks=[sink])
    _train(tmp_path, [callback])
    lines = [json.loads(line) for line in (tmp_path / "cycles.jsonl").read_text().splitlines()]
    assert [(line["cycle"], line["steps"]) for line in lines] == [(c.label, c.steps) for c in callback.cycles]
    assert all(line["forward_ms"] > 0 and line["by"] == "FXProfilerCallback" for line in lines)
    assert lines[0]["slowest"] == callback.cycles[0].nodes[0].layer and sink.closed == len(callback.cycles) == 2
    assert (callback.cycles[0].directory / "fx_nodes.csv").exists()  # the callback's own sinks still ran


class BuiltInConfigureModel(LitClassifier):
    """Builds its network in configure_model (and replaces a placeholder in setup), as large models do."""

    def __init__(self):
        super().__init__(nn.Identity())

    def setup(self, stage):
        self.model = nn.Identity()  # replaced again below

    def configure_model(self):
        self.model = SmallNet()


def test_the_module_built_in_setup_or_configure_model_is_the_one_timed(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, module="model")
    make_trainer(tmp_path, [callback], max_steps=3).fit(BuiltInConfigureModel(), image_loader())
    assert {n.name for n in callback.cycles[0].nodes} == SMALLNET_NODES


class HookSpy(pl.Callback):
    """Counts, per step, which of the profiler callback's hooks were its class's own (not the idle stand-ins)."""

    def __init__(self, profiler: FXProfilerCallback) -> None:
        self.profiler, self.own = profiler, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.own.append("on_train_batch_start" not in vars(self.profiler))


@notices("the Trainer has no logger")
def test_idle_steps_skip_the_hooks_and_count_every_step(tmp_path):
    """Between cycles the per-step hooks do nothing (on_train_batch_end only counts); the cycles,
    their steps, the batch size and a checkpoint's step count are those of a run whose hooks all ran."""
    callback = FXProfilerCallback(skip_first=2, wait=4, warmup=1, active=2, repeat=3, pictures=False, module="model")
    spy = HookSpy(callback)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=9, save_top_k=-1)
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, callbacks=[spy, callback, checkpoint], max_steps=30,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(LitClassifier(), image_loader(samples=4 * 30, batch_size=4))
    assert [c.steps for c in callback.cycles] == [[7, 8], [14, 15], [21, 22]]
    assert all(c.batch_size == 4 and c.nodes for c in callback.cycles)
    traced = {6, 7, 8, 13, 14, 15, 20, 21, 22}
    # Idle (stand-ins) in the steps after a cycle's last step but the one before the next traced step's start.
    own = [step for step, is_own in enumerate(spy.own) if is_own]
    assert traced <= set(own) and len(own) < 30 - 10, own
    assert callback.profiler.step_num == 30 and "on_train_batch_end" not in vars(callback)  # woken at the end
    for path in sorted((tmp_path / "ckpt").glob("*.ckpt")):
        saved = torch.load(path, weights_only=False)["callbacks"]
        (state,) = [v for k, v in saved.items() if k.startswith("FXProfilerCallback")]
        assert state["step"] == int(path.stem.split("step=")[1]), path.name  # the steps that ended when it was saved


@notices("the Trainer has no logger")
def test_a_cycle_without_warm_up_after_idle_steps_has_its_phases(tmp_path):
    """The step before a recorded step runs the callback's own on_train_batch_end, which starts the phase clock."""
    callback = FXProfilerCallback(wait=5, warmup=0, active=1, repeat=2, pictures=False, module="model")
    make_trainer(tmp_path, [callback], max_steps=14, logger=False).fit(LitClassifier(), image_loader(samples=4 * 14))
    # torch.profiler.schedule's recorded steps: the capture runs in step 4, the idle step before the cycle.
    assert [c.steps for c in callback.cycles] == [[5], [11]]
    assert not any(c.dropped_steps for c in callback.cycles)
    assert all({"backward", "data"} <= set(c.phases) for c in callback.cycles), [c.phases for c in callback.cycles]


class StartsAProfiler(pl.Callback):
    """The user's own torch.profiler, started in the cycle's warm-up step and left running."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.start()

    def on_train_end(self, trainer, pl_module):
        self.profiler.stop()


@notices("the Trainer has no logger")
def test_a_profiler_started_in_warm_up_leaves_backward_timed_by_hooks(tmp_path):
    callback = FXProfilerCallback(wait=1, warmup=1, active=2, repeat=1, torch_profiler=False, pictures=False,
                                  module="model")
    with pytest.warns(UserWarning, match="another profiler is running"):
        make_trainer(tmp_path, [StartsAProfiler(), callback], max_steps=4, logger=False).fit(
            LitClassifier(), image_loader(samples=16))
    (cycle,) = callback.cycles
    assert all(n.bwd_calls == 2 for n in cycle.nodes if n.name in ("conv", "head")), [(n.name, n.bwd_calls) for n in cycle.nodes]


@notices("the Trainer has no logger")
def test_the_measured_backward_is_accounted_for(tmp_path):
    """The header says where the measured backward went: the nodes, autograd nodes no node call created (here the
    loss, outside the profiled ``model``), and the rest; the parts are measured, not made to add up."""
    callback = FXProfilerCallback(wait=1, warmup=1, active=3, repeat=1, pictures=False, module="model")
    make_trainer(tmp_path, [callback], max_steps=5, logger=False).fit(LitClassifier(), image_loader(samples=20))
    (cycle,) = callback.cycles
    assert 0 < cycle.backward_outside_ms < cycle.backward_wall_ms
    assert cycle.backward_ms_per_step + cycle.backward_outside_ms <= 1.05 * cycle.backward_wall_ms
    header = cycle.to_markdown().splitlines()[0]
    assert "autograd nodes no node call created" in header and "the rest (the autograd engine" in header

    # Rows for the time no row owns: with the node rows they make the measured forward and backward.
    unowned = cycle.unowned()
    assert list(unowned) == [UNOWNED_FORWARD, UNOWNED_OUTSIDE, UNOWNED_ENGINE]
    assert cycle.forward_ms_per_step < cycle.forward_wall_ms < 2 * cycle.forward_ms_per_step  # measured, whole calls
    assert cycle.forward_ms_per_step + unowned[UNOWNED_FORWARD][0] == pytest.approx(cycle.forward_wall_ms)
    assert unowned[UNOWNED_OUTSIDE][1] == cycle.backward_outside_ms
    if cycle.backward_ms_per_step + cycle.backward_outside_ms <= cycle.backward_wall_ms:
        assert cycle.backward_ms_per_step + sum(b for _, b in unowned.values() if b) == pytest.approx(cycle.backward_wall_ms)
    markdown = cycle.to_markdown()
    assert f"| {UNOWNED_ENGINE} |  | {unowned[UNOWNED_ENGINE][1]:.3f} |" in markdown
    assert load_cycle(cycle.directory).forward_wall_ms == cycle.forward_wall_ms  # cycle.jsonl keeps it


@notices("the Trainer has no logger")
def test_cycle_lines_start_on_a_line_of_their_own_under_a_progress_bar(tmp_path):
    """Lightning's tqdm progress bar (the default where rich is not installed), on the terminal that stdout shares: the
    line goes through the bar's ``print``, which clears the bar first, where a plain print landed after
    ``it/s, v_num=0]`` on the bar's line. (Rich's bar takes plain prints above itself.)"""
    terminal = io.StringIO()
    callback = FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=1, repeat=2, module="model", pictures=False)
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
        pl.Trainer(default_root_dir=str(tmp_path), callbacks=[TQDMProgressBar(), callback], max_steps=8, logger=False, accelerator="cpu",
                   enable_model_summary=False, enable_checkpointing=False).fit(LitClassifier(), image_loader())
    text = terminal.getvalue()
    starts = [m.start() for m in re.finditer("FXProfilerCallback: cycle", text)]
    assert len(starts) == 2 and "it/s" in text  # the bar was drawn
    assert all(text[i - 1] in "\r\n" for i in starts), [text[i - 40:i + 30] for i in starts]
