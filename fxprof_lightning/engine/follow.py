"""Cycles that follow the job: one on request from another shell, one when the step time jumps.

Between cycles the engine notes the end of every training step (``Follow.tick``, or in a stretch of idle steps one
clock read and a list append a step, handed over in batches: ``idle.IdleSteps``). A thread of rank 0 asks the file
system once a second whether a request came (one ``os.stat`` of ``<dirpath>``, where ``python -m fxprof_lightning
trigger DIR`` puts ``fxprof_request.json``) and only raises a flag: the request is read at the next step. The step
time is watched by
``StepWatch``: a robust median and spread of the last ``WINDOW`` idle steps, and a cycle starts when ``SUSTAIN`` steps
in a row are slower than that level by more than its noise, half of it and 1 ms (a single slow step, such as a
checkpoint save or a validation run, never starts one).

With several ranks, only rank 0 decides, and it tells the others at steps every rank reaches: every ``every`` steps,
one ``broadcast_object_list`` carries the decision and the next interval (about a second of steps), so that every rank
starts the same cycle at the same step and nothing hangs, whatever file system the others see.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["INDEX_FILE", "JOB_FILE", "REQUEST_FILE", "Follow", "StepWatch", "Trigger", "answer_file", "read_lines",
           "request_cycle"]

JOB_FILE = "fxprof_job.json"  # the running job: pid, host, started, ended (written by rank 0)
REQUEST_FILE = "fxprof_request.json"  # a request for a cycle (the ``trigger`` command writes it, the job removes it)
ANSWERS_FILE = "fxprof_answers.jsonl"  # one line per request answered: its id and the cycle that answers it
INDEX_FILE = "fxprof_cycles.jsonl"  # the run's cycles: trigger, steps, cost (one line each, rank 0)
POLL_S = 1.0  # how often rank 0's thread looks for a request (one os.stat: 10-40 us on this VM, caches cold)
BATCH = 8  # idle steps noted by ``tick`` before their times go to the watch (a jump is seen within SUSTAIN + BATCH steps)
WINDOW = 300  # idle steps the step time's level is taken over
MIN_STEPS = 50  # idle steps seen before a jump can be told
SUSTAIN = 8  # steps in a row beyond the level's noise that start a cycle
NOISE = 6.0  # how many robust standard deviations (the interquartile range / 1.349) above the median a slow step is
MIN_JUMP = 0.5  # ... and at least this share of the median above it (1.5x) ...
MIN_JUMP_S = 0.001  # ... and this many seconds: on sub-ms steps, the machine's own drift reaches 1.5-1.7x for
#                     hundreds of steps (a 0.7 ms Trainer step on a 2-core machine, 2026-11-25)
COOLDOWN = 500  # idle steps after a cycle the step time started before it may start another
REFRESH = 64  # idle steps between two computations of the level and its noise (one sort of the window)
NEVER = 2**62  # a count of steps, or a step time in ns, that no run reaches


@dataclass
class Trigger:
    """Why a cycle was started out of the schedule: ``kind`` is ``request`` or ``anomaly``."""

    kind: str
    reason: str
    active: int | None = None  # the recorded steps asked for (None: the schedule's)
    request_id: str | None = None

    def text(self) -> str:
        return f"{self.kind}: {self.reason}" if self.reason else self.kind


class StepWatch:
    """The step time between cycles: its level (median) and noise over the last ``window`` idle steps, and whether
    the last ``sustain`` steps all lie beyond it (``fires``: whether that starts a cycle)."""

    def __init__(self, window: int = WINDOW, sustain: int = SUSTAIN, cooldown: int = COOLDOWN, fires: bool = True) -> None:
        self.sustain, self.cooldown, self.fires = sustain, cooldown, fires
        self.times: deque[float] = deque(maxlen=window)
        self.level: float | None = None  # median step time (s) of the window, refreshed every ``REFRESH`` steps
        self.count = 0  # idle steps added
        self.limit = float("inf")  # a step slower than this is beyond the noise
        self.slow = 0  # steps in a row beyond the limit
        self.since: int | None = None  # the first of them
        self.quiet = 0  # steps left before a jump may start a cycle again
        self.before: float | None = None  # the level before the last jump (a return to it is noted)
        self.notes: list[str] = []

    def add(self, step: int, seconds: float) -> str | None:
        """One idle step's time; the reason for a cycle when the step time has jumped."""
        self.times.append(seconds)
        if self.quiet:
            self.quiet -= 1
        self.count += 1
        if self.level is None or self.count % REFRESH == 0:
            self._refresh(step)
        if seconds <= self.limit:
            self.slow, self.since = 0, None
            return None
        self.slow += 1
        self.since = step if self.since is None else self.since
        if self.slow < self.sustain or self.quiet or self.level is None or not self.fires:
            return None
        recent = list(self.times)[-self.sustain:]
        ratio = statistics.median(recent) / self.level
        reason = (f"step time {ratio:.1f}x its median of the last {len(self.times) - self.sustain} steps "
                  f"({self.level * 1e3:.3g} ms) since step {self.since}")
        self.before, self.quiet = self.level, self.cooldown
        self.times.clear()  # the new level is learnt afresh
        self.level, self.limit, self.slow, self.since = None, float("inf"), 0, None
        return reason

    def add_all(self, first: int, seconds: list[float]) -> str | None:
        """``add`` for the steps from ``first`` on: at once for the steps up to the next refresh where none is slow."""
        done = 0
        while done < len(seconds):
            chunk = seconds[done:done + REFRESH - 1 - self.count % REFRESH]  # (the refresh's own step: ``add``)
            if self.level is not None and chunk and max(chunk) <= self.limit:
                self.times.extend(chunk)
                self.count += len(chunk)
                self.quiet = max(self.quiet - len(chunk), 0)
                self.slow, self.since = 0, None
                done += len(chunk)
                continue
            reason = self.add(first + done, seconds[done])
            done += 1
            if reason is not None:
                return reason
        return None

    def limit_ns(self) -> int:
        """The step time (ns) beyond which a step counts towards a jump (``NEVER`` while none can)."""
        return int(self.limit * 1e9) if self.fires and self.level is not None else NEVER

    def _refresh(self, step: int) -> None:
        if len(self.times) < MIN_STEPS:
            return
        values = sorted(self.times)
        n = len(values)
        level = values[n // 2]
        spread = (values[(3 * n) // 4] - values[n // 4]) / 1.349  # the interquartile range's standard deviation
        if self.level is None and self.before is not None and abs(level - self.before) <= 0.15 * self.before:
            self.notes.append(f"step {step}: the step time is back at {level * 1e3:.3g} ms, its level before the "
                              "last jump")
            self.before = None
        self.level, self.limit = level, level + max(NOISE * spread, MIN_JUMP * level, MIN_JUMP_S)

    def idle_s(self) -> float | None:
        """What an idle step takes: the level, or before it is known the fastest idle step seen (None: none)."""
        return self.level if self.level is not None else min(self.times, default=None)

    def reset_clock(self) -> None:
        """Steps after a cycle start afresh (the cycle's own steps and its writing are no idle steps)."""
        self.slow, self.since = 0, None


class RequestBox:
    """The requests ``python -m fxprof_lightning trigger DIR`` leaves in ``dirpath``; rank 0 only. A daemon thread
    looks at the directory once a second (``look``) and raises ``flagged``; the step reads the request (``take``)."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        self.folder, self.path = str(dirpath), str(dirpath / REQUEST_FILE)
        self.changed: int | None = None  # the directory's mtime when last looked into
        self.taken: set[str] = set()  # the ids of the requests answered
        self.flagged = True  # a request may be there: read it at the next batch (one may be there before the run)
        self.poke: Callable[[], None] | None = None  # told when ``flagged`` is raised (an idle stretch batches at once)
        self._stop = threading.Event()
        threading.Thread(target=_look_for_requests, args=(weakref.ref(self), self._stop), daemon=True,
                         name="fxprof-requests").start()

    def look(self) -> None:
        """(The thread.) One ``os.stat`` of the directory: a request file appears in it by ``os.replace``, which
        changes its mtime; ``flagged`` after a change, or within 2 s of one (file systems whose mtimes are coarse)."""
        try:
            changed = os.stat(self.folder).st_mtime_ns
        except OSError:
            return
        if changed != self.changed or time.time_ns() - changed <= 2_000_000_000:
            self.changed, self.flagged = changed, True
            poke = self.poke
            if poke is not None:
                poke()

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> Trigger | None:
        """A new request, if one came (called where ``flagged``)."""
        self.flagged = False
        try:
            with open(self.path) as file:
                request = json.load(file)
            os.unlink(self.path)
        except (OSError, ValueError):
            return None
        if not isinstance(request, dict) or str(request.get("id", "")) in self.taken:
            return None
        self.taken.add(str(request.get("id", "")))
        active = request.get("active")
        return Trigger("request", str(request.get("reason") or "from the command line"),
                       active if isinstance(active, int) and active >= 1 else None, str(request.get("id", "")))

    def answer(self, trigger: Trigger, cycle: str, steps: list[int]) -> None:
        _append(answer_file(self.dirpath), {"id": trigger.request_id, "cycle": cycle, "steps": steps,
                                            "reason": trigger.reason})


def _look_for_requests(box: weakref.ref[RequestBox], stop: threading.Event) -> None:
    """The request thread: ``RequestBox.look`` once a second until the box is stopped or gone."""
    while not stop.wait(POLL_S):
        found = box()
        if found is None:
            return
        found.look()
        del found


def answer_file(dirpath: Path) -> Path:
    return dirpath / ANSWERS_FILE


class Follow:
    """What starts cycles out of the schedule (``tick`` at the end of each idle training step; see the module)."""

    def __init__(self, anomalies: bool, rank: int, world_size: int, budget: float | None = None,
                 warn: Callable[[str], None] = print) -> None:
        self.warn, self.told_absent = warn, False
        self.watch = StepWatch(fires=anomalies)
        self.rank, self.world_size, self.budget = rank, world_size, budget
        self.started = time.monotonic()
        self.cost_s, self.costed = 0.0, 0  # what the cycles so far cost, and how many (``closed``)
        self.setup_s = 0.0  # profiling's time outside cycles: the capture made ready (Dynamo's first use imports ~0.5 s)
        self.idle_ns = 0  # and its time in the idle steps between cycles (``idle.IdleSteps``, ``Engine.begin_step``...)
        self.opened: tuple[int, int] | None = None  # (perf_counter_ns, step) where the open cycle began
        self.box: RequestBox | None = None
        # (perf_counter_ns) the ends of the idle steps since the last batch, after the end of the step before them
        # when it was idle; one list for the run (``idle.IdleSteps`` appends to it)
        self.ends: list[int] = []
        self.every, self.countdown = 20, 20  # steps between the ranks' agreements (several ranks)
        self.pending: Trigger | None = None  # decided on rank 0, told to the others at the next agreement

    def start(self, dirpath: Path) -> None:
        """The run begins (rank 0 writes the job file a request is checked against, and looks for requests)."""
        self.ends.clear()
        if self.rank == 0:
            self.box = RequestBox(dirpath)
            job = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "ended": None}
            with contextlib.suppress(OSError):
                dirpath.mkdir(parents=True, exist_ok=True)
                _write(dirpath / JOB_FILE, job)

    def end(self, dirpath: Path) -> None:
        self.stop()
        if self.rank == 0:
            path = dirpath / JOB_FILE
            with contextlib.suppress(OSError, ValueError):
                job = json.loads(path.read_text())
                if job.get("pid") == os.getpid():
                    _write(path, {**job, "ended": time.time()})

    def stop(self) -> None:
        """No more requests are looked for (the run ended or stopped)."""
        if self.box is not None:
            self.box.stop()

    def tick(self, step: int) -> Trigger | None:
        """The end of idle training step ``step``; a trigger when a cycle should start now (every rank the same).

        Each call only notes the time; every ``BATCH`` steps (2-4 us a step less, caches cold) the steps' times go
        to the watch and, if the request thread raised its flag, rank 0 reads the request."""
        self.ends.append(time.perf_counter_ns())
        return self.noted(step, 1, len(self.ends) > BATCH)

    def noted(self, step: int, count: int, batch: bool) -> Trigger | None:
        """``count`` idle steps, the last ``step``, whose ends are in ``ends``: with ``batch`` their times go to the
        watch (and a flagged request is read); a trigger when a cycle should start now (every rank the same)."""
        if batch:
            self._batch(step)
        if self.world_size == 1:
            if self.pending is None:
                return None
            found, self.pending = self.pending, None
            return found
        self.countdown -= count
        if self.countdown > 0:
            return None
        return self._agree()

    def room(self) -> int:
        """How many idle steps may end before ``noted`` must be told (the ranks' next agreement; one rank: ``NEVER``)."""
        return self.countdown if self.world_size > 1 else NEVER

    def asked(self) -> bool:
        """Whether the request thread raised its flag and no trigger waits: the next step should ``noted`` a batch."""
        return self.box is not None and self.box.flagged and self.pending is None

    def _batch(self, step: int) -> None:
        """The times of the idle steps up to ``step`` to the watch; a request looked for (rank 0)."""
        ends = self.ends[:]
        del self.ends[:-1]  # (in place: the list is shared)
        if self.rank != 0 or self.pending is not None:
            return
        if len(ends) > 1:
            reason = self.watch.add_all(step - len(ends) + 2, [(b - a) / 1e9 for a, b in itertools.pairwise(ends)])
            if reason is not None:
                self.pending = Trigger("anomaly", reason)
        while self.watch.notes:  # (a return to the level before a jump)
            self._index({"note": self.watch.notes.pop(0)})
        if self.box is not None and self.pending is None and self.box.flagged:
            self.pending = self.box.take()

    def open(self, step: int) -> None:
        """A training cycle opens at ``step`` (its cost is measured from here to the end of ``closed``)."""
        self.opened = (time.perf_counter_ns(), step)

    def closed(self, step: int, report: Any) -> None:
        """The training cycle opened last ended at ``step``, its report written by the sinks: what it cost over the
        idle steps it took the place of goes into ``report.cost_s``, the run's total and, on rank 0, the run's index
        of cycles (``fxprof_cycles.jsonl``)."""
        if self.opened is None:
            return
        (start, first), self.opened = self.opened, None
        cost = max((time.perf_counter_ns() - start) / 1e9 - (step - first + 1) * (self.watch.idle_s() or 0.0), 0.0)
        self.cost_s, self.costed = self.cost_s + cost, self.costed + 1
        report.cost_s = cost
        if report.directory is not None:
            self._index({"cycle": report.directory.name, "trigger": report.trigger, "steps": report.steps,
                         "cost_s": round(cost, 4), "setup_s": round(self.setup_s, 4), "idle_s": round(self.idle_ns / 1e9, 4),
                         "run_share": round(self.share(), 5)})

    def absent(self, cycles: list[int], why: str, warned: bool = False) -> None:
        """Training cycles the schedule selected that have no report, and why: a line each in the run's index (rank 0);
        a warning the first time, unless ``warned`` (a budget that leaves cycles out leaves many)."""
        for index in cycles:
            self._index({"absent": f"cycle {index}", "why": why})
        if cycles and not warned and not self.told_absent:
            self.told_absent = True
            self.warn(f"cycle {cycles[0]} has no report: {why} (every such cycle is named in {INDEX_FILE})")

    def _index(self, line: dict[str, Any]) -> None:
        """A line of the run's index of cycles and notes (rank 0)."""
        if self.box is not None:
            _append(self.box.dirpath / INDEX_FILE, line)

    def share(self) -> float:
        """What profiling cost so far (``spent_s``), as a share of the wall time since the run began."""
        return self.spent_s() / max(time.monotonic() - self.started, 1e-9)

    def spent_s(self) -> float:
        """What profiling cost so far: its cycles, ``setup_s`` and its time in the idle steps."""
        return self.cost_s + self.setup_s + self.idle_ns / 1e9

    def idle_time(self, started: int) -> None:
        """The time since ``started`` (``perf_counter_ns``; no cycle open then) was profiling's, in an idle training
        step: to ``idle_ns``, up to where a cycle opened since (that cycle's cost holds the rest)."""
        self.idle_ns += (self.opened[0] if self.opened is not None else time.perf_counter_ns()) - started

    def held(self) -> int:
        """0 where a scheduled cycle may run within ``budget`` (what profiling spent so far and one more cycle, at their
        mean cost, within that share of the wall time since the run began); else about how many steps until one may, at
        the idle steps' pace (at least 1). Every rank gets rank 0's answer: call it where every rank is, at a cycle's
        first step."""
        expected = self.cost_s / self.costed if self.costed else 0.0
        elapsed = max(time.monotonic() - self.started, 1e-9)
        wait_s = (self.spent_s() + expected) / self.budget - elapsed if self.budget is not None else 0.0
        idle_s = self.watch.idle_s()
        held = 0 if wait_s <= 0 else max(1, int(wait_s / idle_s)) if idle_s else 1
        if self.world_size > 1:
            import torch.distributed as dist

            message = [held]
            dist.broadcast_object_list(message, src=0)
            held = message[0]
        return held

    def answered(self, trigger: Trigger, cycle: str, steps: list[int]) -> None:
        """The cycle that answers a request (rank 0 writes it where the ``trigger`` command waits for it)."""
        if self.box is not None and trigger.request_id is not None:
            self.box.answer(trigger, cycle, steps)
            trigger.request_id = None

    def skip(self) -> None:
        """A step that was not idle (a cycle's): the next step's time is not measured from its end (the idle steps
        noted since the last batch are left out too)."""
        self.ends.clear()
        self.watch.reset_clock()

    def _agree(self) -> Trigger | None:
        """Every rank at the same step: rank 0's decision and the steps until the next agreement (about a second)."""
        import torch.distributed as dist

        every = self.every
        if self.rank == 0 and self.watch.level:
            every = max(1, min(1000, round(1.0 / max(self.watch.level, 1e-6))))
        message: list[Any] = [(self.pending, every)]
        dist.broadcast_object_list(message, src=0)
        found, self.every = message[0]
        self.countdown, self.pending = self.every, None
        return found


def _write(path: Path, value: dict[str, Any]) -> None:
    """Write JSON so that a reader never sees half of it."""
    partial = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(value))
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


def _append(path: Path, line: dict[str, Any]) -> None:
    """One JSON line at the end of ``path`` (the job's files beside its cycles: never an error in training)."""
    with contextlib.suppress(OSError), path.open("a") as out:
        out.write(json.dumps(line) + "\n")


def write_request(dirpath: Path, request: dict[str, Any]) -> None:
    _write(dirpath / REQUEST_FILE, request)


def request_cycle(dirpath: Path, active: int | None, reason: str, timeout_s: float) -> tuple[str, int]:
    """``python -m fxprof_lightning trigger DIR``: ask the job writing ``dirpath`` for a cycle and wait until it says
    which cycle answers. Returns the text to print and the exit status (0 answered, 1 no job or no answer, 2 no
    profiled job ever ran there, or the request could not be written)."""
    job_path = dirpath / JOB_FILE
    try:
        job = json.loads(job_path.read_text())
    except (OSError, ValueError):
        return (f"no profiled job ever ran with its output in {dirpath} (no {JOB_FILE} there): give the run's dirpath, "
                "the directory that holds its cycle_NNNN directories"), 2
    gone = _gone(job)
    if gone:
        return gone, 1
    asked = f"{os.getpid()}-{time.time_ns()}"
    try:
        write_request(dirpath, {"id": asked, "active": active, "reason": reason, "asked": time.time()})
    except OSError as error:
        return f"could not write the request into {dirpath}: {error}", 2
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in read_lines(answer_file(dirpath)):
            if line.get("id") == asked:
                steps = line.get("steps") or []
                span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no step"
                return (f"{line.get('cycle')} answers the request: it records {span} "
                        f"(in {dirpath / str(line.get('cycle'))})"), 0
        with contextlib.suppress(OSError, ValueError):
            gone = _gone(json.loads(job_path.read_text()))
        if gone:
            (dirpath / REQUEST_FILE).unlink(missing_ok=True)
            return f"{gone} before it answered", 1
        time.sleep(0.1)
    return (f"the job (pid {job.get('pid')} on {job.get('host')}) has not answered in {timeout_s:g} s: it looks for a "
            f"request between training steps, every {POLL_S:g} s at most, so a step longer than that (or a paused "
            "job) answers later; the request stays"), 1


def _gone(job: dict[str, Any]) -> str | None:
    """Why the job of ``job`` cannot answer (None: it may)."""
    if job.get("ended") is not None:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["ended"]))
        return f"the job (pid {job.get('pid')}) that wrote there ended at {ended}"
    pid = job.get("pid")
    if job.get("host") == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"the job (pid {pid}) that wrote there is no longer running"
        except PermissionError:
            pass
    return None


def read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return found
