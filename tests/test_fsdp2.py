"""FSDP2 (``fully_shard``) in a plain loop, 2 gloo processes on CPU: per-node times, bitwise weights, FSDP ranges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxprof_lightning.capture import fsdp_rows
from fxprof_lightning.capture.dynamo import DynamoTimer
from fxprof_lightning.capture.fsdp_rows import FsdpRows

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built"),
    # torch 2.6's own FSDP2 cannot train on the CPU, profiler or not: its all-gather asks the CPU stream for
    # ``record_event``, which 2.6's ``torch.cpu.Stream`` lacks (2.11 has it). There these are GPU tests.
    pytest.mark.skipif(not hasattr(torch.cpu.Stream(), "record_event"),
                       reason=f"torch {torch.__version__}'s FSDP2 cannot train on the CPU (torch.cpu.Stream has no record_event)"),
]


def run_fsdp2(out: Path, *options: str) -> dict:
    script = Path(__file__).with_name("fsdp2_train.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, str(script), str(out), *options], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    return run_fsdp2(tmp_path_factory.mktemp("fsdp2"))


ROWS = {"fc_in", "head", *(f"blocks_{i}_{op}" for i in (0, 1) for op in ("fc1", "gelu", "fc2", "add"))}


def test_weights_are_bitwise_those_of_training_without_the_profiler(fsdp2_run):
    assert fsdp2_run["bitwise_equal"]


def test_every_layer_inside_the_sharded_blocks_is_a_row_timed_over_both_ranks(fsdp2_run):
    """Dynamo captures the sharded blocks' forwards (FSDP2's unshard and reshard hooks run eagerly, between the
    graphs) and, following torch's frames, the root's layers: a row per layer and op inside the blocks."""
    assert fsdp2_run["method"] == "dynamo" and fsdp2_run["leaves"] == {}
    assert fsdp2_run["steps"] == [2, 3] and fsdp2_run["ranks"] == 2
    nodes = {name: row for name, row in fsdp2_run["nodes"].items() if "(FSDP2 " not in name}
    assert set(nodes) == ROWS
    assert all(calls == 2 and mean_ms > 0 and bwd_calls == 2 for _, calls, mean_ms, bwd_calls in nodes.values())
    # The root's own op (``+ self.out_bias``) runs in a frame Dynamo gives up on (a hook's graph break inside the loop
    # over the blocks): untimed, and said so.
    assert list(fsdp2_run["untimed"]) == ["(the root)"]


def test_the_layers_of_sharded_blocks_have_the_flops_of_their_whole_weights(fsdp2_run):
    """Each rank computes the whole block on its batch of 8, with its parameters unsharded."""
    fc1 = 2 * 8 * 32 * 64
    assert fsdp2_run["flops"]["blocks_0_fc1"] == fsdp2_run["flops"]["blocks_1_fc2"] == [fc1, 2 * fc1]
    assert fsdp2_run["flops"]["fc_in"] == [2 * 8 * 16 * 32, 2 * 8 * 16 * 32]  # no input gradient: weights' only


@pytest.mark.parametrize(("run", "size"), [("fsdp2_run", 4), ("kept_run", 2)])  # (kept_run computes in bfloat16)
def test_the_layers_of_sharded_blocks_save_what_a_hand_count_says(run, size, request):
    """Issue 42 under FSDP2, known answers: each rank's forward on its batch of 8 saves, per layer, its input (fc1,
    fc2, head, fc_in) or what it needs (gelu: its input); the unsharded weights the Linears save are parameters, not
    activations, whether FSDP2 frees them after the forward (``reshard_after_forward``) or keeps them (``keep``).
    The parameters are counted whole (the model's float32, not a rank's shard)."""
    result = request.getfixturevalue(run)
    batch = 8
    expected = {"fc_in": batch * 16 * size, "head": batch * 32 * size,
                **{f"blocks_{i}_{op}": batch * width * size for i in (0, 1)
                   for op, width in (("fc1", 32), ("gelu", 64), ("fc2", 64))},
                **{f"blocks_{i}_add": 0 for i in (0, 1)}}
    assert {name: saved for name, saved in result["saved"].items() if name in ROWS} == expected
    saved, params = result["module_memory"][""]
    assert saved == sum(expected.values()) and params == (16 * 32 + 32 + 2 * (32 * 64 + 64 + 64 * 32 + 32) + 32 * 4 + 4 + 4) * 4


def test_a_guard_failure_under_fsdp2_falls_back_on_every_rank_and_nothing_hangs(tmp_path):
    """A capture's checking calls run FSDP2's collectives: captured again on one rank alone, they would hang the job.
    So an FSDP2 model is captured once; a failed guard (here: a flag a block's forward reads, flipped on every rank
    at a recorded step) sends it to module hooks (from the next cycle; this one reports no node times), training
    unchanged."""
    run = run_fsdp2(tmp_path, "change")
    assert run["bitwise_equal"]
    assert any("captured once" in w and "module hooks from now on" in w for w in run["warnings"]), run["warnings"]


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory):
    return run_fsdp2(tmp_path_factory.mktemp("fsdp2_kept"), "keep", "bf16")  # reshard_after_forward=False, bfloat16


def test_unsharded_after_forward_and_in_bf16_it_is_bitwise_and_per_layer_too(kept_run):
    assert kept_run["bitwise_equal"] and kept_run["method"] == "dynamo"
    assert {name for name in kept_run["nodes"] if "(FSDP2 " not in name} == ROWS


# FSDP2's collectives, a row per FSDP module and kind: module path -> the name of its row of each kind.
FSDP_MODULES = {"": "(root)", "blocks.0": "blocks_0", "blocks.1": "blocks_1"}
KINDS = ("all-gather", "reduce-scatter", "reshard")


def fsdp_row(rows: dict, path: str, kind: str) -> dict:
    module_path, layer, calls, mean_ms, bwd_calls, bwd_mean_ms = rows[f"{FSDP_MODULES[path]} (FSDP2 {kind})"]
    assert module_path == path
    return {"layer": layer, "calls": calls, "ms": mean_ms, "bwd_calls": bwd_calls, "bwd_ms": bwd_mean_ms}


def test_fsdp2s_collectives_are_rows_of_each_fsdp_module_on_both_ranks(fsdp2_run):
    """Each FSDP module's all-gather (forward, and backward again since it reshards after forward), reshard (after
    forward and after backward) and reduce-scatter (backward) are rows with their calls and time on each rank, in the
    node table, its Markdown and CSV and the scalars the run logs."""
    for rank in fsdp2_run["per_rank"]:
        assert len(rank["rows"]) == len(FSDP_MODULES) * len(KINDS)
        for path in FSDP_MODULES:
            gather, scatter, reshard = (fsdp_row(rank["rows"], path, kind) for kind in KINDS)
            assert gather["calls"] == gather["bwd_calls"] == 2 and gather["ms"] > 0 and gather["bwd_ms"] > 0
            assert scatter["calls"] == 0 and scatter["bwd_calls"] == 2 and scatter["bwd_ms"] > 0
            assert reshard["calls"] == reshard["bwd_calls"] == 2 and reshard["ms"] > 0 and reshard["bwd_ms"] > 0
    assert fsdp_row(fsdp2_run["fsdp2"], "blocks.0", "all-gather")["layer"] == "FSDP2 all-gather of blocks.0 (FSDPBlock)"
    assert "| `FSDP2 all-gather of blocks.0 (FSDPBlock)` | fsdp2 |" in fsdp2_run["markdown"]
    assert "| `FSDP2 reduce-scatter of (root) (FSDPNet)` | fsdp2 |" in fsdp2_run["markdown"]
    assert set(fsdp2_run["csv_rows"]) == set(fsdp2_run["fsdp2"]) and "blocks_1 (FSDP2 reduce-scatter)" in fsdp2_run["tracked"]


def check_accounting(rank: dict) -> None:
    """The rows and the time no row owns add up to the measured forward and backward, none clamped at zero (a row's
    time counted twice would be), and the collectives' time left the unowned rows: what stays there is less."""
    (forward, _), (_, outside), (_, engine) = rank["unowned"].values()  # between the rows; no row made; the engine
    assert rank["forward_ms_per_step"] + forward == pytest.approx(rank["forward_wall_ms"]) and forward > 0
    assert rank["backward_ms_per_step"] + outside + engine == pytest.approx(rank["backward_wall_ms"]) and engine > 0
    assert outside == rank["backward_outside_ms"]
    rows = {(path, kind): fsdp_row(rank["rows"], path, kind) for path in FSDP_MODULES for kind in KINDS}
    # Before, the reduce-scatters of the blocks were in the autograd node FSDP2 runs them in, which no row made.
    assert outside < sum(rows[path, "reduce-scatter"]["bwd_ms"] for path in ("blocks.0", "blocks.1"))
    assert forward < sum(row["ms"] * row["calls"] / 2 for row in rows.values())


