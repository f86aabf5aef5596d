"""Cycles that follow a long job (issue 29): one on request from another shell, one when the step time jumps.

The jobs run in subprocesses (``tests/follow_job.py``), with a ``wait`` longer than the run: only a request sent by
the real command line (``python -m fxprof_lightning trigger DIR``) or a jump of the step time starts a cycle.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import notices
from lightning.pytorch.callbacks import ModelCheckpoint
from test_dynamics import Classifier
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fxprof_lightning import FXProfilerCallback, Profiler
from fxprof_lightning.engine.follow import JOB_FILE, StepWatch
from fxprof_lightning.engine.idle import BATCH
from fxprof_lightning.outputs.runs import load_cycle

JOB = Path(__file__).with_name("follow_job.py")


def start_job(out: Path, mode: str, *extra: str) -> subprocess.Popen:
    job = subprocess.Popen([sys.executable, str(JOB), str(out), mode, *extra], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (out / "fxprof" / JOB_FILE).is_file():  # written when the run begins
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.1)
    return job


def trigger(out: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxprof_lightning", "trigger", str(out / "fxprof"), *options],
                          capture_output=True, text=True, timeout=120)


def results(out: Path, job: subprocess.Popen, ranks: int = 1) -> list[dict]:
    log = job.communicate(timeout=180)[0]
    assert job.returncode == 0, log[-3000:]
    return [json.loads((out / f"result{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.parametrize("mode", ["plain", "trainer"])
def test_a_request_from_the_command_line_starts_a_cycle_of_the_running_job(tmp_path, mode):
    job = start_job(tmp_path, mode)
    time.sleep(1.0)  # some idle steps first
    asked = trigger(tmp_path, "--active", "2", "--reason", "the loss went flat")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    (result,) = results(tmp_path, job)
    (cycle,) = result["cycles"]
    assert cycle["trigger"] == "request: the loss went flat" and len(cycle["steps"]) == 2
    assert cycle["directory"].endswith("-t1")
    # The command printed which cycle answers it, and the cycle's files say why it ran.
    assert asked.stdout.startswith(f"{cycle['directory']} answers the request: it records steps "
                                   f"{cycle['steps'][0]}-{cycle['steps'][-1]}"), asked.stdout
    report = load_cycle(tmp_path / "fxprof" / cycle["directory"])
    assert report.trigger == "request: the loss went flat" and report.label == cycle["label"]
    summary = subprocess.run([sys.executable, "-m", "fxprof_lightning", "report", str(tmp_path / "fxprof"), "--html"],
                             capture_output=True, text=True, timeout=120)
    assert "request: the loss went flat" in summary.stdout and "What profiling cost" in summary.stdout, summary.stdout
    # ... the idle steps before the cycle included (a second of them: profiling's own part, under a millisecond a step)
    idle = re.search(r"and (\d+\.\d\d) s in the idle steps between cycles", summary.stdout)
    assert idle and float(idle.group(1)) < 0.5, summary.stdout
    assert "request: the loss went flat" in (tmp_path / "fxprof" / "fxprof_report.html").read_text()
    # The job has ended: a request now says so and fails.
    late = trigger(tmp_path)
    assert late.returncode == 1 and "ended" in late.stderr


def test_two_ranks_triggered_once_record_the_same_steps(tmp_path):
    # Only rank 0's dirpath is where the request lands (rank 1 writes elsewhere): rank 0 tells rank 1 at a step
    # both reach.
    job = start_job(tmp_path, "ddp")
    time.sleep(1.0)
    asked = trigger(tmp_path, "--active", "3")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    first, second = results(tmp_path, job, ranks=2)
    assert first["steps_run"] == second["steps_run"]
    (a,), (b,) = first["cycles"], second["cycles"]
    assert a["steps"] == b["steps"] and len(a["steps"]) == 3 and a["trigger"] == b["trigger"] == "request: from the command line"


def test_a_request_for_a_job_that_never_ran_says_so(tmp_path):
    asked = trigger(tmp_path)
    assert asked.returncode == 2 and "no profiled job ever ran" in asked.stderr


def test_a_request_that_cannot_be_written_says_so(tmp_path):
    fxprof = tmp_path / "fxprof"
    (fxprof / "fxprof_request.json").mkdir(parents=True)  # what os.replace cannot put a file in place of
    (fxprof / JOB_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "ended": None}))
    asked = trigger(tmp_path)
    assert asked.returncode == 2 and asked.stderr.startswith(f"could not write the request into {fxprof}: ")
    assert sorted(p.name for p in fxprof.iterdir()) == [JOB_FILE, "fxprof_request.json"]  # no partial file left


def test_a_slowdown_starts_an_anomaly_cycle_that_records_slow_steps(tmp_path):
    job = start_job(tmp_path, "plain", "--slow-from", "150")
    (result,) = results(tmp_path, job)
    (cycle,) = result["cycles"]
    assert cycle["trigger"].startswith("anomaly: step time") and "since step 150" in cycle["trigger"], cycle
    assert 150 < cycle["steps"][0] <= 170  # within 20 steps of the slowdown
    report = load_cycle(tmp_path / "fxprof" / cycle["directory"])
    assert min(report.step_ms) > 2.5 * 1e3 * 0.004  # the slow steps (each sleeps 12 ms)


class Lit(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(0.05)  # a validation run several steps long
        self.log("val_loss", F.cross_entropy(self.model(x), y))


@notices("before any recorded step", "the Trainer has no logger")
def test_a_steady_run_with_checkpoints_and_validation_starts_no_cycle_in_2000_steps(tmp_path):
    data = TensorDataset(torch.randn(2000 * 4, 16), torch.randint(0, 4, (2000 * 4,)))
    callback = FXProfilerCallback(module="model", wait=10**6, torch_profiler=False, pictures=False)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=100, save_top_k=-1)
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[callback, saves], max_steps=2000, logger=False,
                         accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=100, limit_val_batches=4, num_sanity_val_steps=0)
    trainer.fit(Lit(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    assert len(list((tmp_path / "checkpoints").glob("*.ckpt"))) == 20
    watch = callback.profiler.follow.watch
    # every step's time watched (in batches of up to BATCH steps: the last batch's may be left at the end); no cycle
    assert callback.cycles == [] and watch.count >= 2000 - BATCH - 2
    assert watch.level is not None and watch.level < 0.05


def test_a_single_slow_step_is_no_jump_and_eight_in_a_row_are():
    watch = StepWatch()
    for step in range(300):
        slow = step % 100 == 50  # a checkpoint save every 100 steps
        assert watch.add(step, 0.05 if slow else 0.01) is None
    reasons = [watch.add(300 + i, 0.03) for i in range(8)]
    assert reasons[:7] == [None] * 7 and reasons[7].startswith("step time 3.0x its median")
    assert all(watch.add(308 + i, 0.09) is None for i in range(100))  # cooling down: no second start


def loop(steps: int, profiler: Profiler | None, step_s: float = 0.004) -> float:
    """Seconds a plain loop of ``steps`` steps of about ``step_s`` takes (with ``profiler`` stepping in it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    started = time.perf_counter()
    if profiler is not None:
        profiler.module = net
        profiler.start()
    for _ in range(steps):
        net(torch.randn(8, 16)).sum().backward()
        time.sleep(step_s)
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()
    return time.perf_counter() - started


@notices("left out to keep profiling within overhead_budget")
def test_a_budget_keeps_what_profiling_costs_within_it(tmp_path):
    # wait=1: a cycle every 5 steps unless the budget holds them back; 5% of the run's wall time allowed. (The wall
    # time against the same loop without profiling is benchmarks/bench_budget.py's: timings are no test's.)
    import torch._functorch.aot_autograd  # noqa: F401  (what Dynamo's first use in a process imports, ~0.5 s: paid here)

    profiler = Profiler(nn.Linear(1, 1), dirpath=tmp_path, wait=1, warmup=1, active=3, pictures=False,
                        overhead_budget=0.05)
    steps = 2000  # 20 s: room for a second cycle when the first (with the capture) costs up to 0.5 s on a busy machine
    seconds = loop(steps, profiler, step_s=0.01)
    assert 0 < profiler.follow.setup_s < 0.1  # the capture made ready at the start: counted, with the cycles
    assert 2 <= len(profiler.cycles) < steps // 5 / 4, [c.cost_s for c in profiler.cycles]  # most were left out
    costs = [c.cost_s for c in profiler.cycles]
    assert all(cost is not None and cost >= 0 for cost in costs) and costs[0] > 0.05  # the first holds the capture
    # The second cycle waited until the first's cost and as much again were within the budget: ~2 x 0.25 s / 5%.
    assert profiler.cycles[1].steps[0] > 100, [c.steps for c in profiler.cycles]
    assert profiler.follow.share() <= 0.05 + costs[-1] / seconds
    # ... and its time in the idle steps (counted for the budget too): profiling's own, never the loop's 10 ms a step
    idle_s = profiler.follow.idle_ns / 1e9
    assert profiler.follow.spent_s() == pytest.approx(sum(costs) + profiler.follow.setup_s + idle_s)
    assert 0 < idle_s < steps * 0.001, idle_s
    lines = [json.loads(line) for line in (tmp_path / "fxprof_cycles.jsonl").read_text().splitlines()]
    index = [line for line in lines if "cycle" in line]  # (and notes on the step time, if the machine made any)
    assert [line["cycle"] for line in index] == [c.directory.name for c in profiler.cycles]
    assert sum(line["cost_s"] for line in index) == pytest.approx(profiler.follow.cost_s, abs=1e-3 * len(index))
    assert 0 < index[-1]["idle_s"] <= idle_s + 1e-4  # (by the last cycle's end)
    # Every cycle the schedule selected has a report or a line saying why not (issue 40 item 8)
    absent = [line for line in lines if "absent" in line]
    reported = {c.index for c in profiler.cycles}
    last = profiler.cycles[-1].index  # (the run ends with cycles the schedule would still select)
    assert {int(line["absent"].split()[1]) for line in absent} | reported >= set(range(last + 1)), absent
    assert all("left out to keep profiling within overhead_budget=0.05" in line["why"] for line in absent), absent


def test_a_budget_must_be_a_share():
    with pytest.raises(ValueError, match="overhead_budget must be a share of the run's wall time"):
        Profiler(nn.Linear(1, 1), overhead_budget=2)


def test_a_request_taken_before_a_checkpoint_is_answered_after_the_restart(tmp_path):
    # The request is taken at step 1 (a request is looked for at the first idle step that is only counted, and then
    # whenever the request thread sees the directory change) and its cycle planned from step 2; the job stops there
    # and resumes from the state saved after step 1.
    from fxprof_lightning.engine.follow import write_request

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    options = {"dirpath": tmp_path, "wait": 10**6, "warmup": 1, "active": 2, "torch_profiler": False, "pictures": False}
    tmp_path.mkdir(exist_ok=True)
    write_request(tmp_path, {"id": "one", "active": 2, "reason": "before the checkpoint"})
    first = Profiler(net, **options)
    first.start()
    for _ in range(2):
        net(torch.randn(8, 16)).sum().backward()
        first.step()
        saved = first.state_dict()  # (as a checkpoint at the end of the step: ModelCheckpoint's hooks come last)
    first._disable()  # the job dies in step 2
    assert saved["planned"] and saved["trigger"]["reason"] == "before the checkpoint"
    resumed = Profiler(net, **options)
    resumed.load_state_dict(saved)
    with resumed:
        for _ in range(2, 9):
            net(torch.randn(8, 16)).sum().backward()
            resumed.step()
    (cycle,) = resumed.cycles
    assert cycle.trigger == "request: before the checkpoint" and cycle.steps == [3, 4]
    assert not (tmp_path / "fxprof_request.json").exists()  # taken once: no second cycle for it


def _train_asking(tmp_path, steps: int, ask_at: int | None, **options) -> tuple[Profiler, nn.Module]:
    """A plain loop of ``steps`` steps of 10 ms (time for the job to look for requests), asking for a cycle at
    ``ask_at`` as ``fxprof trigger`` does (without waiting for the answer)."""
    from fxprof_lightning.engine.follow import REQUEST_FILE, write_request

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1))
    with Profiler(model, dirpath=tmp_path, torch_profiler=False, pictures=False, watch_step_time=False,
                  **options) as prof:
        for step, x in enumerate(data):
            if step == ask_at:
                write_request(tmp_path, {"id": "asked", "active": None, "reason": "a test", "asked": time.time()})
                # until the job's thread takes it (it looks once a second): the cycle it plans then starts at the
                # next step, far from a scheduled one (taken 30 steps later, a scheduled cycle answered it in a run)
                deadline = time.monotonic() + 5
                while (tmp_path / REQUEST_FILE).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.01)
            prof.step()
    return prof, model


