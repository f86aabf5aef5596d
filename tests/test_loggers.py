"""The node and module tables and the cycle's files reach CSVLogger, MLFlowLogger and WandbLogger (real packages,
offline).

Each test trains a tiny model with a real Trainer and reads back what a user of that tracker would find.
"""

from __future__ import annotations

import csv
import json
import re
import struct
import time
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import LitClassifier, image_loader, make_trainer, read_events
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.outputs.sinks import TAG_UNSAFE, tag_prefix
from fxprof_lightning.report import CycleReport, ModuleStats, NodeStats

TRACE_NAME = re.compile(r"^rank0\.\d+\.pt\.trace\.json\.gz$")
SMALLNET_NODES = {"conv", "bn", "relu", "mean", "drop", "head"}
NODE_COLUMNS = [f.name for f in fields(NodeStats)]
MODULE_COLUMNS = [f.name for f in fields(ModuleStats)]


def profiler(**kwargs) -> FXProfilerCallback:
    """Two cycles: steps 1-2 and 4-5 (recorded), with torch.profiler traces."""
    return FXProfilerCallback(wait=0, warmup=1, active=2, repeat=2, torch_profiler=True, module="model", **kwargs)


def fit(root: Path, logger, callback: FXProfilerCallback) -> None:
    make_trainer(root, [callback], max_steps=6, logger=logger).fit(LitClassifier(), image_loader(samples=24))
    assert [c.steps for c in callback.cycles] == [[1, 2], [4, 5]]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- CSVLogger


def test_csv_logger_default_dirpath_holds_the_cycles_once(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), name="csv")
    callback = profiler()
    fit(tmp_path, logger, callback)
    log_dir = Path(logger.log_dir)
    fxprof = log_dir / "fxprof"
    assert sorted(p.name for p in fxprof.iterdir() if p.is_dir()) == ["cycle_0000", "cycle_0001"]
    for cycle in callback.cycles:
        assert cycle.directory == fxprof / cycle.directory.name  # written there directly, nothing copied
        assert {r["name"] for r in read_csv(cycle.directory / "fx_nodes.csv")} == SMALLNET_NODES
    assert sorted(log_dir.rglob("*cycle_*")) == [c.directory for c in callback.cycles]  # no copy anywhere
    assert (log_dir / "metrics.csv").is_file()


def test_csv_logger_gets_a_copy_of_a_cycle_written_elsewhere(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), name="csv")
    callback = profiler(dirpath=tmp_path / "elsewhere")
    fit(tmp_path, logger, callback)
    fxprof = Path(logger.log_dir) / "fxprof"
    assert sorted(p.name for p in fxprof.iterdir() if p.is_dir()) == ["cycle_0000", "cycle_0001"]
    for cycle in callback.cycles:
        assert cycle.directory.parent == tmp_path / "elsewhere"
        copy = fxprof / cycle.directory.name
        names = sorted(p.name for p in copy.iterdir())
        assert names == sorted(p.name for p in cycle.directory.iterdir())  # every file of the cycle
        assert {"fx_nodes.csv", "fx_modules.csv"} <= set(names)
        assert sum(bool(TRACE_NAME.match(n)) for n in names) == 1
        for name in names:
            assert (copy / name).read_bytes() == (cycle.directory / name).read_bytes()
        rows = read_csv(copy / "fx_nodes.csv")
        assert list(rows[0]) == NODE_COLUMNS
        assert [r["name"] for r in rows] == [n.name for n in cycle.nodes]
        modules = read_csv(copy / "fx_modules.csv")
        assert list(modules[0]) == MODULE_COLUMNS
        assert [m["path"] for m in modules] == [m.path for m in cycle.modules]


def test_the_trend_reaches_a_csv_logger_without_a_picture_sink(tmp_path):
    """``LoggerSink`` draws the trend itself: it does not count on a ``PictureSink`` having written ``trend.png``."""
    import torch

    from fxprof_lightning import Profiler
    from fxprof_lightning.outputs.trackers import LoggerSink

    logger = CSVLogger(save_dir=str(tmp_path), name="csv")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with Profiler(model, wait=0, warmup=1, active=1, repeat=2, dirpath=tmp_path / "fxprof", torch_profiler=False,
                  sinks=[LoggerSink([logger])]) as prof:
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            prof.step()
    assert [c.steps for c in prof.cycles] == [[1], [3]]
    assert not any((tmp_path / "fxprof").rglob("*.png"))  # no picture sink: nothing of its own
    trend = Path(logger.log_dir) / "fxprof" / "cycle_0001" / "trend.png"
    assert trend.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- MLFlowLogger


