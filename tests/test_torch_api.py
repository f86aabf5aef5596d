"""torch's private surface (``torch_api``, issue 39): a name this torch lacks never fails the import; the package
goes on without it, warning once where a feature is lost, or fails at use where what calls it rests on it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from fxprof_lightning import FxprofWarning, torch_api
from fxprof_lightning.timing.saved_memory import read_saved_bytes

# Takes private names away from torch (``REMOVE``), then imports every module of the package and runs ``USE``; prints
# what torch_api found missing and the package's warnings meanwhile.
SCRIPT = """
import importlib, json, pkgutil, sys, warnings
import torch, torch._dynamo.utils
{remove}
import fxprof_lightning
from fxprof_lightning import FxprofWarning, Profiler, torch_api
for found in pkgutil.walk_packages(fxprof_lightning.__path__, "fxprof_lightning."):
    if found.name != "fxprof_lightning.__main__":  # (runs the command line)
        importlib.import_module(found.name)
result = {{}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {use}
result["missing"] = sorted(torch_api.MISSING)
result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, FxprofWarning)]
print(json.dumps(result))
"""

PROFILED = """model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with Profiler(model, wait=0, warmup=1, active=2, repeat=1, dirpath=sys.argv[1], torch_profiler=False,
                  pictures=False, sinks=[]) as prof:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            prof.step()
    result["method"] = prof.cycles[0].capture.method"""


NO_DATA = "if hasattr(torch._C._autograd.SavedTensor, 'data'):\n    del torch._C._autograd.SavedTensor.data\n"


def test_a_torch_without_saved_tensor_data_reads_saved_bytes_by_unpacking(tmp_path):
    """As on 2.6-2.10: the saved bytes read by unpacking where no hook was on top, no warning."""
    use = PROFILED + "\n    result['saved'] = [n.saved_bytes for n in prof.cycles[0].nodes]"
    result = _run(NO_DATA, use, str(tmp_path))
    assert "torch._C._autograd:SavedTensor.data" in result["missing"] and result["warnings"] == []
    assert result["method"] == "dynamo" and sum(result["saved"]) == 2 * 4 * 4 + 2 * 4 * 4  # x, the ReLU's result


def test_a_torch_with_neither_way_to_read_saved_tensors_warns_and_reads_none(monkeypatch):
    """Without ``SavedTensor.data`` nor the hooks' push and pop (the capture needs them: checked in process)."""
    monkeypatch.setattr(torch_api, "_TOLD", set())
    monkeypatch.setattr(torch_api, "HAS_DATA", False)
    monkeypatch.setattr(torch_api, "READS_SAVED_TENSORS", False)
    with pytest.warns(FxprofWarning, match=r"cannot read the bytes saved for backward: it has no torch\._C\._autograd\."
                      r"SavedTensor\.data or \.unpack_hook \(2\.11\+\), nor _push/_pop_saved_tensors_default_hooks"):
        assert read_saved_bytes(None, 0, 0, [], [], [], None, 3).per_call(0) is None


def _run(remove: str, use: str, directory: str) -> dict:
    script = SCRIPT.format(remove=remove, use=use)
    done = subprocess.run([sys.executable, "-c", script, directory], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("remove", "path", "warning"), [
    ("del torch._dynamo.utils.graph_break_reasons", "torch._dynamo.utils:graph_break_reasons",
     "cannot name graph breaks: it has no torch._dynamo.utils.graph_break_reasons"),
    ("del torch._C._current_graph_task_id", "torch._C:_current_graph_task_id",
     "cannot tell a recompute inside backward from a forward call: it has no torch._C._current_graph_task_id; "
     "recomputes in backward count as forward"),
])
def test_a_torch_without_a_name_imports_profiles_and_warns_once(tmp_path, remove, path, warning):
    """The package imports, the name is in ``MISSING``, and a profiled loop that needs it runs with the Dynamo
    capture and one warning (the loop calls it at every step)."""
    result = _run(remove, PROFILED, str(tmp_path))
    assert path in result["missing"]
    assert result["method"] == "dynamo"
    assert result["warnings"] == [f"fxprof_lightning: torch {torch.__version__} {warning}"]


def test_a_torch_without_a_name_the_timing_rests_on_imports_and_fails_at_use(tmp_path):
    use = "try:\n        torch_api.sequence_nr_now()\n    except RuntimeError as error:\n        result['error'] = str(error)"
    result = _run("del torch._C._autograd._get_sequence_nr", use, str(tmp_path))
    assert "torch._C._autograd:_get_sequence_nr" in result["missing"]
    assert "has no torch._C._autograd._get_sequence_nr: backward timing and FLOP counting fail at use" in result["error"]
    assert result["warnings"] == []


def test_a_missing_name_is_none_and_listed(monkeypatch):
    monkeypatch.setattr(torch_api, "MISSING", {})
    assert torch_api._find("torch._C:_no_such_name", "nothing done") is None
    assert torch_api._find("torch._no_such_module:x", "nothing done", default=3) == 3
    assert torch_api.MISSING == {"torch._C:_no_such_name": "nothing done", "torch._no_such_module:x": "nothing done"}
    assert torch_api.lacks("torch._C:_no_such_name") and not torch_api.lacks("torch._C:_current_graph_task_id")
    assert torch_api._find("torch._C:_current_graph_task_id", "-") is not None


def test_a_lost_feature_is_told_once(monkeypatch):
    monkeypatch.setattr(torch_api, "_TOLD", set())
    stand_in = torch_api._function("torch._C:_no_such_name", "none read", "read a thing", -1)
    with pytest.warns(FxprofWarning, match=r"cannot read a thing: it has no torch\._C\._no_such_name; none read"):
        assert stand_in() == -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stand_in() == -1  # told already
