"""The schedule against torch.profiler.schedule itself, and its argument checks."""

import itertools
import warnings

import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer, notices

from fxprof_lightning import FXProfilerCallback, Schedule
from fxprof_lightning.schedule import ProfilerAction

COMBOS = list(itertools.product([0, 1, 3], [0, 1, 2], [0, 2], [1, 2, 4], [0, 1, 3]))  # skip_first, wait, warmup, active, repeat


@pytest.mark.parametrize(("skip_first", "wait", "warmup", "active", "repeat"), COMBOS)
def test_matches_torch_profiler_schedule(skip_first, wait, warmup, active, repeat):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about warmup=0
        reference = torch.profiler.schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    ours = Schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    assert [ours.action(step) for step in range(120)] == [reference(step) for step in range(120)]


@pytest.mark.parametrize(("skip_first", "wait", "warmup", "active", "repeat"), COMBOS)
def test_cycle_arithmetic_agrees_with_actions(skip_first, wait, warmup, active, repeat):
    s = Schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    traced = {step for step in range(120) if s.action(step) is not ProfilerAction.NONE}
    recorded = {step for step in range(120) if s.action(step) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)}
    cycles = range(repeat) if repeat else range(120 // s.cycle_length + 1)
    assert traced == {step for c in cycles for step in s.traced_steps(c) if step < 120}
    assert recorded == {step for c in cycles for step in s.recorded_steps(c) if step < 120}
    for c in cycles:
        steps = s.recorded_steps(c)
        if steps[-1] < 120:
            assert s.action(steps[-1]) is ProfilerAction.RECORD_AND_SAVE
            assert {s.cycle_of(step) for step in s.traced_steps(c)} == {c}


@pytest.mark.parametrize(("skip_first", "wait", "warmup", "active", "repeat"), COMBOS)
def test_the_schedule_followed_records_the_same_steps(skip_first, wait, warmup, active, repeat):
    """``with_lead``: a warm-up step of ours before each cycle without one, where an idle step is there to take it."""
    given = Schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    followed = given.with_lead()
    recording = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
    assert [given.action(s) in recording for s in range(120)] == [followed.action(s) in recording for s in range(120)]
    assert [given.action(s) for s in range(120) if given.action(s) is not ProfilerAction.NONE] == [
        followed.action(s) for s in range(120) if given.action(s) is not ProfilerAction.NONE]
    assert followed.warmup == (1 if warmup == 0 and wait else warmup)


@pytest.mark.parametrize(("options", "recorded"), [
    ({"skip_first": 1, "wait": 2, "warmup": 0, "active": 3, "repeat": 1}, [[3, 4, 5]]),  # the issue's: was 4-6
    ({"skip_first": 0, "wait": 1, "warmup": 0, "active": 2, "repeat": 2}, [[1, 2], [4, 5]]),
    ({"skip_first": 2, "wait": 1, "warmup": 1, "active": 2, "repeat": 2}, [[4, 5], [8, 9]]),
])
@notices("the Trainer has no logger")
def test_a_trainer_records_the_steps_torch_profiler_schedule_records(tmp_path, options, recorded):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about warmup=0
        reference = torch.profiler.schedule(**options)
    callback = FXProfilerCallback(**options, module="model", pictures=False)
    make_trainer(tmp_path, [callback], max_steps=10, logger=False).fit(LitClassifier(), image_loader(samples=40))
    assert [c.steps for c in callback.cycles] == recorded
    steps = [s for c in recorded for s in c]
    assert steps == [s for s in range(10) if reference(s) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)][:len(steps)]
    assert not any(c.dropped_steps for c in callback.cycles) and all(c.nodes for c in callback.cycles)


def test_documented_example():
    s = Schedule(skip_first=2, wait=1, warmup=1, active=2, repeat=1)
    assert s.recorded_steps(0) == [4, 5]
    assert s.cycle_of(7) is None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"wait": -1}, "wait"),
        ({"warmup": -2}, "warmup"),
        ({"active": 0}, "active"),
        ({"repeat": -1}, "repeat"),
        ({"skip_first": -5}, "skip_first"),
        ({"active": 2.0}, "active"),
        ({"wait": "3"}, "wait"),
        ({"warmup": True}, "warmup"),
        ({"repeat": None}, "repeat"),
    ],
)
def test_bad_schedule_numbers_are_refused_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        FXProfilerCallback(**kwargs)


@pytest.mark.parametrize("settings", [dict(skip_first=0, wait=0, warmup=0, active=1, repeat=0),
                                      dict(skip_first=3, wait=2, warmup=1, active=2, repeat=2),
                                      dict(skip_first=0, wait=5, warmup=0, active=3, repeat=1),
                                      dict(skip_first=7, wait=0, warmup=2, active=1, repeat=0)])
def test_next_traced_step_is_the_first_step_with_an_action(settings):
    schedule = Schedule(**settings)
    for step in range(60):
        expected = next((s for s in range(step, 200) if schedule.action(s) is not ProfilerAction.NONE), None)
        assert schedule.next_traced_step(step) == expected, step
