"""``Profiler`` in plain PyTorch loops: schedule, files, sinks, bitwise training, resume, validation, bad input."""

from __future__ import annotations

import copy
import csv
import dataclasses
import gzip
import inspect
import json
import re
import statistics
import time
from pathlib import Path

import pytest
import torch
from helpers import SmallNet, image_loader, notices, own_forward, read_events
from torch.nn import functional as F
from torch.profiler import ProfilerAction
from torch.utils.tensorboard import SummaryWriter

from fxprof_lightning import ConsoleSink, CsvSink, FXProfilerCallback, Profiler, TensorBoardSink, torch_api
from fxprof_lightning.engine.core import display
from fxprof_lightning.engine.loop_phases import LoopClock
from fxprof_lightning.engine.settings import Settings
from fxprof_lightning.report import last_sound


def train(steps: int, profiler: Profiler | None = None, model: torch.nn.Module | None = None, seed: int = 0):
    """``steps`` SGD steps in a plain loop (of ``model``, else the profiled module, else a new SmallNet),
    calling ``profiler.step()`` after each."""
    model = model if model is not None else profiler.module if profiler is not None else SmallNet()
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = iter(image_loader(samples=4 * steps))
    for _ in range(steps):
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if profiler is not None:
            profiler.step()
    return model


def test_a_plain_loop_gets_cycles_files_and_node_times(tmp_path, capsys):
    torch.manual_seed(0)
    model = SmallNet()
    with Profiler(model, wait=1, warmup=1, active=2, repeat=2, dirpath=tmp_path) as prof:
        train(10, prof, model)
    assert [c.steps for c in prof.cycles] == [[2, 3], [6, 7]]
    assert [c.directory.name for c in prof.cycles] == ["cycle_0000", "cycle_0001"]
    for cycle in prof.cycles:
        assert not cycle.partial and cycle.capture.method == "dynamo"
        names = {n.name for n in cycle.nodes}
        assert {"conv", "bn", "relu", "mean", "head"} <= names
        assert all(n.calls == 2 and n.mean_ms > 0 for n in cycle.nodes)
        assert {n.name for n in cycle.nodes if n.bwd_calls} >= {"conv", "head"}
        # No Trainer hook marks backward in a plain loop: it runs from the output's first gradient (loop_phases).
        assert cycle.backward_wall_ms == cycle.phases["backward"] > 0
        (trace,) = cycle.trace_paths
        assert trace.parent == cycle.directory and trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json.gz")
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {f"ProfilerStep#{s}" for s in cycle.steps}  # the trace numbers steps as the loop does
        assert {"conv", "head"} <= {e["name"] for e in events if e.get("cat") == "user_annotation"}
        rows = list(csv.DictReader((cycle.directory / "fx_nodes.csv").read_text().splitlines()))
        assert {r["name"] for r in rows} == names
        assert (cycle.directory / "fx_modules.csv").exists()
    assert own_forward(model)  # the module's own forward is back
    out = capsys.readouterr().out
    # (the summary reads the last sound cycle: cycle 0 where cycle 1 was distorted by other load, seen in a CI run)
    last = last_sound(prof.cycles)
    assert "Profiler: 2 cycle(s) recorded" in out
    assert f"Slowest nodes of cycle {last.index} (steps {last.steps[0]}-{last.steps[-1]}" in out


def test_skip_first_defaults_to_zero_as_in_torch_profiler(tmp_path):
    with Profiler(SmallNet(), wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, sinks=[]) as prof:
        train(4, prof)
    assert [c.steps for c in prof.cycles] == [[1, 2]]  # torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    defaults = {name: p.default for name, p in inspect.signature(Profiler).parameters.items()}
    callback_defaults = {name: p.default for name, p in inspect.signature(FXProfilerCallback).parameters.items()}
    assert (defaults["skip_first"], defaults["repeat"]) == (0, 0)
    shared = set(defaults) & set(callback_defaults)
    assert shared == set(defaults) - {"settings"} and all(defaults[k] == callback_defaults[k] for k in shared - {"module"})


