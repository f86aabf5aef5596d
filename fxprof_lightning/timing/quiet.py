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
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["USER_SETTING", "is_routine_kineto_line", "quiet_kineto"]

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
