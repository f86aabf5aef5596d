"""kineto's log lines about our own profiler sessions stay off the console; everything else still shows.

kineto writes ``USDT:... profiler_start``/``profiler_stop`` and, on a machine without a GPU driver,
``ERROR:... gpuGetDeviceCount failed`` to descriptor 2 from C++ at each session start and stop, so
the check runs real trainings in a subprocess and reads its stderr:

* with the user's environment free of ``KINETO_LOG_LEVEL``, a run that writes traces (torch.profiler
  sessions) and a run with node timing only (the engine's backward-event sessions) print no kineto
  line, while what the user's ``training_step`` writes to stderr, through Python or straight to the
  descriptor, still appears, once per step;
* with ``KINETO_LOG_LEVEL`` set by the user, stderr is left alone: kineto's lines at that level show.

``quiet_kineto`` itself is also checked in this process on hand-written lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxprof_lightning.timing.quiet import USER_SETTING, is_routine_kineto_line, quiet_kineto

TESTS = Path(__file__).resolve().parent
KINETO_MARKS = ("USDT:", "gpuGetDeviceCount", "SyncActivityProfilerHandler", "Completed Stage")
STEPS = 4

SCRIPT = textwrap.dedent(
    f"""
    import os, sys
    sys.path.insert(0, {str(TESTS)!r})
    from helpers import LitClassifier, image_loader, make_trainer
    from fxprof_lightning import FXProfilerCallback

    class Noisy(LitClassifier):
        def training_step(self, batch, batch_idx):
            print(f"USER-PY step {{self.global_step}}", file=sys.stderr, flush=True)
            os.write(2, f"USER-FD step {{self.global_step}}\\n".encode())
            return super().training_step(batch, batch_idx)

    root = sys.argv[1]
    for name, settings in (("traces", {{}}), ("fx-only", {{"torch_profiler": False}})):
        print(f"=== {{name}}", file=sys.stderr, flush=True)
        callback = FXProfilerCallback(wait=0, warmup=1, active=2, repeat=1, module="model", **settings)
        trainer = make_trainer(os.path.join(root, name), [callback], max_steps={STEPS}, logger=False)
        trainer.fit(Noisy(), image_loader())
        cycle = callback.cycles[-1]
        print(f"RESULT {{name}} nodes={{len(cycle.nodes)}} traces={{len(cycle.trace_paths)}}", flush=True)
        print(f"=== {{name}} done", file=sys.stderr, flush=True)
    """
)


def train(tmp_path: Path, user_level: str | None) -> tuple[str, dict[str, str]]:
    """Run SCRIPT; its stdout, and its stderr cut into the two runs' parts."""
    env = {k: v for k, v in os.environ.items() if k != USER_SETTING}
    if user_level is not None:
        env[USER_SETTING] = user_level
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-5000:]
    parts = {}
    for name in ("traces", "fx-only"):
        start, end = done.stderr.index(f"=== {name}\n"), done.stderr.index(f"=== {name} done\n")
        parts[name] = done.stderr[start:end]
    return done.stdout, parts


def kineto_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(mark in line for mark in KINETO_MARKS)]


def test_no_kineto_lines_and_the_users_stderr_still_shows(tmp_path: Path) -> None:
    stdout, parts = train(tmp_path, user_level=None)
    assert "RESULT traces nodes=6 traces=1" in stdout and "RESULT fx-only nodes=6 traces=0" in stdout
    for name, text in parts.items():
        assert kineto_lines(text) == [], f"{name}: kineto lines on stderr"
        for step in range(STEPS):  # the user's lines, recorded steps included, each once
            assert text.count(f"USER-PY step {step}\n") == 1, (name, step, text)
            assert text.count(f"USER-FD step {step}\n") == 1, (name, step, text)


def test_the_users_kineto_log_level_is_respected(tmp_path: Path) -> None:
    # Level 3 (STAGE) shows kineto's stage lines and its USDT and ERROR lines: none of them may be hidden.
    stdout, parts = train(tmp_path, user_level="3")
    assert "RESULT traces nodes=6 traces=1" in stdout
    lines = kineto_lines(parts["traces"])
    assert any("profiler_start" in line for line in lines) and any("profiler_stop" in line for line in lines), lines
    assert any("Completed Stage" in line for line in lines), lines
    for step in range(STEPS):
        assert parts["traces"].count(f"USER-PY step {step}\n") == 1


@pytest.mark.parametrize(
    ("line", "routine"),
    [
        (b"USDT:2026-11-23 18:10:14 4890:4890 SyncActivityProfilerHandler.cpp:39] profiler_start\n", True),
        (b"STAGE:2026-11-23 18:11:16 6061:6061 Logger.cpp:197] Completed Stage: Post Processing\n", True),
        (b"INFO:2026-11-23 18:12:11 6988:6988 GenericActivityProfiler.cpp:150] Processing 1 CPU buffers\n", True),
        (b"ERROR:2026-11-23 18:10:14 4890:4890 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n", True),
        (b"ERROR:2026-11-23 18:10:14 4890:4890 CuptiActivityApi.cpp:1] CUPTI_ERROR_INSUFFICIENT_PRIVILEGES\n", False),
        (b"WARNING:2026-11-23 18:10:14 4890:4890 Foo.cpp:7] a real warning\n", False),
        (b"USDT: not kineto's format\n", False),
        (b"ERROR: gpuGetDeviceCount failed, said the user\n", False),
    ],
)
def test_routine_kineto_lines(line: bytes, routine: bool) -> None:
    assert is_routine_kineto_line(line) is routine


def test_quiet_kineto_writes_back_all_but_routine_lines(capfd, monkeypatch) -> None:
    monkeypatch.delenv(USER_SETTING, raising=False)
    usdt = b"USDT:2026-11-23 18:10:14 4890:4890 SyncActivityProfilerHandler.cpp:39] profiler_start\n"
    error = b"ERROR:2026-11-23 18:10:14 4890:4890 CuptiActivityApi.cpp:1] CUPTI_ERROR_INSUFFICIENT_PRIVILEGES\n"
    os.write(2, b"before\n")
    with quiet_kineto():
        print("python inside", file=sys.stderr)
        os.write(2, usdt + b"raw inside\n" + error)
        with quiet_kineto():  # nested: one capture
            os.write(2, usdt + b"nested")
    os.write(2, b"\nafter\n")
    assert capfd.readouterr().err == "before\npython inside\nraw inside\n" + error.decode() + "nested\nafter\n"

    monkeypatch.setenv(USER_SETTING, "5")
    with quiet_kineto():
        os.write(2, usdt)
    assert capfd.readouterr().err == usdt.decode()


def test_quiet_kineto_restores_stderr_when_the_call_raises(capfd, monkeypatch) -> None:
    monkeypatch.delenv(USER_SETTING, raising=False)
    with pytest.raises(RuntimeError, match="boom"), quiet_kineto():
        os.write(2, b"said before failing\n")
        raise RuntimeError("boom")
    os.write(2, b"stderr works\n")
    assert capfd.readouterr().err == "said before failing\nstderr works\n"
