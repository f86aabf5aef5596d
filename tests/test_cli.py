"""FXProfilerCallback configured from a LightningCLI YAML file, as users of ``LightningCLI`` add callbacks."""

from __future__ import annotations

import csv
import gzip
import json
import re
import sys

import lightning.pytorch as pl
import pytest
import yaml
from helpers import LitClassifier, image_loader, read_events
from tensorboard.util import tensor_util

from fxprof_lightning import FXProfilerCallback, Schedule

pytest.importorskip("jsonargparse")
from lightning.pytorch.cli import LightningCLI  # needs jsonargparse

SMALLNET_NODES = {"conv", "bn", "relu", "mean", "drop", "head"}
TRACE_NAME = re.compile(r"^rank0\.\d+\.pt\.trace\.json\.gz$")
CALLBACK_ARGS = {
    "skip_first": 1,
    "wait": 0,
    "warmup": 1,
    "active": 2,
    "repeat": 1,
    "module": "model",
    "top_k": 3,
    "profiler_kwargs": {"record_shapes": True},
}


class CLIModel(LitClassifier):
    """The shared test classifier, under a name LightningCLI imports from this module."""


class CLIData(pl.LightningDataModule):
    def train_dataloader(self):
        return image_loader()


def write_config(tmp_path, classes_in_config=True, **callback_args) -> str:
    """A ``fit`` config: trainer, TensorBoard logger, the profiler callback, and (``classes_in_config``) model and
    data by class path, else left to the classes given to ``LightningCLI``."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "default_root_dir": str(tmp_path),
            "max_steps": 5,
            "accelerator": "cpu",
            "devices": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path)}},
            "callbacks": [{"class_path": "fxprof_lightning.FXProfilerCallback", "init_args": {**CALLBACK_ARGS, **callback_args}}],
        },
    }
    if classes_in_config:
        # __name__ is how this module was imported: "test_cli" under pytest's default (prepend) import mode
        config["model"] = {"class_path": f"{__name__}.CLIModel"}
        config["data"] = {"class_path": f"{__name__}.CLIData"}
    path = tmp_path / "fxprof.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fxprof-cli"])  # LightningCLI warns when args= and pytest's own argv are both set


def test_callback_from_yaml_profiles_the_fit(tmp_path):
    cli = LightningCLI(args=["fit", "--config", write_config(tmp_path)])  # model and data come from the config too

    assert type(cli.model) is CLIModel and type(cli.datamodule) is CLIData
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, FXProfilerCallback)]
    assert callback.schedule == Schedule(skip_first=1, wait=0, warmup=1, active=2, repeat=1)
    engine = callback.profiler
    assert (callback.module_path, engine.settings.top_k, engine.settings.profiler_kwargs) == ("model", 3, {"record_shapes": True})
    assert (engine.settings.torch_profiler, engine.settings.fx_timing, callback.dirpath, engine.settings.use_gzip) == (True, True, None, True)

    (cycle,) = callback.cycles
    assert (cycle.index, cycle.steps, cycle.partial) == (0, [2, 3], False)
    assert {n.name for n in cycle.nodes} == SMALLNET_NODES
    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert cycle.directory == log_dir / "fxprof" / "cycle_0000"
    (trace_path,) = cycle.trace_paths
    assert TRACE_NAME.match(trace_path.name)
    files = {p.name for p in cycle.directory.iterdir()}
    assert {name for name in files if name.endswith((".pt.trace.json", ".pt.trace.json.gz"))} == {trace_path.name}  # one trace, rank 0
    assert "fx_nodes.csv" in files and not [name for name in files if name.startswith(".")]

    events = json.loads(gzip.decompress(trace_path.read_bytes()))["traceEvents"]
    assert sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes reached torch.profiler
    with open(cycle.directory / "fx_nodes.csv") as f:
        assert {row["name"] for row in csv.DictReader(f)} == SMALLNET_NODES

    tensorboard = read_events(log_dir)
    assert [e.step for e in tensorboard.Scalars("fxprof/forward_ms_per_step")] == [3]
    per_node = {t for t in tensorboard.Tags()["scalars"] if t.endswith("/forward_ms_per_call")}
    assert per_node == {f"fxprof_nodes/{n.name}/forward_ms_per_call" for n in cycle.nodes[:3]}  # top_k=3
    (text,) = tensorboard.Tensors("fxprof/layers/text_summary")
    assert tensor_util.make_ndarray(text.tensor_proto).item().decode() == cycle.to_markdown(3)

    # LightningCLI's saved config replays the callback as configured
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    (entry,) = saved["trainer"]["callbacks"]
    assert entry["class_path"] == "fxprof_lightning.FXProfilerCallback"
    assert CALLBACK_ARGS.items() <= entry["init_args"].items()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"active": 0}, "active must be >= 1 (at least one recorded step per cycle), got 0"),
        ({"wait": -1}, "wait must be >= 0, got -1"),
        ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
        ({"profiler_kwargs": {"record_shape": True}}, "profiler_kwargs has unknown torch.profiler.profile arguments ['record_shape']"),
    ],
    ids=["active", "wait", "top_k", "profiler_kwargs"],
)
def test_a_bad_value_in_yaml_names_the_argument(tmp_path, bad, message):
    # The callback's ValueError reaches the user inside jsonargparse's ValueError (one line per Union alternative).
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        LightningCLI(CLIModel, CLIData, args=["fit", "--config", write_config(tmp_path, classes_in_config=False, **bad)])
    assert "fxprof_lightning.FXProfilerCallback" in str(error.value)
    assert not (tmp_path / "lightning_logs").exists()  # nothing ran


def test_a_wrongly_typed_value_in_yaml_is_a_usage_error_naming_the_argument(tmp_path, capsys):
    # A type error is caught by jsonargparse before the constructor runs: usage error, exit status 2.
    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(CLIModel, CLIData, args=["fit", "--config", write_config(tmp_path, classes_in_config=False, active="two")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fxprof_lightning.FXProfilerCallback" in err
    assert re.search(r"\bactive\b", err) and "two" in err
