"""Resume from checkpoints, and faults: exceptions, KeyboardInterrupt, unwritable output, full disk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer, notices, own_forward

from fxprof_lightning import FXProfilerCallback

SCHEDULE = {"skip_first": 1, "wait": 1, "warmup": 1, "active": 3}  # recorded: 3-5, 8-10, 13-15, 18-20, ...
PLUGIN_PATTERN = r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$"


def recorded(callback):
    return [step for cycle in callback.cycles for step in cycle.steps]


@pytest.mark.parametrize("stop_at", [6, pytest.param(9, marks=pytest.mark.slow)])  # between cycles (in wait) / in the
# middle of cycle 1 (the slow tier)
def test_resume_continues_the_schedule(tmp_path, stop_at):
    out = tmp_path / "fxprof"
    straight = FXProfilerCallback(**SCHEDULE, module="model", dirpath=tmp_path / "straight")
    make_trainer(tmp_path / "a", [straight], max_steps=20).fit(LitClassifier(), image_loader(samples=96))

    first = FXProfilerCallback(**SCHEDULE, module="model", dirpath=out)
    trainer = make_trainer(tmp_path / "b", [first], max_steps=stop_at)
    trainer.fit(LitClassifier(), image_loader(samples=96))
    checkpoint = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(checkpoint)
    # (the cycles' files: the job file and the index of cycles at the top are the job's now writing there)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.parent != out}

    resumed = FXProfilerCallback(**SCHEDULE, module="model", dirpath=out)
    make_trainer(tmp_path / "b", [resumed], max_steps=20).fit(LitClassifier(), image_loader(samples=96), ckpt_path=checkpoint)

    # Nothing twice, nothing skipped. Resumed inside a cycle (9), the new process captures in recorded step 9: that
    # step is dropped and step 11, idle in the schedule, recorded in its place.
    dropped = [step for cycle in resumed.cycles for step in cycle.dropped_steps]
    assert dropped == ([9] if stop_at == 9 else [])
    extra = [11] if stop_at == 9 else []
    assert sorted(recorded(first) + recorded(resumed) + dropped) == sorted(recorded(straight) + extra)
    assert resumed.cycles[0].steps[0] >= stop_at
    assert all(p.read_bytes() == data for p, data in before.items())  # the first run's files are untouched
    new_dirs = {c.directory.name for c in resumed.cycles}
    assert new_dirs.isdisjoint({c.directory.name for c in first.cycles})
    # Plain names where they are free; a suffix only for the name the first run took (the cut cycle 1).
    assert {name for name in new_dirs if "-" in name} == ({"cycle_0001-r1"} if stop_at == 9 else set())
    assert new_dirs - {"cycle_0001-r1"} == {f"cycle_{i:04d}" for i in range(1 if stop_at == 6 else 2, 4)}
    if stop_at == 9:  # the checkpoint was taken mid-cycle: both halves of cycle 1 are there, marked partial
        assert (first.cycles[-1].index, first.cycles[-1].steps, first.cycles[-1].partial) == (1, [8], True)
        assert (resumed.cycles[0].index, resumed.cycles[0].steps, resumed.cycles[0].partial) == (1, [10, 11], True)


class FailsAtStep(LitClassifier):
    def __init__(self, step: int, error: BaseException):
        super().__init__()
        self.fail_step, self.error, self.calls = step, error, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        if self.calls - 1 == self.fail_step:
            raise self.error
        return loss


def test_exception_in_a_recorded_step_propagates_and_leaves_things_clean(tmp_path):
    callback = FXProfilerCallback(**SCHEDULE, module="model")
    error = RuntimeError("the user's own error")
    model = FailsAtStep(4, error)
    with pytest.raises(RuntimeError) as raised:
        make_trainer(tmp_path, [callback], max_steps=20).fit(model, image_loader())
    assert raised.value is error  # unchanged
    assert own_forward(model.model)
    assert not torch.autograd.profiler._is_profiler_enabled
    (cycle,) = callback.cycles
    # Step 4's forward ran before the error: it counts, so calls and steps agree.
    assert cycle.partial and cycle.steps == [3, 4] and all(n.calls == 2 for n in cycle.nodes)
    assert len(cycle.trace_paths) == 1 and cycle.trace_paths[0].exists()
    assert (cycle.directory / "fx_nodes.csv").exists()


class SkipsRestOfEpochAt(LitClassifier):
    """Returns -1 from on_train_batch_start at one step: Lightning skips the rest of the epoch."""

    def __init__(self, step: int):
        super().__init__()
        self.skip_at = step

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.global_step == self.skip_at else None


@notices("before any recorded step")
@pytest.mark.parametrize("torch_profiler", [False, True])
def test_a_cycle_whose_step_never_ends_is_closed_at_the_end_of_training(tmp_path, torch_profiler):
    callback = FXProfilerCallback(skip_first=1, wait=0, warmup=1, active=2, module="model", torch_profiler=torch_profiler)
    model = SkipsRestOfEpochAt(1)  # the warm-up step opens the cycle, and its batch never ends
    make_trainer(tmp_path, [callback], max_steps=-1, max_epochs=1).fit(model, image_loader())
    assert own_forward(model.model)  # the module's own forward is back
    assert not torch._C._autograd._profiler_enabled()  # no profiler left running
    assert [c.steps for c in callback.cycles] == []  # nothing recorded; the warm-up's trace is gone
    assert not any((tmp_path / "logs").rglob("*.pt.trace.json*"))


class ShapeBranching(torch.nn.Module):
    """Branches on a shape: plain tracing fails, so the callback waits for a call to trace on."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.head(x.flatten(1) if x.shape[1] == 3 else x)


