"""FXProfilerCallback under DDP: two CPU processes (gloo) spawned by a real Trainer.

``ddp_spawn`` pickles the callbacks into the child processes, so the callback object in the
test process never sees a cycle. What each rank saw is written to ``rank<N>.json`` by
``RankReport`` (a plain callback that runs in the children); everything else is read back
from disk and from TensorBoard's event files, as a user would.
"""

from __future__ import annotations

import atexit
import csv
import gzip
import json
import os
import re
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import LitClassifier, image_loader, read_events
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from fxprof_lightning import FXProfilerCallback, NodeStats
from fxprof_lightning.engine.statistics import merge_ranks

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is needed", allow_module_level=True)

SMALLNET_NODES = {"conv", "bn", "relu", "mean", "drop", "head"}
TRACE_NAME = re.compile(r"^rank(\d)\.\d+\.pt\.trace\.json\.gz$")


def node(name: str, mean_ms: float, calls: int = 2) -> NodeStats:
    return NodeStats(name=name, op="call_module", target=name, module_path=name, calls=calls, mean_ms=mean_ms,
                     median_ms=mean_ms, min_ms=mean_ms / 2, max_ms=mean_ms * 2, total_ms=mean_ms * calls, pct=50.0)


def test_merge_ranks_means_over_ranks_and_names_the_slowest():
    merged = merge_ranks([[node("conv", 1.0), node("relu", 0.5)], None, [node("conv", 3.0, calls=3)]])
    assert [n.name for n in merged] == ["conv", "relu"]
    conv, relu = merged
    assert (conv.mean_ms, conv.median_ms, conv.min_ms, conv.max_ms) == (2.0, 2.0, 0.5, 6.0)
    assert (conv.calls, conv.total_ms, conv.slowest_rank, conv.slowest_rank_ms) == (3, 5.5, 2, 3.0)
    assert (relu.slowest_rank, relu.slowest_rank_ms) == (0, 0.5)  # a node only one rank timed: that rank
    assert conv.pct + relu.pct == pytest.approx(100.0)


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankReport(pl.Callback):
    """Runs in every spawned rank: records FXProfilerCallback's warnings and cycles into ``rank<N>.json``.

    Put it before the FXProfilerCallback so it listens from the profiler's own ``setup`` on.
    """

    def __init__(self, profiler: FXProfilerCallback, out_dir: Path) -> None:
        self.profiler = profiler
        self.out_dir = out_dir
        self._catcher = None
        self._caught: list = []

    def setup(self, trainer, pl_module, stage):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_fit_end(self, trainer, pl_module):
        report = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "warnings": [str(w.message) for w in self._caught if "FXProfilerCallback" in str(w.message)],
            "cycles": [
                {
                    "index": c.index,
                    "steps": c.steps,
                    "ranks": c.ranks,
                    "partial": c.partial,
                    "directory": str(c.directory),
                    "trace_paths": [str(p) for p in c.trace_paths],
                    "nodes": [[n.name, n.mean_ms, n.slowest_rank, n.slowest_rank_ms] for n in c.nodes],
                    "markdown": c.to_markdown(self.profiler.profiler.settings.top_k),
                }
                for c in self.profiler.cycles
            ],
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))

    def teardown(self, trainer, pl_module, stage):
        if trainer.global_rank > 0:  # (rank 0 sends Lightning's results through a queue at exit: left alone)
            # Now and then rank 1 aborted at interpreter exit, after its work and the process group's destruction,
            # with "terminate called without an active exception" (a C++ thread left joinable): leave before that.
            atexit.register(_exit_now)
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None