def test_a_requested_cycle_keeps_the_promises_of_scheduled_ones(tmp_path):
    """keep_cycles counts a requested cycle as any other (the newest N directories stay, the run's index keeps every
    cycle), and training is bitwise what it is without a request."""
    options = {"skip_first": 0, "wait": 40, "warmup": 1, "active": 2, "keep_cycles": 2}
    prof, model = _train_asking(tmp_path / "asked", 220, 50, **options)
    _, unasked = _train_asking(tmp_path / "unasked", 220, None, **options)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), unasked.state_dict().values(), strict=True))
    index = [json.loads(line) for line in (tmp_path / "asked" / "fxprof_cycles.jsonl").read_text().splitlines()]
    requested = [entry for entry in index if entry["trigger"].startswith("request")]
    assert len(requested) == 1 and "-t" in requested[0]["cycle"] and len(index) >= 5, index
    on_disk = sorted(p.name for p in (tmp_path / "asked").iterdir() if p.name.startswith("cycle_"))
    assert on_disk == sorted(entry["cycle"] for entry in index[-2:])  # the two newest, whatever their trigger
    assert [c.directory.name for c in prof.cycles] == [entry["cycle"] for entry in index[-2:]]


class AskAt(pl.Callback):
    """Asks for a cycle at one training step, as ``fxprof trigger`` does; every step takes 10 ms more."""

    def __init__(self, dirpath: Path, step: int) -> None:
        self.dirpath, self.step = dirpath, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from fxprof_lightning.engine.follow import write_request

        if trainer.global_step == self.step:
            write_request(self.dirpath, {"id": "asked", "active": None, "reason": "a test", "asked": time.time()})
        time.sleep(0.01)


