"""How far a cycle's numbers can be trusted: load from other processes, told apart from a real slowdown.

Per-node times measured while other processes compete for the cores are inflated, and by
different amounts for different nodes. Load has a signature, computed from the wall time and the
process CPU time of each recorded step (``CycleReport.step_ms``, ``step_cpu_ms``; their figures, ``step_spread``,
``cpu_per_wall`` and ``waited_share``, are the report's) and from the nodes:

- the **spread** of the recorded steps, ``(slowest - fastest) / median``: steps of one training
  run do the same work, so a spread above ``SPREAD_LIMIT`` (50 %) means something else ran, when the slowest step
  took at least ``SPREAD_FLOOR_MS`` (1 ms) longer than the fastest: another process takes a core for a scheduler
  time slice (Linux's base slice is 0.75 ms), while a step of under a millisecond varies by half of itself alone
  (first-touch pages, cache misses; in a CI run every cycle of a 0.5 ms step was called distorted, 2026-11-27);
- a **jump** of the cycle's median step time to more than ``JUMP_LIMIT`` (2x) the median of the
  earlier cycles, or a drop of ``cpu_per_wall`` (CPU seconds per wall second, all threads) below
  ``CPU_DROP`` (0.6x) of the earlier cycles' (the process waited for cores), *with the nodes slower
  in proportion*: their median slowdown (``regressions.shared_factor``) at least ``SHARED_LOAD``
  (1.5x) and at least half the step's. A step that got slower because a few nodes did is no load:
  it shows as the regression of those nodes, however large.

Where Linux keeps scheduler statistics (``/proc/self/task/<id>/schedstat``: the time each thread of this process was
ready to run and waited for a core), the share of the recorded steps' wall time this process's threads spent so
(``step_wait_ms``; the training thread and torch's native threads, ``_ThreadFiles``) replaces the jump and the CPU-per-wall drop: above ``WAIT_LIMIT`` (30 %) and twice the earlier
sound cycles' is load, whatever the nodes did (on a quiet machine it is 0-4 %; with two DataLoader workers busy on
two cores, 17-35 % in every cycle: the job's own steady load, whose cycles compare with each other). Another process
that takes the core an intra-op thread needs makes one matmul wait a scheduler slice (8 ms each call, in an
identical run of 2026-11-27, where the other rows did not move: no "in proportion" would have told it). A process
that waits 30 ms for its data leaves its intra-op threads asleep, not waiting: every node after the wait runs up to
2x slower, with no thread waiting for a core (the step's data phase is then what the watch flags). The machine-wide
CPU pressure (``/proc/pressure/cpu``) said load there too, when any task of the machine waited; it is not read.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

from fxprof_lightning.report import step_spread

__all__ = ["CPU_DROP", "JUMP_LIMIT", "SHARED_LOAD", "SPREAD_FLOOR_MS", "SPREAD_LIMIT", "WAIT_LIMIT", "distortion",
           "threads_waited_ns", "waited_ms", "waited_out"]

SPREAD_LIMIT = 0.5
SPREAD_FLOOR_MS = 1.0
JUMP_LIMIT = 2.0
CPU_DROP = 0.6
SHARED_LOAD = 1.5
WAIT_LIMIT = 0.3
_TASKS = "/proc/self/task"
REFRESH_S = 1.0  # the process's threads are listed again after this long (a thread started since is read from then on)


class _ThreadFiles:
    """Each thread's ``schedstat`` file, kept open: a read is then about 1 us a thread (opening it each time, 7).

    The threads read are those that do the step's work: the one that asks (the training loop's) and the native
    threads (torch's intra-op pool). The process's other Python threads are left out: a logger's writer or our
    request thread that wakes while the step keeps both cores busy waits for one, without slowing the step (a
    TensorBoard writer's thread waited 2 ms in one recorded step of a quiet Lightning fit on 2 cores, 41 % of it).
    """

    def __init__(self) -> None:
        self.pid, self.files, self.others = 0, {}, set()  # thread id -> open file; other Python threads' ids
        self.listed: float | None = None  # when the threads were last listed (``time.monotonic``)

    def refresh(self) -> bool:
        """Opens the files of threads started since, closes those of threads that ended, at most once every
        ``REFRESH_S`` seconds (listing them costs ~17 us, more than reading them); False where there are none."""
        now = time.monotonic()
        if self.listed is not None and now - self.listed < REFRESH_S and self.pid == os.getpid():
            return bool(self.files)
        self.listed = now
        try:
            threads = set(os.listdir(_TASKS))
        except OSError:
            return False
        if self.pid != os.getpid():  # (a forked child: the files it inherited are its parent's threads')
            self.pid, closing, self.others = os.getpid(), set(self.files), set()
        else:
            closing = set(self.files) - threads  # (threads that ended)
        for thread in closing:
            os.close(self.files.pop(thread))
        started = threads - set(self.files) - self.others
        if started:
            caller = threading.current_thread()
            self.others = (self.others & threads) | (started & {str(t.native_id) for t in threading.enumerate()
                                                                  if t is not caller})
        for thread in started - self.others:
            try:
                self.files[thread] = os.open(f"{_TASKS}/{thread}/schedstat", os.O_RDONLY)
            except OSError:
                continue  # (a thread that ended meanwhile)
        return True

    def read(self) -> dict[str, int] | None:
        waited, ran = {}, 0
        for thread, file in self.files.items():
            try:
                fields = os.pread(file, 128, 0).split()
                ran, waited[thread] = ran + int(fields[0]), int(fields[1])
            except (OSError, IndexError, ValueError):
                continue  # (a thread that ended since the refresh)
        return waited if ran else None


_THREADS = _ThreadFiles()


def threads_waited_ns() -> dict[str, int] | None:
    """Nanoseconds each thread of this process (by id) has waited for a core since it started, or None where Linux
    does not say (``/proc/self/task/<id>/schedstat``, its second field; all zero where the kernel keeps no
    scheduler statistics). About 10 us with three threads.

    >>> waited = threads_waited_ns()
    >>> waited is None or all(ns >= 0 for ns in waited.values())
    True
    """
    return _THREADS.read() if _THREADS.refresh() else None


def waited_ms(before: dict[str, int] | None) -> float | None:
    """Milliseconds the process's threads waited for a core since ``threads_waited_ns`` read ``before`` (the same
    threads: one started since is not counted), or None without a reading.

    >>> before = threads_waited_ns()
    >>> before is None or waited_ms(before) >= 0
    True
    """
    now = _THREADS.read() if before is not None else None
    return None if now is None else sum(ns - before[thread] for thread, ns in now.items() if thread in before) / 1e6


def distortion(step_ms: list[float], earlier_medians: list[float], shared: float = 1.0,
               cpu: float | None = None, earlier_cpu: list[float] = (), wait: float | None = None,
               earlier_wait: list[float] = ()) -> str | None:
    """Why a cycle's numbers look distorted by other load, or None when they look sound.

    ``earlier_medians`` are the median step times of the run's earlier sound cycles, ``earlier_cpu``
    their ``cpu_per_wall``; ``cpu`` is this cycle's; ``shared`` how much slower its nodes ran as a
    whole than in those cycles (``regressions.shared_factor``); ``wait`` this cycle's ``waited_share`` (the
    process's threads waiting for a core) where the machine reports it: then it decides, and neither the jump nor
    the CPU-per-wall drop is asked. ``earlier_wait``, the earlier cycles', is printed beside it.

    >>> distortion([10.0, 10.5, 10.2], [10.1]) is None
    True
    >>> distortion([10.0, 31.0, 10.2], [])
    'its recorded steps took 10.0 to 31.0 ms (spread 206% of the median, limit 50%)'
    >>> distortion([0.4, 0.8, 0.5], []) is None  # under a millisecond apart: the step's own variation
    True
    >>> distortion([30.0, 30.2, 30.1], [10.0], shared=1.02) is None  # a few nodes got slower: their regression
    True
    >>> distortion([30.0, 30.2, 30.1], [10.0], shared=2.9)
    "its median step took 30.1 ms, 3.0x the earlier cycles' 10.0 ms, with its nodes 2.9x slower as a whole"
    >>> distortion([40.0, 40.2], [10.0], shared=1.6, cpu=0.5, earlier_cpu=[1.9], wait=0.01, earlier_wait=[0.01])
    >>> distortion([15.0, 15.2], [10.0], shared=1.0, cpu=1.0, earlier_cpu=[1.9], wait=0.55, earlier_wait=[0.02])
    'its threads waited for a core 55% of its recorded steps (limit 30%, and 2x the 2% of the sound cycles before)'
    >>> distortion([15.0, 15.2], [14.0], wait=0.35, earlier_wait=[0.25, 0.3])  # the job's own steady load (workers)
    """
    reasons = []
    spread = step_spread(step_ms)
    if spread is not None and spread > SPREAD_LIMIT and max(step_ms) - min(step_ms) >= SPREAD_FLOOR_MS:
        reasons.append(f"its recorded steps took {min(step_ms):.1f} to {max(step_ms):.1f} ms "
                       f"(spread {100 * spread:.0f}% of the median, limit {100 * SPREAD_LIMIT:.0f}%)")
    jump = 1.0
    if step_ms and earlier_medians:
        now, before = statistics.median(step_ms), statistics.median(earlier_medians)
        jump = now / before if before > 0 else 1.0
    in_proportion = shared >= SHARED_LOAD and shared >= 1 + (jump - 1) / 2
    if jump > JUMP_LIMIT and in_proportion and wait is None:  # (where the threads' wait is known, it decides)
        reasons.append(f"its median step took {now:.1f} ms, {jump:.1f}x the earlier cycles' {before:.1f} ms, "
                       f"with its nodes {shared:.1f}x slower as a whole")
    if wait is not None:
        before_wait = statistics.median(earlier_wait) if earlier_wait else 0.0
        if wait > max(WAIT_LIMIT, 2 * before_wait):
            reasons.append(f"its threads waited for a core {100 * wait:.0f}% of its recorded steps (limit "
                           f"{100 * WAIT_LIMIT:.0f}%, and 2x the {100 * before_wait:.0f}% of the sound cycles before)")
    elif cpu is not None and earlier_cpu and shared >= SHARED_LOAD:
        before_cpu = statistics.median(earlier_cpu)
        if before_cpu > 0 and cpu < CPU_DROP * before_cpu:
            reasons.append(f"the process got {cpu:.2f} CPU s per wall s, {before_cpu:.2f} in the earlier cycles "
                           f"(it waited for cores), with its nodes {shared:.1f}x slower as a whole")
    return "; ".join(reasons) or None


def waited_out(added_ms: float, wait: float | None, earlier_wait: list[float], step_ms: float) -> bool:
    """Whether load explains a slower row in a cycle that is not distorted as a whole: its threads waited for a core
    at least half the row's added time (``added_ms`` per step) longer per step than in the sound cycles before.
    ``wait`` and ``earlier_wait`` are shares of the step (``waited_share``; None where Linux does not say), ``step_ms``
    the cycle's median step. A parallel op whose second thread waits for a core holds the first at its end: one conv's
    backward was 3.4x slower in every call of a cycle of the README's example beside another process (2026-11-28),
    with its threads waiting under 30 % of the steps.

    >>> waited_out(2.6, wait=0.16, earlier_wait=[0.01, 0.01], step_ms=12.6)  # 1.9 ms a step more: load
    True
    >>> waited_out(2.6, wait=0.02, earlier_wait=[0.01], step_ms=12.6) or waited_out(2.6, None, [], 12.6)
    False
    """
    return wait is not None and (wait - statistics.median(earlier_wait or [0.0])) * step_ms >= added_ms / 2
