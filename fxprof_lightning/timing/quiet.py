"""Keep kineto's log lines about our own profiler sessions off the user's console.

Each time a profiler session starts or stops, kineto (torch.profiler's C++ side) writes lines
such as ``USDT:... SyncActivityProfilerHandler.cpp:39] profiler_start`` and, on a machine
without a GPU driver, ``ERROR:... DeviceProperties.cpp:56] gpuGetDeviceCount failed with code
35`` straight to file descriptor 2, from C++. No Python logging setting reaches them, nor
``TORCH_CPP_LOG_LEVEL`` or glog's variables; ``KINETO_LOG_LEVEL`` does (6 silences all, 5 all
but ``USDT``), but kineto reads it only once, when the process's first profiler session starts,
and for the whole process: setting it for the user would silence their own sessions too, and
does nothing once any profiler has run.

So ``quiet_kineto()`` is worn only around the calls that start, step and stop our sessions:
it points descriptor 2 at a temporary file for the call, then writes back to the real
descriptor 2 everything the call printed except kineto's routine lines (levels VERBOSE, INFO,
STAGE, USDT, and the device-count error of a machine without a GPU driver). Python's own
messages, the user's, and kineto's other warnings and errors (a trace that lost its GPU
activity, say) still appear, in the order they were written. A user who set
``KINETO_LOG_LEVEL`` chose what kineto prints: then nothing is filtered.

``quiet_dynamo(kept)`` does the same for Dynamo, around our captures (``DynamoTimer``'s calls that capture,
check and time through Dynamo): what Dynamo, Inductor and torch.fx say there (a graph break's ``Tensor.item()``
hint from ``nn.Transformer``'s causal-mask check, a recompile) is about our capture, not the user's training, so
it goes into ``kept`` (the capture's record, ``Capture.dynamo_messages``) instead of the console:

* records of the ``torch._dynamo``, ``torch._inductor`` and ``torch.fx.experimental.symbolic_shapes`` loggers
  (and their children), held back by a filter on the handlers they reach (torch's own stderr handler), for the
  calling thread only. A user who turned Dynamo's logs on (``TORCH_LOGS`` set, or one of those loggers' level set
  below WARNING, as ``torch._logging.set_logs`` does) chose to see them: then the logs are left alone;
* Python warnings whose ``warnings.warn`` call is in ``torch._dynamo``, ``torch._inductor`` or ``torch.fx``, held
  back by a ``warnings.showwarning`` of ours for the block (not ``catch_warnings``, whose exit resets every
  module's once-registry, so the user's own warnings would show again after each capture). Every other warning
  (the user's, the package's ``FxprofWarning``) goes on to the ``showwarning`` that was there, as before.

Dynamo's messages in the user's own ``torch.compile``, outside our captures (or in another thread), still show.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from typing import Any, BinaryIO

__all__ = ["DYNAMO_LOGGERS", "DYNAMO_MODULES", "USER_SETTING", "dynamo_logs_chosen_by_user", "hold_dynamo_filters",
           "is_routine_kineto_line", "quiet_dynamo", "quiet_kineto", "release_dynamo_filters"]

# The environment variable by which a user sets what kineto prints; when set, we leave stderr alone.
USER_SETTING = "KINETO_LOG_LEVEL"
# kineto's line: LEVEL:YYYY-MM-DD HH:MM:SS pid:tid File.cpp:line] message
_KINETO_LINE = re.compile(rb"^(VERBOSE|INFO|WARNING|STAGE|ERROR|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ [^\s\]]+:\d+\]")
_ROUTINE_LEVELS = {b"VERBOSE", b"INFO", b"STAGE", b"USDT"}
# Errors that only say the machine has no GPU (CUDA's, or ROCm's, device count on a host without a driver).
_NO_GPU_ERROR = re.compile(rb"\b(gpu|cuda|hip)GetDeviceCount failed\b", re.IGNORECASE)
_STDERR = 2

_lock = threading.RLock()
_depth = 0  # > 0 while descriptor 2 points at a capture (a nested quiet_kineto adds nothing)
_capture: tuple[int, BinaryIO] | None = None  # (pid, file) of the capture file, made on first use


def is_routine_kineto_line(line: bytes) -> bool:
    """Whether ``line`` is one of kineto's routine log lines, which ``quiet_kineto`` drops."""
    match = _KINETO_LINE.match(line)
    if match is None:
        return False
    return match.group(1) in _ROUTINE_LEVELS or _NO_GPU_ERROR.search(line) is not None


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Drop kineto's routine lines from what the enclosed code writes to descriptor 2.

    Wrap only short calls into the profiler (start, step, stop): whatever else the process
    writes to stderr meanwhile (other threads included) is held back until the block ends,
    then written out. Does nothing when the user set ``KINETO_LOG_LEVEL``, or when
    descriptor 2 is not open.
    """
    global _depth
    if USER_SETTING in os.environ:
        yield
        return
    with _lock:
        if _depth:
            yield
            return
        try:
            saved = os.dup(_STDERR)
        except OSError:  # no descriptor 2 (a detached process): nothing reaches a console anyway
            yield
            return
        try:
            capture = _capture_file()
        except OSError:
            os.close(saved)
            yield
            return
        _flush_python_stderr()
        os.dup2(capture.fileno(), _STDERR)
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            _flush_python_stderr()
            os.dup2(saved, _STDERR)
            os.close(saved)
            capture.seek(0)
            written = capture.read()
            kept = b"".join(line for line in written.splitlines(keepends=True) if not is_routine_kineto_line(line))
            _write_all(_STDERR, kept)


def _capture_file() -> BinaryIO:
    """An empty temporary file to capture into, one per process (a forked child makes its own).

    A file, not a pipe: a long message cannot block its writer.
    """
    global _capture
    if _capture is None or _capture[0] != os.getpid():
        _capture = (os.getpid(), tempfile.TemporaryFile())  # noqa: SIM115  (kept for the process's life)
    capture = _capture[1]
    capture.seek(0)
    capture.truncate()
    return capture


def _flush_python_stderr() -> None:
    """Send what Python holds in its stderr buffers to descriptor 2 (before and after a capture)."""
    for stream in {id(s): s for s in (sys.stderr, sys.__stderr__) if s is not None}.values():
        with contextlib.suppress(Exception):
            stream.flush()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except OSError:  # stderr went away: what it would have shown is lost, as it would have been anyway
            return
        data = data[written:]


# ---------------------------------------------------------------- Dynamo's messages about our captures

# The loggers (with their children) whose records inside our captures are kept, not printed.
DYNAMO_LOGGERS = ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes")
# The modules whose warnings inside our captures are kept, not printed.
DYNAMO_MODULES = ("torch._dynamo", "torch._inductor", "torch.fx")
# The environment variable by which a user turns torch's logs on; when set, Dynamo's logs are left alone.
TORCH_LOGS = "TORCH_LOGS"

_dynamo_lock = threading.Lock()
_kept_by_thread: dict[int, list[str]] = {}  # thread id -> where its messages go (its outermost quiet_dynamo's list)
_held: list[tuple[logging.Handler, logging.Filter]] = []  # the filters of ours on handlers, while any block runs
_looked: tuple[bool, list[logging.Handler]] | None = None  # at the last look: (logs chosen by the user, _handlers())
_shown_before: Any = None  # warnings.showwarning before ours
_holds = 0  # > 0: our filters stay on the handlers between blocks (``hold_dynamo_filters``)


def _of(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def dynamo_logs_chosen_by_user() -> bool:
    """Whether the user turned Dynamo's logs on: ``TORCH_LOGS`` set, or one of ``DYNAMO_LOGGERS`` (or a child: an
    artifact such as ``graph_breaks`` turned on by ``torch._logging.set_logs``) set to a level below WARNING."""
    if os.environ.get(TORCH_LOGS):
        return True
    if any(logging.getLogger(name).getEffectiveLevel() < logging.WARNING for name in DYNAMO_LOGGERS):
        return True
    loggers = list(logging.Logger.manager.loggerDict.items())
    return any(isinstance(logger, logging.Logger) and _of(name, DYNAMO_LOGGERS) and not logger.disabled
               and logging.NOTSET < logger.level < logging.WARNING for name, logger in loggers)


def _add(kept: list[str], text: str) -> None:
    text = text.rstrip()
    if text not in kept:
        kept.append(text)


class _KeepDynamoRecords(logging.Filter):
    """On a handler: a record of a Dynamo logger, emitted in a thread inside ``quiet_dynamo``, is kept, not handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        kept = _kept_by_thread.get(threading.get_ident())
        if kept is None or not _of(record.name, DYNAMO_LOGGERS):
            return True
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not fit its message: its raw parts
            text = f"{record.msg} {record.args}"
        _add(kept, f"{record.levelname} {record.name}: {text}")
        return False