def mlflow_logger(tmp_path: Path, artifacts: Path):
    from lightning.pytorch.loggers import MLFlowLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    return MLFlowLogger(experiment_name="fxprof-test", tracking_uri=uri, artifact_location=str(artifacts)), uri


def test_mlflow_logger_gets_tables_texts_and_files(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    logger, uri = mlflow_logger(tmp_path, tmp_path / "artifacts")
    callback = profiler()
    fit(tmp_path, logger, callback)

    client = mlflow.tracking.MlflowClient(uri)

    def download(path: str) -> Path:
        return Path(client.download_artifacts(logger.run_id, path, str(tmp_path / "downloads")))

    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    for cycle in callback.cycles:
        base = f"fxprof/{cycle.directory.name}"
        listed = {Path(a.path).name for a in client.list_artifacts(logger.run_id, base)}
        assert {"nodes.json", "modules.json", "layers.md", "modules.md", "fx_nodes.csv", "fx_modules.csv"} <= listed
        assert {p.name for p in cycle.directory.iterdir()} <= listed  # the cycle's files: traces, CSVs...
        assert sum(bool(TRACE_NAME.match(n)) for n in listed) == 1

        nodes = json.loads(download(f"{base}/nodes.json").read_text())
        assert nodes["columns"] == NODE_COLUMNS
        assert [row[0] for row in nodes["data"]] == [n.name for n in cycle.nodes]
        assert nodes["data"][0][NODE_COLUMNS.index("mean_ms")] == pytest.approx(cycle.nodes[0].mean_ms)
        table = client.load_table(run.info.experiment_id, f"{base}/modules.json", run_ids=[logger.run_id])
        assert list(table["path"]) == [m.path for m in cycle.modules]  # MLflow reads it back as a table

        markdown = download(f"{base}/layers.md").read_text()
        assert all(f"`{name}`" in markdown for name in SMALLNET_NODES)

    tables = json.loads(run.data.tags["mlflow.loggedArtifacts"])  # what the UI lists as tables
    assert {"path": "fxprof/cycle_0001/nodes.json", "type": "table"} in tables


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path):
    pytest.importorskip("mlflow")
    (tmp_path / "not_a_dir").write_text("")
    logger, _ = mlflow_logger(tmp_path, tmp_path / "not_a_dir" / "artifacts")  # artifacts cannot be stored
    callback = profiler()
    with pytest.warns(UserWarning) as record:
        fit(tmp_path, logger, callback)
    ours = [str(w.message) for w in record if "MLFlowLogger could not log" in str(w.message)]
    # tables, texts, files: once each, not again in the second cycle; the trend picture at the end of fit
    assert len(ours) == 4, ours
    assert all(m.startswith("FXProfilerCallback: MLFlowLogger could not log the ") for m in ours)
    assert sum(" of cycle_0000 (" in m for m in ours) == 3 and "trend picture of cycle_0001 (" in ours[-1]
    assert len(callback.cycles) == 2  # and both cycles are reported
    assert (callback.cycles[1].directory / "fx_nodes.csv").is_file()


# ---------------------------------------------------------------- WandbLogger


class Validated(LitClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))