def test_the_collectives_time_leaves_the_time_no_row_owns(fsdp2_run):
    """The root's own FSDP2 hooks run around its forward: the forward wall holds them; the blocks' post-backward runs
    inside an autograd node no row made: that node's time gives it up."""
    for rank in fsdp2_run["per_rank"]:
        check_accounting(rank)


def test_unsharded_after_forward_there_is_no_all_gather_in_backward(kept_run):
    for rank in kept_run["per_rank"]:
        for path in FSDP_MODULES:
            gather, scatter, reshard = (fsdp_row(rank["rows"], path, kind) for kind in KINDS)
            assert gather["calls"] == 2 and gather["ms"] > 0 and gather["bwd_calls"] == 0
            assert scatter["bwd_calls"] == 2 and reshard["calls"] == 0 and reshard["bwd_calls"] == 2
        check_accounting(rank)


def test_without_the_trace_and_run_between_graphs_the_collectives_are_rows_counted_once(tmp_path):
    """With torch_profiler=False (backward events from a profiler of the backward scope alone) the rows are the same.
    A root that calls its blocks one by one is captured with a graph break at each block's FSDP2 hooks: the code Dynamo
    runs eagerly there is a row, which gives up the all-gather it ran."""
    run = run_fsdp2(tmp_path, "unrolled", "untraced")
    assert run["bitwise_equal"] and not [name for name in run["files"] if ".pt.trace.json" in name]
    for rank in run["per_rank"]:
        assert len(rank["rows"]) == len(FSDP_MODULES) * len(KINDS)
        for path in FSDP_MODULES:
            gather, scatter, _ = (fsdp_row(rank["rows"], path, kind) for kind in KINDS)
            assert gather["calls"] == gather["bwd_calls"] == scatter["bwd_calls"] == 2 and scatter["bwd_ms"] > 0
        check_accounting(rank)
        ((name, ms),) = rank["breaks"].items()
        assert name.endswith("x = self.blocks[0](x)") and ms < fsdp_row(rank["rows"], "blocks.0", "all-gather")["ms"]