def _handlers() -> list[logging.Handler]:
    """The handlers a Dynamo logger's record can reach (torch's stderr handler on ``torch._dynamo``, say; the user's
    own where a logger propagates to them), and logging's last resort (used when none is found)."""
    names = [*DYNAMO_LOGGERS, *(name for name, logger in list(logging.Logger.manager.loggerDict.items())
                                if isinstance(logger, logging.Logger) and logger.handlers and _of(name, DYNAMO_LOGGERS))]
    found: dict[int, logging.Handler] = {}
    for name in names:
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            found.update((id(h), h) for h in logger.handlers)
            logger = logger.parent if logger.propagate else None
    if logging.lastResort is not None:
        found[id(logging.lastResort)] = logging.lastResort
    return list(found.values())


def _warned_in_dynamo(filename: str) -> bool:
    """Whether the warning being shown was raised by ``DYNAMO_MODULES``' code: the first frame above the warnings
    machinery (and this module) is the ``warnings.warn`` call's; or the file it is attributed to is theirs."""
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
            frame = frame.f_back
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    finally:
        del frame
    path = filename.replace(os.sep, "/")
    return _of(caller, DYNAMO_MODULES) or any(f"/{m.replace('.', '/')}/" in path for m in DYNAMO_MODULES)


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """``warnings.showwarning`` while a ``quiet_dynamo`` block runs: Dynamo's warnings in such a block are kept."""
    kept = _kept_by_thread.get(threading.get_ident())
    if kept is not None and _warned_in_dynamo(filename):
        _add(kept, f"{category.__name__} ({os.path.basename(filename)}:{lineno}): {message}")
        return
    shown = _shown_before
    if shown is None or shown is _show_warning:  # (the block ended meanwhile, in another thread): as Python shows it
        with contextlib.suppress(Exception):
            (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    shown(message, category, filename, lineno, file, line)


def _remove_filters() -> None:
    for handler, keeper in _held:
        handler.removeFilter(keeper)
    _held.clear()


def hold_dynamo_filters() -> None:
    """Leave ``quiet_dynamo``'s filters on the handlers between blocks until ``release_dynamo_filters`` (a timer's
    installed span: each timed call's block then only marks its thread, ~10 us less per call). Outside a block the
    filters pass every record (they keep only a record emitted in a thread inside one)."""
    global _holds
    with _dynamo_lock:
        _holds += 1


def release_dynamo_filters() -> None:
    """The end of a ``hold_dynamo_filters``: the filters leave the handlers once no hold and no block is left."""
    global _holds
    with _dynamo_lock:
        _holds = max(_holds - 1, 0)
        if not _holds and not _kept_by_thread:
            _remove_filters()


@contextlib.contextmanager
def quiet_dynamo(kept: list[str], look: bool = True) -> Iterator[None]:
    """Keep what Dynamo says in the enclosed code (its loggers' records, its warnings) in ``kept``, each message once,
    instead of printing it; see the module docstring. Nested blocks of a thread keep into the outermost's list.

    ``look``: find the handlers and whether the user turned Dynamo's logs on anew (a look over every logger, some
    hundred microseconds: at a capture); False, as found at the last look (a timed call: a few microseconds)."""
    global _shown_before, _looked
    thread = threading.get_ident()
    with _dynamo_lock:
        if thread in _kept_by_thread:
            nested = True
        else:
            nested = False
            first = not _kept_by_thread
            _kept_by_thread[thread] = kept
            if first:
                if look or _looked is None:
                    _looked = (dynamo_logs_chosen_by_user(), _handlers())
                    _remove_filters()  # (held since a block before: on the handlers found now instead)
                chosen, handlers = _looked
                if not _held and not chosen and not os.environ.get(TORCH_LOGS):
                    keeper = _KeepDynamoRecords()
                    for handler in handlers:
                        handler.addFilter(keeper)
                        _held.append((handler, keeper))
                _shown_before, warnings.showwarning = warnings.showwarning, _show_warning
    if nested:
        yield
        return
    try:
        yield
    finally:
        with _dynamo_lock:
            del _kept_by_thread[thread]
            if not _kept_by_thread:
                if not _holds:
                    _remove_filters()
                if warnings.showwarning is _show_warning:  # (else someone replaced it since: theirs stays)
                    warnings.showwarning = _shown_before
                _shown_before = None