class FailsBeforeItsModel(LitClassifier):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("before the model ran")


def test_an_exception_before_the_first_call_leaves_no_hook_on_the_model(tmp_path):
    model = FailsBeforeItsModel(ShapeBranching())
    callback = FXProfilerCallback(skip_first=1, wait=0, warmup=1, active=1, module="model")
    with pytest.raises(RuntimeError, match="before the model ran"):
        make_trainer(tmp_path, [callback], max_steps=4).fit(model, image_loader())
    # The one-shot hook waiting for the model's first call (to trace on it) is gone.
    assert not model.model._forward_pre_hooks and not model.model._forward_pre_hooks_with_kwargs


def test_keyboard_interrupt_in_a_recorded_step_leaves_no_wrapper(tmp_path):
    callback = FXProfilerCallback(**SCHEDULE, module="model")
    model = FailsAtStep(4, KeyboardInterrupt())
    with pytest.raises(SystemExit):  # Lightning turns Ctrl+C into a graceful shutdown and exit(1)
        make_trainer(tmp_path, [callback], max_steps=20).fit(model, image_loader())
    assert own_forward(model.model)
    assert not torch.autograd.profiler._is_profiler_enabled
    assert callback.cycles[0].partial


FULL_DISK_SCRIPT = textwrap.dedent(
    """
    import json, re, resource, signal, sys, warnings
    sys.path.insert(0, sys.argv[2])
    from helpers import LitClassifier, image_loader, make_trainer
    from fxprof_lightning import FXProfilerCallback

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, module="model", use_gzip=False)
    trainer = make_trainer(sys.argv[1], [callback], max_steps=4, logger=False)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # the disk is "full" at 4 KiB a file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LitClassifier(), image_loader())
    print(json.dumps({"global_step": trainer.global_step, "warnings": [str(w.message) for w in caught],
                      "cycles": [[c.steps, [str(p) for p in c.trace_paths]] for c in callback.cycles]}))
    """
)


@pytest.mark.slow  # (7-8 s: the quick loop stays under 3 minutes)
def test_a_full_disk_warns_and_training_goes_on(tmp_path):
    tests_dir = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path), str(tests_dir)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["global_step"] == 4  # training went on to the end
    assert any("could not write the trace" in w for w in result["warnings"]), result["warnings"]
    assert result["cycles"] == [[[1], []]]  # the cycle is reported, without a trace
    files = [p.name for p in (tmp_path / "fxprof" / "cycle_0000").iterdir()]
    assert not [name for name in files if re.match(PLUGIN_PATTERN, name)]  # no partial file under a plugin name
    assert not [name for name in files if "partial" in name]  # and no temporary left behind