def test_fsdp_ranges_are_reported_per_module(fsdp2_run):
    ranges = {name: (module, ms) for name, module, ms in fsdp2_run["ranges"]}
    assert {"FSDP::all_gather (blocks.0)", "FSDP::all_gather (blocks.1)", "FSDP::all_gather"} <= set(ranges)
    assert ranges["FSDP::all_gather (blocks.1)"][0] == "blocks.1" and ranges["FSDP::all_gather"][0] == ""
    assert any(name.startswith("FSDP::post_backward_reduce") for name in ranges)
    assert all(ms > 0 for _, ms in ranges.values())
    assert "| `FSDP::all_gather (blocks.0)` | `blocks.0` |" in fsdp2_run["markdown"]
    assert "fsdp_ranges.csv" in fsdp2_run["files"]
    traces = [name for name in fsdp2_run["files"] if ".pt.trace.json" in name]
    assert len(traces) == 1 and traces[0].startswith("rank0.")  # ranks=[0]; rank 1 still timed nodes (ranks == 2)


def test_without_fsdp2_or_on_a_torch_without_its_private_methods_nothing_is_wrapped(monkeypatch):
    """No FSDP2 module: no collective rows and nothing to install; a torch whose FSDP2 lacks what is wrapped and read
    (before 2.14: ``fsdp2_kept`` False) gets no rows, without an error."""
    assert DynamoTimer(True)._fsdp is None
    assert DynamoTimer(True, sharded=True)._fsdp is not None
    monkeypatch.setattr(fsdp_rows, "fsdp2_kept", lambda: False)
    assert not FsdpRows.usable() and DynamoTimer(True, sharded=True)._fsdp is None


def test_a_collective_leaves_the_autograd_node_and_the_row_call_that_ran_it_known_answers():
    """``FsdpRows`` on pieces of known times: a backward piece that autograd node 7's own code ran (FSDP2's
    ``post_backward`` inside ``RegisterPostBackwardFunction``) is taken out of node 7's event alone; a forward piece
    inside a row's call (eager code between two graphs ran the hook) out of that call alone; a forward piece around
    the timed call extends the forward wall; a piece in no node's code and no row's call is taken from nothing."""
    rows = FsdpRows()
    piece = fsdp_rows._Piece
    rows.pieces = [piece(0, True, 100, 130, 30, False, 7),  # backward, inside node 7's own code
                   piece(0, True, 200, 210, 10, False, None),  # backward, a tensor hook: in no node's event
                   piece(1, False, 1_000, 1_040, 40, True, None),  # forward, inside row 2's second call
                   piece(1, False, 5_000, 5_025, 25, False, None)]  # forward, the root's own hook around the call
    assert rows.events_less([(6, 500), (7, 100), (8, 50)]) == [(6, 500), (7, 70), (8, 50)]
    starts, durations = [[0], [], [0, 990]], [[900], [], [80, 60]]
    rows.take_from(starts, durations)
    assert durations == [[900], [], [80, 20]]
    assert rows.around_forward_ns() == 25


def test_a_forward_collective_outside_the_modules_call_is_no_rows():
    """A user's own ``unshard()`` before the forward (FSDP2's explicit prefetch) runs outside the profiled module's
    call: no sample (the forward wall does not hold it); inside the call (the root's hooks mark it) it is one."""
    rows = FsdpRows()
    rows._add(0, 0, 10, 10, completes=True)
    assert rows.pieces == [] and rows.rows() == []
    rows._in_module = True
    rows._add(0, 20, 30, 10, completes=True)
    assert [(p.start, p.ns) for p in rows.pieces] == [(20, 10)] and rows.around_forward_ns() == 10