class Validated(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))


@notices("the Trainer has no logger")
def test_a_requested_training_cycle_leaves_validation_profiling_as_scheduled(tmp_path):
    data = TensorDataset(torch.randn(160 * 4, 16), torch.randint(0, 4, (160 * 4,)))
    callback = FXProfilerCallback(module="model", skip_first=0, wait=60, warmup=1, active=2, profile_validation=True,
                                  torch_profiler=False, pictures=False, dirpath=tmp_path / "fxprof",
                                  watch_step_time=False)
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[callback, AskAt(tmp_path / "fxprof", 20)], max_steps=160,
                         logger=False, accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, val_check_interval=40, limit_val_batches=20, num_sanity_val_steps=0,
                         enable_checkpointing=False)
    trainer.fit(Validated(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    triggers = [c.trigger for c in callback.cycles]
    assert triggers.count("schedule") == 2 and sum(t.startswith("request") for t in triggers) == 1, triggers
    (asked,) = [c for c in callback.cycles if c.trigger.startswith("request")]
    # seen within a second (100 steps of 10 ms), named after the scheduled cycle it comes before
    assert 20 < asked.steps[0] <= 120 and asked.directory.name in ("cycle_0000-t1", "cycle_0001-t1"), asked.directory
    # validation: 20 batches at each of 4 validations, its own count and schedule (60 idle, 1 warm-up, 2 recorded)
    assert [c.steps for c in callback.val_cycles] == [[61, 62]] and all(c.nodes for c in callback.val_cycles)