@pytest.mark.parametrize("bound_early", [False, True])
def test_between_cycles_step_is_the_idle_counter_and_the_schedule_stays_torchs(tmp_path, bound_early):
    # Between cycles ``prof.step`` is the idle steps' counter itself (one call a step), its time counted as profiling's;
    # a ``step`` bound before a stretch began does the same through the class's method.
    torch.manual_seed(0)
    model = SmallNet()
    prof = Profiler(model, wait=4, warmup=1, active=2, repeat=3, skip_first=3, dirpath=tmp_path, sinks=[])
    step = prof.step
    with prof:
        for i in range(26):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
            if i == 12:
                assert "step" in vars(prof) and prof.idle.active  # step 12: the second cycle's wait
            step() if bound_early else prof.step()
    schedule = torch.profiler.schedule(skip_first=3, wait=4, warmup=1, active=2, repeat=3)
    recorded = [s for s in range(26) if schedule(s) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)]
    assert [s for c in prof.cycles for s in c.steps] == recorded
    assert "step" not in vars(prof)  # the stand-in gone with the run
    assert 0 < prof.follow.idle_ns < 26 * 10**6  # (profiling's own time: far under a millisecond a step)


def _tag_safe_roots(manager):
    """The guard managers of a Dynamo guard tree under which a whole subtree is skipped while dict tags match."""
    children = [c for c in manager.get_child_managers() if c is not None]
    if hasattr(manager, "get_key_value_managers"):
        children += [c for pair in manager.get_key_value_managers().values() for c in pair if c is not None]
    return [c for c in children if c.is_tag_safe_root()] + [r for c in children for r in _tag_safe_roots(c)]


@pytest.mark.skipif(not hasattr(torch._C._dynamo.guards.GuardManager, "is_tag_safe_root"),
                    reason="this torch's guards have no subtree skipped on unchanged dict tags (2.6)")
def test_recorded_steps_leave_dynamos_guards_their_shortcut_and_copies_their_own_forward(tmp_path):
    # Timing a module's steps writes none of its dicts, so Dynamo's guards keep skipping its unchanged subtree (a
    # write turns that off for good: every later check the full one). A copy made in a recorded step runs its own forward.
    torch.manual_seed(0)
    model = SmallNet()
    copies = []
    with Profiler(model, wait=1, warmup=1, active=2, repeat=3, dirpath=tmp_path, sinks=[]) as prof:
        for step in range(12):
            out = model(torch.randn(4, 3, 8, 8))
            if step == 7:  # a recorded step
                copies.append(copy.deepcopy(model))
            out.sum().backward()
            prof.step()
    assert [c.steps for c in prof.cycles] == [[2, 3], [6, 7], [10, 11]]
    assert all(n.calls == 2 for c in prof.cycles for n in c.nodes)
    timer, _ = prof.timers.chosen[True]
    entries = torch_api.cache_entries(timer._entry.code, timer._entry.region)
    roots = [r for entry in entries for r in _tag_safe_roots(entry.guard_manager.root)]
    assert roots and not any(r.is_recursive_dict_tag_matching_disabled() for r in roots)
    (copied,) = copies
    assert type(copied) is SmallNet and own_forward(copied) and own_forward(model)
    reference = SmallNet()
    reference.load_state_dict(copied.state_dict())  # (the copy's own weights, from step 7: the model trained on)
    x = torch.randn(4, 3, 8, 8)
    copied.eval(), reference.eval()
    assert torch.equal(copied(x), reference(x))


