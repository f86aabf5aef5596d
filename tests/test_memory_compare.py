"""Memory in ``fxprof compare`` and across a run's cycles (issue 42, item 4): a layer that now saves much more for
backward is flagged like a slower one, from the files real runs wrote, read back as a user would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxprof_lightning import CsvSink, Profiler, torch_api
from fxprof_lightning.analysis.memory_growth import SavedGrowth, saved_growth
from fxprof_lightning.cli import main
from fxprof_lightning.outputs.runs import load_run
from fxprof_lightning.report import NodeStats

pytestmark = pytest.mark.skipif(not torch_api.READS_SAVED_TENSORS, reason="this torch cannot read saved tensors")
BATCH, SEQ = 8, 4
F32 = 4


def run(directory, width: int, batch: int = BATCH, cycles: int = 1, longer_at: int | None = None):
    """A plain loop over ``Linear(32, width), ReLU, Linear(width, 4)`` on batches of ``SEQ`` vectors, with the CSV
    sink: ``cycles`` cycles of two recorded steps; from cycle ``longer_at`` on the sequences are 4x as long (the ReLU
    saves 4x as much per sample; Dynamo captures the model again, and the cycle records later steps). The profiler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Profiler(model, wait=0, warmup=1, active=2, repeat=cycles, dirpath=directory, torch_profiler=False,
                  pictures=False, sinks=[CsvSink()]) as prof:
        for step in range(3 * cycles + 3):
            longer = longer_at is not None and step >= 3 * longer_at
            model(torch.randn(batch, 4 * SEQ if longer else SEQ, 32)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(batch_size=batch)
    return prof


def test_the_csv_read_back_has_the_memory_fields(tmp_path):
    prof = run(tmp_path, 64)
    (cycle,) = load_run(tmp_path)
    (recorded,) = prof.cycles
    assert {n.name: n.saved_bytes for n in cycle.nodes} == {n.name: n.saved_bytes for n in recorded.nodes}
    memory = ("saved_bytes_per_step", "param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes", "input_held",
              "output_bytes", "output_held")
    assert [[getattr(m, f) for f in memory] for m in cycle.modules] == [[getattr(m, f) for f in memory]
                                                                       for m in recorded.modules]
    assert cycle.modules[0].param_bytes == (32 * 64 + 64 + 64 * 4 + 4) * F32
    assert cycle.checkpoint_plan == recorded.checkpoint_plan


def test_compare_flags_a_layer_that_saves_much_more(tmp_path, capsys):
    run(tmp_path / "a", 64)
    run(tmp_path / "b", 256)
    status = main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    relu_a, relu_b = BATCH * SEQ * 64 * F32 / 1e6, BATCH * SEQ * 256 * F32 / 1e6
    assert "Saved for backward, MB per step: 1 layer(s) of B save 2x as much as in A or more" in out
    assert f"| `1 (ReLU)` | `1` | {relu_a:.3f} | {relu_b:.3f} | 4.00x |" in out
    assert status == 1


def test_compare_of_a_run_with_itself_flags_no_memory(tmp_path, capsys):
    run(tmp_path / "a", 64)
    main(["compare", str(tmp_path / "a"), str(tmp_path / "a")])
    assert "Saved for backward" not in capsys.readouterr().out


def test_compare_per_sample_where_the_batch_sizes_differ(tmp_path, capsys):
    run(tmp_path / "a", 64)
    run(tmp_path / "b", 64, batch=4 * BATCH)
    main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert "Saved for backward" not in capsys.readouterr().out


def test_the_regression_watch_names_a_layer_whose_saved_bytes_grow(tmp_path):
    prof = run(tmp_path, 64, cycles=3, longer_at=2)
    first, second, third = prof.cycles
    assert not any("saves" in a and "for backward" in a for a in first.advice + second.advice)
    assert any(a.startswith("`1 (ReLU)` saves 4.0x as much for backward") for a in third.advice), third.advice


def _row(name, saved, calls=2):
    return NodeStats(name, "call_module", name, name, calls, *[0.1] * 6, saved_bytes=saved, layer=f"{name} (L)")


def test_growth_needs_the_ratio_and_the_floor():
    before = [([_row("a", 1e6), _row("b", 10.0), _row("c", 1e6)], 2)]
    now = [_row("a", 2.5e6), _row("b", 1000.0), _row("c", 1.5e6), _row("d", 9e6)]
    # b grew 100x but by 990 bytes per step (below the floor); c by 1.5x; d is new (the time table shows new rows).
    assert saved_growth(before, now, 2) == [SavedGrowth("a", "a (L)", 1e6, 2.5e6)]
    assert saved_growth(before, now, 2, scale=2.0) == []  # per sample: a batch twice as large in B