def fit_ddp(root: Path, profiler: FXProfilerCallback, model: pl.LightningModule, max_steps: int,
            callbacks: tuple[pl.Callback, ...] = ()) -> dict[int, dict]:
    """``fit`` on 2 CPU processes (``callbacks`` run before the profiler); returns each rank's ``RankReport``."""
    root.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        default_root_dir=str(root),
        logger=TensorBoardLogger(save_dir=str(root), name="logs"),
        callbacks=[*callbacks, RankReport(profiler, root), profiler],
        max_steps=max_steps,
        accelerator="cpu",
        devices=2,
        # A collective that one rank never joins fails after 60 s instead of hanging for 30 minutes.
        strategy=DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60)),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MASTER_PORT", raising=False)  # the launcher sets it in this process; pick a fresh port per run
        trainer.fit(model, image_loader(samples=32))
    assert trainer.state.finished
    return {rank: json.loads((root / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def read_trace(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def texts(events: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(t.step, tensor_util.make_ndarray(t.tensor_proto).item().decode()) for t in events.Tensors(tag)]


# ----------------------------------------------------------------------------------- two healthy ranks


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Two cycles (skip_first=1, wait=0, warmup=1, active=2, repeat=2): recorded steps 2-3 and 5-6."""
    root = tmp_path_factory.mktemp("ddp")
    profiler = FXProfilerCallback(skip_first=1, wait=0, warmup=1, active=2, repeat=2, module="model", top_k=3)
    reports = fit_ddp(root, profiler, LitClassifier(), max_steps=8)
    assert profiler.cycles == []  # the parent's copy never ran: ddp_spawn pickled it into the ranks
    return root, reports


def test_every_rank_records_the_same_steps_and_the_gathered_table(ddp_run):
    _, reports = ddp_run
    for rank, report in reports.items():
        assert (report["rank"], report["world_size"]) == (rank, 2)
        assert report["warnings"] == []
        assert [(c["index"], c["steps"], c["ranks"], c["partial"]) for c in report["cycles"]] == [
            (0, [2, 3], 2, False),
            (1, [5, 6], 2, False),
        ]
        for cycle in report["cycles"]:
            assert {name for name, *_ in cycle["nodes"]} == SMALLNET_NODES
            assert len(cycle["trace_paths"]) == 1  # this rank's own trace only
            assert TRACE_NAME.match(Path(cycle["trace_paths"][0]).name).group(1) == str(rank)
    # all_gather_object gives every rank the same merged table
    assert [c["nodes"] for c in reports[0]["cycles"]] == [c["nodes"] for c in reports[1]["cycles"]]
    assert [c["directory"] for c in reports[0]["cycles"]] == [c["directory"] for c in reports[1]["cycles"]]


def test_each_cycle_directory_holds_one_trace_per_rank(ddp_run):
    root, reports = ddp_run
    fxprof = root / "logs" / "version_0" / "fxprof"  # rank 0's log_dir, broadcast to rank 1
    assert sorted(p.name for p in fxprof.iterdir()) == ["cycle_0000", "cycle_0001", "fxprof_cycles.jsonl", "fxprof_job.json"]
    for cycle in reports[0]["cycles"]:
        directory = fxprof / f"cycle_{cycle['index']:04d}"
        assert cycle["directory"] == str(directory)
        files = sorted(p.name for p in directory.iterdir())
        traces = [name for name in files if TRACE_NAME.match(name)]
        assert sorted(TRACE_NAME.match(name).group(1) for name in traces) == ["0", "1"]  # one per rank
        assert "fx_nodes.csv" in files
        assert not [name for name in files if name.startswith(".") or "partial" in name]  # nothing half-written

        for name in traces:
            rank = int(TRACE_NAME.match(name).group(1))
            trace = read_trace(directory / name)
            assert trace["distributedInfo"]["backend"] == "gloo"
            assert (trace["distributedInfo"]["rank"], trace["distributedInfo"]["world_size"]) == (rank, 2)
            events = trace["traceEvents"]
            names = {e.get("name") for e in events}
            steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
            # Only the recorded steps, numbered as in training, on every rank (warm-up step discarded).
            assert sorted(e["name"] for e in steps) == [f"ProfilerStep#{s}" for s in cycle["steps"]]
            assert SMALLNET_NODES <= names  # the FX node ranges of this rank's own forward
            assert "DistributedDataParallel.forward" in names
            # DDP's gradient all-reduce, over gloo, starts inside every recorded step.
            reduces = [e for e in events if e.get("name") == "gloo:all_reduce"]
            assert reduces, sorted(n for n in names if n and ("gloo" in n or "c10d" in n))
            for step in steps:
                assert any(step["ts"] <= r["ts"] <= step["ts"] + step["dur"] for r in reduces), step["name"]


def test_rank_zero_writes_the_merged_csv_once_per_cycle(ddp_run):
    root, reports = ddp_run
    fxprof = root / "logs" / "version_0" / "fxprof"
    assert sorted(p.relative_to(fxprof).as_posix() for p in fxprof.rglob("fx_nodes.csv")) == [
        "cycle_0000/fx_nodes.csv",
        "cycle_0001/fx_nodes.csv",
    ]
    for cycle in reports[0]["cycles"]:
        rows = read_csv(fxprof / f"cycle_{cycle['index']:04d}" / "fx_nodes.csv")
        assert {"slowest_rank", "slowest_rank_ms"} <= set(rows[0])
        assert [r["name"] for r in rows] == [name for name, *_ in cycle["nodes"]]
        assert {r["slowest_rank"] for r in rows} <= {"0", "1"}
        for row, (_, mean_ms, slowest_rank, slowest_rank_ms) in zip(rows, cycle["nodes"], strict=True):
            assert int(row["slowest_rank"]) == slowest_rank
            assert float(row["slowest_rank_ms"]) == pytest.approx(slowest_rank_ms, abs=1e-6)
            assert float(row["mean_ms"]) == pytest.approx(mean_ms, abs=1e-6)
            # mean over 2 ranks <= the slowest rank's mean <= the slowest single call on any rank
            assert float(row["min_ms"]) <= float(row["mean_ms"]) <= float(row["slowest_rank_ms"]) + 1e-6
            assert float(row["slowest_rank_ms"]) <= float(row["max_ms"]) + 1e-6
            assert int(row["calls"]) == 2  # per rank: one call per recorded step
        assert sum(float(r["pct"]) for r in rows) == pytest.approx(100.0, abs=1e-3)


def test_rank_zero_logs_each_cycle_once(ddp_run):
    root, reports = ddp_run
    event_files = sorted(p.relative_to(root).as_posix() for p in root.rglob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].startswith("logs/version_0/"), event_files  # rank 1 writes none
    events = read_events(root / "logs" / "version_0")
    assert [e.step for e in events.Scalars("fxprof/forward_ms_per_step")] == [3, 6]  # one value per cycle, not per rank
    per_node = {t for t in events.Tags()["scalars"] if t.endswith("/forward_ms_per_call")}
    assert per_node == {f"fxprof_nodes/{name}/forward_ms_per_call" for name, *_ in reports[0]["cycles"][0]["nodes"][:3]}

    logged = texts(events, "fxprof/layers/text_summary")
    assert [step for step, _ in logged] == [3, 6]
    for (_, markdown), cycle in zip(logged, reports[0]["cycles"], strict=True):
        assert markdown == cycle["markdown"]
        lines = markdown.splitlines()
        assert "mean over 2 ranks" in lines[0]
        (header,) = [line for line in lines if line.startswith("| layer |")]
        assert header.startswith("| layer | op | fwd ms/call | bwd ms/call |")
        assert header.endswith("| slowest rank fwd ms/call | slowest rank |")
        assert markdown.count("\n| `") == 3  # top_k rows, each ending in the slowest rank
        assert all(re.search(r"\| [\d.]+ \| [01] \|$", line) for line in markdown.splitlines() if line.startswith("| `"))


# ------------------------------------------------------------------- one rank without node timing


