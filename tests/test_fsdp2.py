"""FSDP2 (``fully_shard``) in a plain loop, 2 gloo processes on CPU: per-node times, bitwise weights, FSDP ranges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    script = Path(__file__).with_name("fsdp2_train.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_weights_are_bitwise_those_of_training_without_the_profiler(fsdp2_run):
    assert fsdp2_run["bitwise_equal"]


def test_sharded_blocks_are_leaves_whose_hooks_run_and_the_report_says_so(fsdp2_run):
    assert fsdp2_run["method"] == "symbolic_trace+leaves"
    assert set(fsdp2_run["leaves"]) == {"blocks.0", "blocks.1"}
    assert all("fully_shard" in reason for reason in fsdp2_run["leaves"].values())
    assert "captured by symbolic_trace+leaves" in fsdp2_run["markdown"]


def test_every_node_of_the_root_is_timed_over_both_ranks(fsdp2_run):
    assert fsdp2_run["steps"] == [2, 3] and fsdp2_run["ranks"] == 2
    nodes = fsdp2_run["nodes"]
    assert set(nodes) == {"fc_in", "blocks_0", "blocks_1", "head", "add"}  # add: head + the root's own out_bias
    assert all(calls == 2 and mean_ms > 0 and bwd_calls == 2 for _, calls, mean_ms, bwd_calls in nodes.values())


def test_sharded_blocks_have_the_flops_of_their_whole_weights(fsdp2_run):
    """FSDP2's modules refuse the copy the meta pass makes; each is counted as the user's own class, with its
    parameters by their whole shape (each rank computes the whole block on its batch of 8)."""
    block = 2 * 8 * (32 * 64 + 64 * 32)  # fc1 and fc2
    assert fsdp2_run["flops"]["blocks_0"] == fsdp2_run["flops"]["blocks_1"] == [block, 2 * block]
    assert fsdp2_run["flops"]["fc_in"] == [2 * 8 * 16 * 32, 2 * 8 * 16 * 32]  # no input gradient: weights' only


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