def test_validation_tracks_the_training_layers_in_custom_scalars_charts_of_five(tmp_path):
    """What TensorBoard holds: the validation stage logs the training stage's tracked layers, and its CUSTOM
    SCALARS charts hold 5 of them each (TensorBoard tells a chart's lines apart by 5 symbols)."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.plugins.custom_scalar import layout_pb2

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    callback = profiler(profile_validation=True, top_k=6)
    trainer = make_trainer(tmp_path, [callback], max_steps=6, logger=logger, num_sanity_val_steps=0)
    trainer.fit(Validated(), image_loader(samples=12), image_loader(samples=12, seed=1))
    tracked = callback.cycles[0].tracked
    assert len(tracked) == 6 and [c.tracked for c in callback.val_cycles] == [tracked, tracked]

    events = read_events(logger.log_dir)
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    charts = {category.title: {chart.title: list(chart.multiline.tag) for chart in category.chart}
              for category in layout.category}
    for stage in ("training", "validation"):
        titles = [t for t in charts[f"fxprof ({stage})"] if t.startswith("forward")]
        assert titles == ["forward ms per call, tracked layers 1-5 (tb/version_0)",
                          "forward ms per call, tracked layers 6 (tb/version_0)",
                          "forward ms per call, layers tracked later (tb/version_0)"], titles
    logged = {tag.split("/")[1] for tag in events.Tags()["scalars"] if tag.startswith("fxprof_val_nodes/")}
    assert logged and logged <= {TAG_UNSAFE.sub("_", name) for name in tracked}, (logged, tracked)
    (regex,) = charts["fxprof (validation)"]["forward ms per call, tracked layers 1-5 (tb/version_0)"]
    assert all(re.match(regex, f"fxprof_val_nodes/{TAG_UNSAFE.sub('_', n)}/forward_ms_per_call") for n in tracked[:5])


def wandb_records(path: Path) -> list:
    """The complete records of a run's ``.wandb`` transaction log (LevelDB's log layout: 32 KiB blocks of records
    with a CRC, a length and a type; wandb 0.31 has no Python reader of it any more)."""
    from wandb.proto import wandb_internal_pb2

    raw, block, records = path.read_bytes(), 32768, []
    if raw[:4] != b":W&B":
        return records
    pos, pending = 7, b""
    while pos + 7 <= len(raw):
        room = block - pos % block
        if room < 7:
            pos += room  # zero padding at the end of a block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(raw):
            break  # the end, or a record still being written
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        pending = data if kind in (1, 2) else pending + data  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def finished_run_records(path: Path, timeout: float = 60.0) -> list:
    """The run's records once its ``exit`` record is written: ``wandb.finish()`` returns before wandb-core has
    written the transaction log (seen empty right after it, complete a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path) if path.exists() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} holds no exit record after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow  # (the quick tier has MLflow's: the same tracker path)
def test_wandb_logger_gets_tables_and_an_artifact_per_cycle(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):  # nothing in the home directory
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="fxprof-test")
    callback = profiler(profile_validation=True)
    try:
        # 3 batches an epoch: validation (3 batches: a warm-up and 2 recorded) after steps 2 and 5
        trainer = make_trainer(tmp_path, [callback], max_steps=6, logger=logger, num_sanity_val_steps=0)
        trainer.fit(Validated(), image_loader(samples=12), image_loader(samples=12, seed=1))
        run_id, run_dir = logger.experiment.id, Path(logger.experiment.dir).parent
    finally:
        wandb.finish()
    assert [c.steps for c in callback.cycles] == [[1, 2], [4, 5]]
    assert [c.steps for c in callback.val_cycles] == [[1, 2], [4, 5]]  # validation steps count on
    cycles: list[CycleReport] = callback.cycles + callback.val_cycles

    # The tables, as the run's media files (what the W&B UI shows) ...
    for cycle in cycles:
        for key, columns, names in ((f"{tag_prefix(cycle)}/nodes", NODE_COLUMNS, [n.name for n in cycle.nodes]),
                                    (f"{tag_prefix(cycle)}/modules", MODULE_COLUMNS, [m.path for m in cycle.modules])):
            files = sorted((run_dir / "files" / "media" / "table").glob(f"{key}_*.table.json"))
            tables = [json.loads(p.read_text()) for p in files]
            assert (columns, names) in [(t["columns"], [row[0] for row in t["data"]]) for t in tables]

    # ... and in the run's history at the cycle's last step; the files as artifacts.
    records = finished_run_records(run_dir / f"run-{run_id}.wandb")
    history = [{item.nested_key[0]: item for item in r.history.item} for r in records if r.HasField("history")]
    for stage in ("train", "val"):
        key = f"{tag_prefix(next(c for c in cycles if c.stage == stage))}/nodes"
        steps = [json.loads(h["trainer/global_step"].value_json) for h in history if key in h]
        assert steps == [c.steps[-1] for c in cycles if c.stage == stage]
    artifacts = [r.artifact for r in records if r.HasField("artifact") and r.artifact.type == "fxprof-cycle"]
    assert sorted((a.name, *sorted(a.aliases)) for a in artifacts) == sorted(
        (f"fxprof-{'val-' if c.stage == 'val' else ''}{run_id}", *sorted((c.directory.name, "latest"))) for c in cycles)
    by_alias = {alias: a for a in artifacts for alias in a.aliases if alias != "latest"}
    for cycle in cycles:
        artifact = by_alias[cycle.directory.name]
        files = {c.path: Path(c.local_path) for c in artifact.manifest.contents}
        # the cycle's files (trend.png comes to the last cycle at the end of fit, and goes to W&B as an image)
        assert set(files) == {p.name for p in cycle.directory.iterdir() if p.name != "trend.png"}
        assert sum(bool(TRACE_NAME.match(n)) for n in files) == 1
        assert [r["name"] for r in read_csv(files["fx_nodes.csv"])] == [n.name for n in cycle.nodes]  # staged copy
        metadata = json.loads(artifact.metadata)
        assert (metadata["index"], metadata["steps"], metadata["stage"]) == (cycle.index, cycle.steps, cycle.stage)