def test_training_is_bitwise_unchanged(tmp_path):
    torch.manual_seed(0)
    plain = train(12, model=SmallNet(), seed=1)
    torch.manual_seed(0)
    with Profiler(SmallNet(), wait=1, warmup=1, active=2, dirpath=tmp_path, sinks=[]) as prof:
        profiled = train(12, prof, seed=1)
    assert len(prof.cycles) == 3
    for (name, a), b in zip(plain.state_dict().items(), profiled.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_through_state_dict_continues_the_schedule_with_plain_names(tmp_path):
    schedule = {"wait": 1, "warmup": 1, "active": 2}  # recorded: 2-3, 6-7, 10-11
    first = Profiler(SmallNet(), **schedule, dirpath=tmp_path, sinks=[])
    with first:
        train(7, first)  # stops inside cycle 1, after step 6
    state = first.state_dict()
    assert state["step"] == 7

    resumed = Profiler(SmallNet(), **schedule, dirpath=tmp_path, sinks=[])
    resumed.load_state_dict(state)
    with resumed:
        train(5, resumed)  # steps 7-11
    assert [(c.index, c.steps, c.partial) for c in first.cycles] == [(0, [2, 3], False), (1, [6], True)]
    # The resumed process captures at its first call, in recorded step 7: dropped, idle step 8 recorded in its place.
    assert [(c.index, c.steps, c.partial) for c in resumed.cycles] == [(1, [8], True), (2, [10, 11], False)]
    assert resumed.cycles[0].dropped_steps == {7: "captured (first call)"}
    # The cut cycle's name was taken by the first run: only that one gets a suffix.
    assert [c.directory.name for c in resumed.cycles] == ["cycle_0001-r1", "cycle_0002"]


@notices("profiler is still running")
def test_validation_steps_are_their_own_stage_and_not_training(tmp_path):
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with Profiler(model, wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, profile_validation=True, sinks=[]) as prof:
        for x, y in image_loader(samples=12):
            F.cross_entropy(model(x), y).backward()  # step 0 (warm-up) runs, then validation inside step 1
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
            if prof.step_num == 1:
                model.eval()
                with torch.no_grad(), prof.validation():
                    for vx, _ in image_loader(samples=12, seed=1):
                        model(vx)
                        prof.step()
                model.train()
    assert [c.steps for c in prof.cycles] == [[1, 2]]
    assert all(n.calls == 2 for n in prof.cycles[0].nodes)  # validation calls were not counted as training
    (val,) = prof.val_cycles
    assert val.steps == [1, 2] and val.directory.name == "val_cycle_0000" and val.stage == "val"
    assert {n.name for n in val.nodes} >= {"conv", "head"} and all(n.bwd_calls == 0 for n in val.nodes)


def test_validation_without_profile_validation_is_only_paused_training(tmp_path):
    model = SmallNet()
    with Profiler(model, wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, sinks=[]) as prof:
        model(torch.randn(4, 3, 8, 8)).sum().backward()  # the warm-up step: captured
        prof.step()
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        with torch.no_grad(), prof.validation():
            model(torch.randn(4, 3, 8, 8))
            prof.step()
        prof.step()
    assert [c.steps for c in prof.cycles] == [[1]] and prof.val_cycles == []
    assert all(n.calls == 1 for n in prof.cycles[0].nodes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cycle_0000", "fxprof_cycles.jsonl", "fxprof_job.json"]


def test_a_call_in_the_other_mode_runs_the_modules_own_forward(tmp_path):
    torch.manual_seed(0)
    model = SmallNet()  # dropout and batch norm: the graph traced in training mode must not run in eval mode
    x = torch.randn(4, 3, 8, 8)
    with Profiler(model, wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, sinks=[]) as prof:
        model(x).sum().backward()  # the warm-up step: captured
        prof.step()
        model(x).sum().backward()
        model.eval()
        evaluated = model(x)  # inside a recorded training step, without validation()
        expected = type(model).forward(model, x)
        model.train()
        prof.step()
    assert torch.equal(evaluated, expected)
    assert prof.cycles[0].steps == [1]  # stop() counts the step in progress: the module ran in it
    assert all(n.calls == 1 for n in prof.cycles[0].nodes)


def test_sinks_write_what_the_callback_writes(tmp_path):
    writer = SummaryWriter(str(tmp_path / "tb"))
    with Profiler(SmallNet(), wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path / "out", top_k=3,
                  sinks=[CsvSink(), TensorBoardSink(writer), ConsoleSink(every_cycle=True)]) as prof:
        train(4, prof)
    writer.close()
    events = read_events(tmp_path / "tb")
    scalars = set(events.Tags()["scalars"])
    assert {"fxprof/forward_ms_per_step", "fxprof/backward_ms_per_step", "fxprof/regressions"} <= scalars
    assert len([t for t in scalars if t.endswith("/forward_ms_per_call")]) == 3  # top_k nodes
    assert [e.step for e in events.Scalars("fxprof/forward_ms_per_step")] == [2]
    assert {"fxprof/layers/text_summary", "fxprof/modules/text_summary"} <= set(events.Tags()["tensors"])
    assert all((c.directory / "fx_nodes.csv").exists() for c in prof.cycles)


def test_no_sinks_write_no_csv_but_keep_the_traces(tmp_path):
    with Profiler(SmallNet(), wait=0, warmup=0, active=1, repeat=1, dirpath=tmp_path, sinks=[]) as prof:
        train(2, prof)
    (cycle,) = prof.cycles
    assert [p.name for p in cycle.directory.iterdir()] == [cycle.trace_paths[0].name]


def test_ranks_not_listed_write_no_trace_but_time_nodes(tmp_path):
    with Profiler(SmallNet(), wait=0, warmup=1, active=2, repeat=1, dirpath=tmp_path, ranks=[1], sinks=[]) as prof:
        train(4, prof)
    (cycle,) = prof.cycles
    assert cycle.trace_paths == [] and cycle.nodes and {n.name for n in cycle.nodes if n.bwd_calls} >= {"conv", "head"}


def test_an_exception_in_the_loop_writes_the_cut_cycle_and_leaves_no_wrapper(tmp_path):
    model = SmallNet()
    with pytest.raises(KeyError), Profiler(model, wait=0, warmup=1, active=3, repeat=1, dirpath=tmp_path, sinks=[]) as prof:
        train(3, prof, model)
        raise KeyError("the user's own error")
    assert own_forward(model) and not torch.autograd.profiler._is_profiler_enabled
    (cycle,) = prof.cycles
    assert cycle.partial and cycle.steps == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wait": -1}, "wait must be >= 0"),
        ({"active": 0}, "active must be >= 1"),
        ({"ranks": "0"}, "ranks must be a list of global ranks"),
        ({"ranks": [0, -1]}, "ranks must be a list of global ranks"),
        ({"top_k": 0}, "top_k must be an int >= 1"),
        ({"profiler_kwargs": {"schedule": None}}, "profiler_kwargs may not set schedule"),
        ({"torch_profiler": False, "fx_timing": False}, "both False"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Profiler(SmallNet(), **kwargs)


def test_misuse_is_named():
    with pytest.raises(ValueError, match=r"module must be the nn\.Module to profile"):
        Profiler(None)
    prof = Profiler(SmallNet())
    with pytest.raises(RuntimeError, match=r"step\(\) was called before start\(\)"):
        prof.step()
    with pytest.raises(ValueError, match="stage must be 'train' or 'val'"):
        prof.begin_step("test")


def test_a_fabric_loop(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    fabric_model, optimizer = fabric.setup(model, optimizer)  # profile the module itself, not Fabric's wrapper
    loader = fabric.setup_dataloaders(image_loader(samples=24))
    with Profiler(model, wait=1, warmup=1, active=2, repeat=1, dirpath=tmp_path, sinks=[CsvSink()]) as prof:
        for x, y in loader:
            fabric.backward(F.cross_entropy(fabric_model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    (cycle,) = prof.cycles
    assert cycle.steps == [2, 3] and {"conv", "head"} <= {n.name for n in cycle.nodes if n.bwd_calls}
    assert (cycle.directory / "fx_nodes.csv").exists() and cycle.trace_paths


@notices("profiler is still running")
def test_validation_entered_in_training_mode_leaves_the_training_cycle_alone(tmp_path):
    model = SmallNet()
    with Profiler(model, wait=0, warmup=1, active=3, repeat=1, dirpath=tmp_path, profile_validation=True, sinks=[]) as prof:
        for step in range(4):
            model(torch.randn(4, 3, 8, 8)).sum().backward()
            if step == 2:
                # eval() only inside validation(): the val cycle opens in training mode.
                with pytest.warns(UserWarning, match="Switch the module to eval mode"), torch.no_grad(), prof.validation():
                    model.eval()
                    for _ in range(2):  # warm-up, recorded
                        model(torch.randn(4, 3, 8, 8))
                        prof.step()
                model.train()
            prof.step()
    assert [c.steps for c in prof.cycles] == [[1, 2, 3]] and all(n.calls == 3 for n in prof.cycles[0].nodes)
    assert [c.nodes for c in prof.val_cycles] == [[]]


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 8),
                    reason="Dynamo 2.6 fails on a bool added to an int attribute (sympy: 'BooleanFalse' object has no "
                           "attribute 'as_coeff_Mul'): the model is timed by module hooks there, with a warning")
def test_an_error_of_the_own_forward_in_the_other_mode_is_the_users_and_runs_once(tmp_path):
    class Picky(torch.nn.Module):  # a shape branch; raises on odd batches in eval mode
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.calls = torch.nn.Linear(4, 4), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += not self.training
            if not self.training and x.shape[0] % 2:
                raise ValueError("odd batch")
            return self.lin(x) if x.shape[0] > 1 else x

    model = Picky()
    with Profiler(model, wait=0, warmup=0, active=2, repeat=2, dirpath=tmp_path, sinks=[]) as prof:
        for step in range(4):
            model(torch.randn(2, 4)).sum().backward()
            if step == 2:  # the second cycle runs the graph captured in the first
                model.eval()
                with pytest.raises(ValueError, match="odd batch"):
                    model(torch.randn(3, 4))
                model.train()
            prof.step()
    assert model.calls == 1  # not run again as if the graph had failed
    assert prof.cycles[1].capture.method == "dynamo" and prof.cycles[1].nodes  # the graph is still used


def test_the_callbacks_settings_are_its_engines_checked_once_never_set_afterwards():
    callback = FXProfilerCallback(top_k=3, keep_cycles=2)
    assert (callback.profiler.settings.top_k, callback.profiler.settings.keep_cycles, callback.schedule) == (3, 2, callback.profiler.schedule)
    with pytest.raises(AttributeError, match=r"pass top_k=\.\.\. to FXProfilerCallback\(\.\.\.\)"):
        callback.top_k = -5  # would skip the check the constructor makes
    assert callback.profiler.settings.top_k == 3
    with pytest.raises(AttributeError):
        callback.top_k  # noqa: B018  (no forwarding: read callback.profiler.settings.top_k)


def test_each_option_is_declared_once_and_the_docs_table_has_it_with_its_default():
    """``Settings`` declares the options; both constructors show them in their signatures (help(), LightningCLI) and
    docs/usage.md's table lists exactly them, with the same defaults, beside ``module`` and ``sinks``."""
    options = {f.name: f.default for f in dataclasses.fields(Settings)}
    for constructor in (Profiler, FXProfilerCallback):
        parameters = inspect.signature(constructor).parameters
        assert {n: p.default for n, p in parameters.items() if n not in ("module", "sinks", "settings")} == options
    table = (Path(__file__).parents[1] / "docs" / "usage.md").read_text().split("## Options", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.M))
    assert set(rows) == {*options, "module"}
    assert all(rows[name] == repr(default).replace("'", '"') for name, default in options.items()), rows


def test_settings_made_once_are_handed_to_the_engine_as_they_are():
    """The callback builds ``Settings`` once, under its own name, and hands them over (``Profiler(settings=...)``)."""
    callback = FXProfilerCallback(wait=7, top_k=4)
    assert (callback.profiler.settings.wait, callback.profiler.settings.top_k) == (7, 4)
    settings = Settings(wait=3)
    assert Profiler(SmallNet(), settings=settings).settings is settings
    with pytest.raises(TypeError, match=r"takes settings= \(a Settings\) or the options themselves"):
        Profiler(SmallNet(), settings=settings, wait=4)


def test_an_unknown_option_is_named_with_the_nearest_one():
    with pytest.raises(TypeError, match=r"FXProfilerCallback\(\) got an unknown option 'wiat': did you mean 'wait'"):
        FXProfilerCallback(wiat=5)
    with pytest.raises(TypeError, match=r"Profiler\(\) got an unknown option 'topk': did you mean 'top_k'"):
        Profiler(SmallNet(), topk=5)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        Profiler(SmallNet(), top_k=0)
    settings = Profiler(SmallNet(), wait=5, ranks=[0]).settings
    assert (settings.wait, settings.tracing_ranks, settings.profiler_kwargs) == (5, frozenset({0}), {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.wait = 6  # checked once: a setting is not changed afterwards
    with pytest.raises(TypeError, match=r"takes its schedule as skip_first=, wait=, warmup=, active= and repeat="):
        FXProfilerCallback(schedule=torch.profiler.schedule(wait=1, warmup=1, active=2))


def test_the_settings_are_read_on_settings_and_never_set_on_the_profiler():
    ranks = [0]
    prof = Profiler(SmallNet(), top_k=5, ranks=ranks)
    ranks.append(-1)  # the caller's list, changed afterwards: the checked copy stays
    assert prof.settings.ranks == (0,) and prof.settings.tracing_ranks == frozenset({0})
    with pytest.raises(AttributeError, match=r"read profiler\.settings\.top_k"):
        prof.top_k  # noqa: B018
    with pytest.raises(AttributeError, match=r"pass top_k=\.\.\. to Profiler\(\.\.\.\)"):
        prof.top_k = 1  # would skip the check, and the sinks would not see it
    assert display(prof).top_k == 5
    callback = FXProfilerCallback()
    with pytest.raises(AttributeError, match=r"pass skip_first=, wait=, warmup=, active=, repeat="):
        callback.schedule = None
    with pytest.raises(AttributeError, match=r"read them as callback\.extra_sinks"):
        callback.sinks = []


def test_rank_0_that_timed_nothing_still_gets_the_module_tree_of_the_merged_table(tmp_path, monkeypatch):
    """Two ranks, as the engine sees them: rank 0 timed nothing (its graph stopped fitting), rank 1 timed the nodes.
    Rank 0 writes the report: the merged rows, and the module tree from rank 1's rows."""
    from fxprof_lightning.engine import core

    def run(directory):
        model = SmallNet()
        with Profiler(model, wait=0, warmup=1, active=2, repeat=1, torch_profiler=False, sinks=[],
                      dirpath=tmp_path / directory) as prof:
            for _ in range(4):
                model(torch.randn(4, 3, 8, 8)).sum().backward()
                prof.step()
        return prof.cycles[-1]

    rank1: dict = {}
    measure = core.Cycle.measure

    def measured(cycle, module, warn):
        rank1["table"], rank1["rows"] = measure(cycle, module, warn), cycle.nodes
        return rank1["table"]

    monkeypatch.setattr(core.Cycle, "measure", measured)
    alone = run("one_rank")

    def nothing(cycle, module, warn):  # rank 0 timed nothing (its sessions are stopped all the same)
        measure(cycle, module, warn)
        cycle.nodes = []

    monkeypatch.setattr(core.Cycle, "measure", nothing)
    monkeypatch.setattr(core.Engine, "world_size", property(lambda self: 2))
    monkeypatch.setattr(core, "all_gather", lambda value: [value, (rank1["table"], [], rank1["rows"])])
    report = run("two_ranks")
    assert [n.name for n in report.nodes] == [n.name for n in alone.nodes]
    assert report.modules and [m.path for m in report.modules] == [m.path for m in alone.modules]


def test_a_plain_loops_phases_hold_the_modules_own_hooks():
    """FSDP2's pattern, hooks registered before the profiler's: a forward pre-hook put first (the root's all-gather), a
    forward hook (its reshard) that hooks the output's gradient (the pre-backward all-gather), which queues a callback
    for the end of backward (the root's reduce-scatter). LoopClock's forward holds both forward hooks; its backward,
    the gradient's hook and the callback."""
    model = torch.nn.Linear(4, 4)

    def pause(*_: object) -> None:
        time.sleep(0.03)

    def gradient(grad: torch.Tensor) -> None:
        pause()
        torch.autograd.Variable._execution_engine.queue_callback(pause)

    def output(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        pause()
        out.register_hook(gradient)

    model.register_forward_pre_hook(pause, prepend=True)
    model.register_forward_hook(output)
    clock = LoopClock(model)
    model(torch.randn(2, 4)).sum().backward()
    phases = clock.lap()
    clock.close()
    assert phases["forward"] >= 60e6 and phases["backward"] >= 60e6, phases


def test_a_plain_loops_backward_starts_at_an_output_a_users_hook_put_in_place():
    """A forward hook of the user's that returns a new output not connected to the module's: the backward phase starts
    at that output's gradient (here a 30 ms hook on it), not never."""
    model = torch.nn.Linear(4, 4)
    model.register_forward_hook(lambda module, args, out: out.detach().clone().requires_grad_())
    clock = LoopClock(model)
    out = model(torch.randn(2, 4))
    out.register_hook(lambda grad: time.sleep(0.03))
    out.sum().backward()
    phases = clock.lap()
    clock.close()
    assert phases["backward"] >= 30e6, phases


def test_a_plain_loops_step_splits_into_forward_backward_and_the_rest(tmp_path):
    """LoopClock: forward inside the module's calls, backward from the output's gradient to the pass's end, the rest
    (here a 40 ms wait for data: far above SmallNet's forward, also on a loaded machine) as other; together the step's
    wall time. No hook is left on the module."""
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with Profiler(model, wait=1, warmup=1, active=3, repeat=2, dirpath=tmp_path, sinks=[]) as prof:
        for x, y in image_loader(samples=4 * 10):
            time.sleep(0.040)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(batch_size=len(x))
    assert [c.steps for c in prof.cycles] == [[2, 3, 4], [7, 8, 9]]
    for cycle in prof.cycles:
        assert set(cycle.phases) == {"forward", "backward", "fxprof", "other"} and cycle.batch_size == 4
        assert all(ms > 0 for ms in cycle.phases.values()), cycle.phases
        assert 40.0 <= cycle.phases["other"] and cycle.phases["forward"] < cycle.phases["other"]
        assert sum(cycle.phases.values()) == pytest.approx(statistics.mean(cycle.step_ms), rel=0.25)
    assert not model._forward_hooks and not model._forward_pre_hooks


class SlowSink:
    """A sink that takes 300 ms to write a cycle (a slow disk, a tracker's upload)."""

    def write_cycle(self, report, display) -> None:
        time.sleep(0.3)

    def close(self, run) -> None:
        pass


def test_the_profilers_own_step_is_its_phase_not_the_loops_other(tmp_path):
    """Known answer: with cycles back to back (no wait, no warm-up), the first cycle is written inside the ``step()``
    that begins the second cycle's first step, 300 ms by a slow sink. That time is the profiler's (``fxprof``), not
    the loop's ``other`` (here a 20 ms wait per step)."""
    model = SmallNet()
    with Profiler(model, wait=0, warmup=0, active=2, repeat=2, dirpath=tmp_path, sinks=[SlowSink()]) as prof:
        for x, _ in image_loader(samples=4 * 4):
            time.sleep(0.020)
            model(x).sum().backward()
            prof.step()
    first, second = prof.cycles
    assert second.steps == [2, 3] and first.phases["fxprof"] < 100.0
    assert second.phases["fxprof"] >= 300.0 / 2  # (a mean over the cycle's 2 steps)
    assert 20.0 <= second.phases["other"] < 100.0, second.phases
