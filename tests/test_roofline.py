"""The roofline: bytes moved per node from the meta pass, peaks measured and cached, and each node's place under them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from fxprof_lightning.analysis import roofline
from fxprof_lightning.analysis.roofline import Peaks, default_cache_path, device_peaks, measure_peaks, with_roofline
from fxprof_lightning.report import NodeStats
from fxprof_lightning.timing.flops import count_costs

F32 = 4


def node(name: str = "n", mean_ms: float = 1.0, fwd_flops: int | None = None, fwd_bytes: int | None = None) -> NodeStats:
    return NodeStats(name, "function", name, "", calls=1, mean_ms=mean_ms, median_ms=mean_ms, min_ms=mean_ms,
                     max_ms=mean_ms, total_ms=mean_ms, pct=100.0, fwd_flops=fwd_flops, fwd_bytes=fwd_bytes)


# with_roofline --------------------------------------------------------------------------------------------------------

PEAKS = Peaks(gflops_per_s=1000.0, gbytes_per_s=100.0, op_floor_us=1e-6)  # ridge: 10 FLOPs per byte; no op floor


def test_a_small_node_far_from_its_roofline_is_overhead_bound():
    """A 64-wide Linear on a batch of 8 (65 kFLOP, 18 kB): its compute and memory times are well under a microsecond,
    it takes 40 us. That is the fixed cost of ops (dispatch, Python), neither compute- nor memory-bound."""
    peaks = Peaks(gflops_per_s=100.0, gbytes_per_s=20.0, op_floor_us=5.0)
    small = node("fc1", mean_ms=0.04, fwd_flops=2 * 8 * 64 * 64, fwd_bytes=4 * (8 * 64 * 2 + 64 * 64 + 64))
    big = node("fc2", mean_ms=500.0, fwd_flops=2 * 1024**3, fwd_bytes=4 * 3 * 1024**2)  # 4% of peak, but big: compute
    (row, big_row) = with_roofline([small, big], peaks)
    assert row.bound == "overhead" and row.pct_of_peak < 10
    assert big_row.bound == "compute" and big_row.pct_of_peak < 10
    (fast,) = with_roofline([node("fc1", mean_ms=0.0008, fwd_flops=small.fwd_flops, fwd_bytes=small.fwd_bytes)], peaks)
    assert fast.bound == "memory"  # near its roofline: not overhead


def test_compute_bound_node():
    (row,) = with_roofline([node(mean_ms=4.0, fwd_flops=2_000_000_000, fwd_bytes=10_000_000)], PEAKS)
    assert row.intensity == pytest.approx(200.0)
    assert row.bound == "compute"
    assert row.fwd_gbytes_per_s == pytest.approx(2.5)  # 1e7 bytes in 4 ms
    assert row.pct_of_peak == pytest.approx(50.0)  # 500 GFLOP/s of the flat roof's 1000


def test_memory_bound_node():
    n = 1_000_000  # an add of two float32 vectors: n FLOPs, 3 n * 4 bytes
    (row,) = with_roofline([node(mean_ms=0.2, fwd_flops=n, fwd_bytes=3 * n * F32)], PEAKS)
    assert row.intensity == pytest.approx(1 / 12)
    assert row.bound == "memory"
    assert row.fwd_gbytes_per_s == pytest.approx(60.0)
    assert row.pct_of_peak == pytest.approx(60.0)  # 5 GFLOP/s of the attainable 100 / 12, as 60 GB/s of 100


def test_node_without_flops_is_memory_bound_against_the_bandwidth():
    (row,) = with_roofline([node(mean_ms=0.1, fwd_flops=0, fwd_bytes=8_000_000)], PEAKS)
    assert (row.intensity, row.bound) == (None, "memory")
    assert row.fwd_gbytes_per_s == pytest.approx(80.0)
    assert row.pct_of_peak == pytest.approx(80.0)
    (unknown_flops,) = with_roofline([node(mean_ms=0.1, fwd_flops=None, fwd_bytes=8_000_000)], PEAKS)
    assert unknown_flops.pct_of_peak == pytest.approx(80.0)


@pytest.mark.parametrize("fwd_bytes", [None, 0])
def test_unknown_bytes_leave_the_roofline_fields_empty(fwd_bytes):
    (row,) = with_roofline([node(fwd_flops=1000, fwd_bytes=fwd_bytes)], PEAKS)
    assert (row.fwd_gbytes_per_s, row.intensity, row.bound, row.pct_of_peak) == (None, None, "", None)


def test_zero_time_keeps_the_side_but_no_rates():
    (row,) = with_roofline([node(mean_ms=0.0, fwd_flops=1000, fwd_bytes=10)], PEAKS)
    assert (row.intensity, row.bound, row.fwd_gbytes_per_s, row.pct_of_peak) == (100.0, "compute", None, None)


def test_ridge_rule():
    assert PEAKS.ridge == 10.0
    at, below = with_roofline([node("at", fwd_flops=10_000, fwd_bytes=1000), node("below", fwd_flops=9_999, fwd_bytes=1000)],
                              PEAKS)
    assert (at.bound, below.bound) == ("compute", "memory")
    assert at.pct_of_peak == pytest.approx(100.0 * (10_000 / 1e6) / 1000.0)  # at the ridge both roofs agree
    assert below.pct_of_peak == pytest.approx(100.0 * (9_999 / 1e6) / (9.999 * 100.0))


def test_with_roofline_is_pure():
    rows = [node("a", fwd_flops=10, fwd_bytes=10), node("b")]
    out = with_roofline(rows, PEAKS)
    assert out is not rows and [r.name for r in out] == ["a", "b"]
    assert rows[0].bound == "" and rows[0].intensity is None  # the input is untouched
    assert out[0].mean_ms == rows[0].mean_ms and out[0].fwd_flops == 10
    assert with_roofline([], PEAKS) == []


@pytest.mark.parametrize("argument", ["gflops_per_s", "gbytes_per_s"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "100", True])
def test_given_peaks_are_checked(argument, value):
    good = {"gflops_per_s": 100.0, "gbytes_per_s": 10.0}
    with pytest.raises(ValueError, match=argument):
        Peaks(**{**good, argument: value})


def test_given_peaks():
    peaks = Peaks(gflops_per_s=100, gbytes_per_s=10.0)
    assert (peaks.source, peaks.ridge) == ("given", 10.0)
    with pytest.raises(ValueError, match="source"):
        Peaks(gflops_per_s=1.0, gbytes_per_s=1.0, source="guessed")


# Bytes moved, from the meta pass --------------------------------------------------------------------------------------

def fwd_bytes(module: nn.Module, *inputs: torch.Tensor) -> dict[str, int]:
    traced = fx.symbolic_trace(module)
    costs = count_costs(traced, inputs, training=False)
    timed = [n.name for n in traced.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert len(costs.fwd_bytes) == len(timed)
    return dict(zip(timed, costs.fwd_bytes))


class LinearReluView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu_(self.fc(x))
        return y.view(-1) + y.view(-1)


def test_bytes_of_a_module_an_in_place_op_and_views():
    moved = fwd_bytes(LinearReluView(), torch.zeros(8, 64))
    out = 8 * 32 * F32
    assert moved["fc"] == 8 * 64 * F32 + 32 * 64 * F32 + 32 * F32 + out  # input, weight, bias, output
    assert moved["relu_"] == out  # in place: input and output are one tensor
    assert moved["view"] == out  # a view of its input
    assert moved["add"] == out + out  # the same tensor twice (two views of it) counted once, plus the sum


class FunctionalWithParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(32, 64))
        self.bias = nn.Parameter(torch.zeros(32))
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.norm(y + self.bias.expand(8, 32))


def test_bytes_of_get_attr_inputs_buffers_and_an_expand():
    moved = fwd_bytes(FunctionalWithParameters(), torch.zeros(8, 64))
    out = 8 * 32 * F32
    assert moved["linear"] == 8 * 64 * F32 + 32 * 64 * F32 + out  # the get_attr weight is an input
    assert moved["expand"] == 32 * F32  # the expanded view holds only the bias
    assert moved["add"] == out + 32 * F32 + out
    # BatchNorm1d: input, output, weight, bias, running mean and variance, and the int64 step count
    assert moved["norm"] == out + out + 4 * 32 * F32 + 8


# Measuring and caching peaks ------------------------------------------------------------------------------------------

def test_measure_peaks_is_plausible_and_leaves_global_state_alone():
    rng, threads, grad = torch.random.get_rng_state(), torch.get_num_threads(), torch.is_grad_enabled()
    peaks = measure_peaks("cpu")
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert (torch.get_num_threads(), torch.is_grad_enabled()) == (threads, grad)
    assert peaks.source == "measured" and peaks.device.startswith("cpu: ")
    assert 0.5 < peaks.gflops_per_s < 1e5  # one slow shared core to a large many-core server
    assert 0.1 < peaks.gbytes_per_s < 1e4
    assert 0.01 < peaks.op_floor_us < 1000  # one tiny op: a fraction of a microsecond to a slow machine's hundreds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_peaks_on_cuda():
    peaks = measure_peaks("cuda")
    assert peaks.device.startswith("cuda:0: ") and torch.cuda.get_device_name(0) in peaks.device
    assert 100 < peaks.gflops_per_s < 1e7
    assert 50 < peaks.gbytes_per_s < 1e5


@pytest.fixture
def measured(monkeypatch):
    """Stands in for the micro-benchmark: records its calls and returns fixed peaks."""
    calls = []

    def fake(device="cpu", dtype=torch.float32):
        calls.append((str(device), dtype))
        return Peaks(gflops_per_s=123.0, gbytes_per_s=4.5, device=roofline.device_name(device), source="measured",
                     op_floor_us=7.5)

    monkeypatch.setattr(roofline, "measure_peaks", fake)
    return calls


def test_device_peaks_are_measured_once_then_cached(tmp_path, measured):
    path = tmp_path / "sub" / "peaks.json"
    first = device_peaks("cpu", path)
    assert first.source == "measured" and len(measured) == 1
    entries = json.loads(path.read_text())["peaks"]
    (key,) = entries
    assert roofline.device_name("cpu") in key and torch.__version__ in key and "float32" in key
    assert entries[key]["gflops_per_s"] == 123.0
    second = device_peaks("cpu", path)
    assert len(measured) == 1
    assert second == Peaks(gflops_per_s=123.0, gbytes_per_s=4.5, device=first.device, source="cached", op_floor_us=7.5)
    assert [p.name for p in path.parent.iterdir()] == ["peaks.json"]  # no temporary file left behind


def test_each_dtype_has_its_own_entry_and_others_are_kept(tmp_path, measured):
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps({"format": 1, "peaks": {"other machine": {"gflops_per_s": 1.0, "gbytes_per_s": 1.0}}}))
    device_peaks("cpu", path)
    device_peaks("cpu", path, dtype=torch.bfloat16)
    assert measured == [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    assert len(json.loads(path.read_text())["peaks"]) == 3


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": 1, "peaks": 3}',
                                     '{"format": 1, "peaks": {"KEY": {"gflops_per_s": -1, "gbytes_per_s": 2}}}'])
def test_a_corrupt_cache_is_measured_again_and_repaired(tmp_path, measured, content):
    path = tmp_path / "peaks.json"
    key = roofline._cache_key(torch.device("cpu"), torch.float32)
    path.write_text(content.replace("KEY", key))
    assert device_peaks("cpu", path).source == "measured"
    assert device_peaks("cpu", path).source == "cached"
    assert len(measured) == 1


def test_an_unwritable_cache_only_warns(tmp_path, measured):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not cache device peaks"):
        peaks = device_peaks("cpu", blocker / "peaks.json")  # its directory cannot be made
    assert peaks.source == "measured" and peaks.gflops_per_s == 123.0


def test_default_cache_path_follows_xdg(tmp_path, monkeypatch, measured):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "fxprof_lightning" / "peaks.json"
    device_peaks("cpu")
    assert default_cache_path().is_file()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_path() == tmp_path / "home" / ".cache" / "fxprof_lightning" / "peaks.json"


# FLOPs node by node: a node the meta pass cannot run costs only its own row ------------------------------------------

class ReadsAValue(nn.Module):
    """A block whose code reads a tensor's value: no meta kernel can run it (a torch.fx leaf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x