# ------------------------------------------------------------------ TensorBoard: the layers tracked, two runs


def test_every_cycles_slowest_layer_is_tracked_from_its_cycle_on(tmp_path):
    """The tracked layers are the first cycle's slowest, and each later cycle's slowest joins them: a helper that
    becomes the slowest row at step 20 gets its scalar series from its first slow cycle on."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from test_dynamics import HELPER_ROW, LitAround, SlowFrom, classifier_loader, helper

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    callback = FXProfilerCallback(wait=2, warmup=1, active=3, module="model", torch_profiler=False, pictures=False,
                                  top_k=1)
    make_trainer(tmp_path, [callback, SlowFrom(20, 0.01)], max_steps=36, logger=logger).fit(
        LitAround(helper, 32), classifier_loader(36))
    first, last = callback.cycles[0], callback.cycles[-1]
    assert first.tracked == [first.nodes[0].name] and HELPER_ROW not in first.tracked
    assert last.nodes[0].name == HELPER_ROW and last.tracked[:1] == first.tracked and HELPER_ROW in last.tracked
    joined = next(c for c in callback.cycles if HELPER_ROW in c.tracked)
    events = read_events(logger.log_dir)
    tag = f"fxprof_nodes/{TAG_UNSAFE.sub('_', HELPER_ROW)}/forward_ms_per_call"
    steps = [event.step for event in events.Scalars(tag)]
    assert steps == [c.steps[-1] for c in callback.cycles if HELPER_ROW in c.tracked] and steps[0] == joined.steps[-1]


def test_two_runs_in_one_log_dir_keep_their_custom_scalars_charts_apart(tmp_path):
    """A second run in the same log dir doubled every chart title of the CUSTOM SCALARS tab. What TensorBoard itself
    serves: each run's charts have titles of their own, and each chart's lines are its run's tracked layers."""
    import subprocess
    import sys

    from lightning.pytorch.loggers import TensorBoardLogger
    from test_browser import free_port, get_json, log_tail, poll, stop

    runs = {}
    for _ in range(2):
        logger = TensorBoardLogger(str(tmp_path / "logs"), name="tb")
        callback = profiler(top_k=3, pictures=False)
        fit(tmp_path, logger, callback)
        runs[Path(logger.log_dir).name] = callback.cycles[0].tracked
    assert sorted(runs) == ["version_0", "version_1"]

    port = free_port()
    log = tmp_path / "tensorboard.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "logs"),
                                   "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def alive() -> str | None:
            return None if server.poll() is None else f"TensorBoard exited with {server.returncode}:\n{log_tail(log)}"

        def both() -> list | None:
            layout = get_json(f"http://127.0.0.1:{port}/data/plugin/custom_scalars/layout")
            charts = [c for category in layout.get("category", []) for c in category["chart"]]
            return charts if all(any(run in c["title"] for c in charts) for run in runs) else None

        charts = poll(both, "TensorBoard serving both runs' CUSTOM SCALARS layouts", alive)
    finally:
        stop(server)
    titles = [c["title"] for c in charts]
    assert len(titles) == len(set(titles)), titles
    for run, tracked in runs.items():
        (forward,) = [c for c in charts if c["title"].startswith("forward ms per call, tracked layers 1-3") and run in c["title"]]
        (regex,) = forward["multiline"]["tag"]
        assert all(re.match(regex, f"fxprof_nodes/{TAG_UNSAFE.sub('_', name)}/forward_ms_per_call") for name in tracked)
