"""Stages and loops: validation profiling, gradient accumulation, several fits, validate/test, max_steps."""

from __future__ import annotations

import torch
from helpers import LitClassifier, image_loader, make_trainer, own_forward, read_events
from torch.nn import functional as F

from fxprof_lightning import FXProfilerCallback


class LitWithEval(LitClassifier):
    """Counts training_step calls and has validation and test steps."""

    def __init__(self):
        super().__init__()
        self.training_steps = 0

    def training_step(self, batch, batch_idx):
        self.training_steps += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.model(x), y))


def scalar_steps(log_dir, tag):
    events = read_events(log_dir)
    return [e.step for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def test_validation_batches_get_their_own_schedule_and_directories(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=2, module="model", profile_validation=True)
    trainer = make_trainer(tmp_path, [callback], max_steps=16, num_sanity_val_steps=2)
    trainer.fit(LitWithEval(), image_loader(samples=32), image_loader(samples=24, seed=1))  # 8 train, 6 val batches

    # Training: cycles of 4 steps end at each epoch's last batch, so no training trace is open during validation.
    assert [c.steps for c in callback.cycles] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    # Validation counts its own batches over both validation runs (sanity-check batches are not counted):
    # cycle 1 (warm-up 5, recorded 6-7) straddles the two runs, so its recorded part is a piece of its own.
    assert [(c.index, c.steps, c.directory.name) for c in callback.val_cycles] == [
        (0, [2, 3], "val_cycle_0000"),
        (1, [6, 7], "val_cycle_0001-p1"),
        (2, [10, 11], "val_cycle_0002"),
    ]
    for cycle in callback.val_cycles:
        assert cycle.stage == "val" and {n.name for n in cycle.nodes} >= {"conv", "head"}
        assert len(cycle.trace_paths) == 1 and (cycle.directory / "fx_nodes.csv").exists()
    fxprof = tmp_path / "logs" / "version_0" / "fxprof"
    assert sorted(p.name for p in fxprof.iterdir()) == [
        "cycle_0000", "cycle_0001", "cycle_0002", "cycle_0003", "fxprof_cycles.jsonl", "fxprof_job.json", "val_cycle_0000",
        "val_cycle_0001-p1", "val_cycle_0002",
    ]
    log_dir = tmp_path / "logs" / "version_0"
    assert scalar_steps(log_dir, "fxprof_val/forward_ms_per_step") == [3, 7, 11]
    assert scalar_steps(log_dir, "fxprof/forward_ms_per_step") == [3, 7, 11, 15]
    assert own_forward(trainer.lightning_module.model)


def test_a_step_is_one_batch_under_gradient_accumulation(tmp_path):
    callback = FXProfilerCallback(skip_first=1, wait=0, warmup=1, active=2, repeat=2, module="model")
    model = LitWithEval()
    make_trainer(tmp_path, [callback], max_steps=5, accumulate_grad_batches=2).fit(model, image_loader())
    assert model.training_steps == 10  # 5 optimizer steps of 2 batches
    assert [c.steps for c in callback.cycles] == [[2, 3], [5, 6]]
    assert [n.calls for n in callback.cycles[0].nodes] == [2] * 6


def test_max_steps_inside_a_cycle_writes_the_partial_cycle(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=3, module="model")
    make_trainer(tmp_path, [callback], max_steps=4).fit(LitWithEval(), image_loader())
    (cycle,) = callback.cycles
    assert cycle.partial and cycle.steps == [2, 3]
    assert len(cycle.trace_paths) == 1 and (cycle.directory / "fx_nodes.csv").exists()
    assert "(partial)" in cycle.to_markdown()
    assert scalar_steps(tmp_path / "logs" / "version_0", "fxprof/forward_ms_per_step") == [3]


def test_several_fits_validate_and_test_on_one_callback(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=1, repeat=1, module="model")
    model = LitWithEval()
    first = make_trainer(tmp_path, [callback], max_steps=3)
    first.fit(model, image_loader())
    assert [c.steps for c in callback.cycles] == [[1]]

    first.validate(model, image_loader(seed=2), verbose=False)
    first.test(model, image_loader(seed=3), verbose=False)
    assert [c.steps for c in callback.cycles] == [[1]]  # evaluation leaves the training cycles alone
    assert callback.val_cycles == []  # profile_validation is off

    second = make_trainer(tmp_path, [callback], max_steps=3)
    second.fit(model, image_loader())
    assert [(c.steps, c.directory.parent.parent.name) for c in callback.cycles] == [([1], "version_1")]
    assert own_forward(model.model)


def test_profiled_validate_alone(tmp_path):
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=2, repeat=1, module="model", profile_validation=True)
    model = LitWithEval()
    make_trainer(tmp_path, [callback], max_steps=1).validate(model, image_loader(), verbose=False)
    (cycle,) = callback.val_cycles
    assert cycle.steps == [1, 2] and cycle.nodes
    assert torch.is_grad_enabled()