class ThreeSteps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.picky, self.fc2 = nn.Linear(16, 32), ReadsAValue(), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.picky(self.fc1(x)))


class _PickyIsALeaf(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, ReadsAValue) or super().is_leaf_module(m, qualname)


def three_steps() -> fx.GraphModule:
    model = ThreeSteps()
    return fx.GraphModule(model, _PickyIsALeaf().trace(model))


def test_a_node_the_meta_pass_cannot_run_ends_the_count_there_without_its_shape():
    traced = three_steps()
    costs = count_costs(traced, (torch.randn(4, 16),), training=True)
    assert costs.fwd_flops == [2 * 4 * 16 * 32, None, None]  # fc1 counted; picky failed; fc2 not reached
    assert costs.bwd_flops[0] == 2 * 4 * 16 * 32  # fc1's weight gradient (its input needs none), from what ran
    assert costs.fwd_bytes[1:] == [None, None]
    assert costs.failed.startswith("picky (") and "item" in costs.failed and "1 node(s) after it not reached" in costs.failed


def test_a_node_the_meta_pass_cannot_run_costs_only_its_row_when_the_graph_knows_its_shape():
    traced = three_steps()
    for node in traced.graph.nodes:  # what Dynamo's graphs carry on every node: a (fake) value of its output
        if node.target == "picky":
            node.meta["example_value"] = torch.empty(4, 32, requires_grad=True)
    costs = count_costs(traced, (torch.randn(4, 16),), training=True)
    assert costs.fwd_flops == [2 * 4 * 16 * 32, None, 2 * 4 * 32 * 8]
    assert costs.bwd_flops == [2 * 4 * 16 * 32, None, 2 * 2 * 4 * 32 * 8]  # fc2: input and weight gradients
    assert costs.out_bytes[2] == 4 * 8 * F32 and costs.fwd_bytes[1] is None
    assert costs.failed.startswith("picky (") and "after it" not in costs.failed


def test_a_backward_without_meta_kernels_keeps_the_forward_counts():
    class MaskedWrite(nn.Module):  # wav2vec2's SpecAugment: a boolean-mask write, whose backward needs nonzero
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.fill = nn.Linear(8, 8), nn.Parameter(torch.zeros(8))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.index_put(self.fc(x), (mask,), self.fill)

    costs = count_costs(fx.symbolic_trace(MaskedWrite()), (torch.randn(4, 8), torch.rand(4) > 0.5), training=True)
    assert costs.fwd_flops[0] == 2 * 4 * 8 * 8 and set(costs.bwd_flops) == {None}
    assert costs.failed.startswith("the backward (NotImplementedError")
