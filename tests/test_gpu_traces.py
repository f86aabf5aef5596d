"""Device time per range from real GPU traces recorded elsewhere (tests/data/gpu, see its README).

No GPU runs here: ``gpu_trace.attribute`` reads what Kineto wrote on A100s. Each test uses the traces'
own ``cpu_op`` / ``user_annotation`` ranges as stand-ins for fxprof's node ranges and checks:

* every GPU event (kernel, memcpy, memset) lands in exactly one place, the innermost range around its launch
  (against a brute-force search), ``outside`` every range, or ``unlaunched``; the sums add up to the total;
* launches removed from a trace turn their GPU events into ``unlaunched`` ones and their flows into orphans;
* a Triton kernel launched through the driver API (``cuLaunchKernel``) is found;
* HolisticTraceAnalysis, reading the same trace, ties the same kernels to the same launches and ranges.

Then the run-time side without a device: fxprof's node ranges in a real CPU trace of ours, with GPU events
written under their ops, give each node the device time of its own kernels, forward and backward; on
CUDA with the profiler the instrumented graph holds no CUDA event, no sync and no peak-statistics reset.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import fx, nn

from fxprof_lightning.analysis.roofline import spec_sheet_peaks
from fxprof_lightning.timing.fx_timer import FxNodeTimer
from fxprof_lightning.timing.gpu_trace import DEVICE_CATEGORIES, LAUNCH_CATEGORIES, attribute, node_device_times

DATA = Path(__file__).parent / "data" / "gpu"
TRACES = ["alexnet_a100.json.gz", "triton_example.json.gz", "sampled_rank0.json.gz"]


def load(name: str) -> list[dict]:
    return json.loads(gzip.decompress((DATA / name).read_bytes()))["traceEvents"]


def is_cpu_range(event: dict) -> bool:
    return event.get("cat") in ("cpu_op", "user_annotation")


def ns(microseconds: float) -> int:
    return round(microseconds * 1000)


def brute_force(events: list[dict]) -> tuple[Counter, int, int]:
    """Per (name, pid, tid, start ns) of a range, how many GPU events are launched innermost in it; how many
    are launched outside every range, and how many have no launch. A slow search, written independently."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ranges = [e for e in events if e.get("ph") == "X" and is_cpu_range(e)]
    order = {id(r): i for i, r in enumerate(ranges)}
    counts, outside, unlaunched = Counter(), 0, 0
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in DEVICE_CATEGORIES:
            continue
        launch = launches.get(event.get("args", {}).get("correlation"))
        if launch is None:
            unlaunched += 1
            continue
        at = ns(launch["ts"])
        around = [r for r in ranges if (r["pid"], r["tid"]) == (launch["pid"], launch["tid"])
                  and ns(r["ts"]) <= at <= ns(r["ts"]) + ns(r.get("dur", 0))]
        if not around:
            outside += 1
            continue
        # The latest start, then the shortest; of identical intervals the later in the file (Kineto writes a parent
        # before its child: aten::matmul, then aten::mm).
        inner = max(around, key=lambda r: (ns(r["ts"]), -ns(r.get("dur", 0)), order[id(r)]))
        counts[inner["name"], inner["pid"], inner["tid"], ns(inner["ts"])] += 1
    return counts, outside, unlaunched


@pytest.mark.parametrize("name", TRACES)
def test_every_gpu_event_lands_in_exactly_one_innermost_range(name):
    events = load(name)
    found = attribute(events, is_cpu_range)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    assert found.kernels == len(gpu) > 0
    assert found.device_ns == sum(ns(e["dur"]) for e in gpu)
    in_ranges = sum(r.kernels for r in found.ranges)
    assert in_ranges + found.outside + found.unlaunched == found.kernels
    assert sum(r.device_ns for r in found.ranges) + found.outside_ns + found.unlaunched_ns == found.device_ns
    counts, outside, unlaunched = brute_force(events)
    assert Counter({(r.name, r.pid, r.tid, r.start): r.kernels for r in found.ranges if r.kernels}) == counts
    assert (found.outside, found.unlaunched) == (outside, unlaunched)
    for timed in found.ranges:  # the union of a range's GPU events (span less idle) is at most their sum (streams overlap)
        assert 0 <= timed.idle_ns <= timed.span_ns and timed.span_ns - timed.idle_ns <= timed.device_ns


def test_the_traces_hold_what_their_readme_says():
    alexnet = Counter(e.get("cat") for e in load("alexnet_a100.json.gz") if e.get("ph") == "X")
    assert (alexnet["kernel"], alexnet["gpu_memcpy"], alexnet["gpu_memset"], alexnet["cuda_runtime"]) == (79, 16, 3, 361)
    sampled = Counter(e.get("cat") for e in load("sampled_rank0.json.gz") if e.get("ph") == "X")
    assert sampled["kernel"] == 1154
    found = attribute(load("sampled_rank0.json.gz"), is_cpu_range)
    assert (found.outside, found.unlaunched) == (0, 0)  # every launch of this rank is inside an op


def test_a_triton_kernel_launched_by_the_driver_is_found():
    events = load("triton_example.json.gz")
    found = attribute(events, is_cpu_range)
    (kernel,) = [e for e in events if e.get("cat") == "kernel"]
    assert kernel["name"].startswith("triton_")
    (launch,) = [e for e in events if e.get("cat") == "cuda_driver"]
    assert launch["name"] == "cuLaunchKernel" and launch["args"]["correlation"] == kernel["args"]["correlation"]
    (where,) = [r for r in found.ranges if r.kernels]
    assert where.name == kernel["name"]  # the cpu_op Inductor opens around the launch: the innermost range
    assert where.device_ns == ns(kernel["dur"]) == found.device_ns


def test_dropped_launches_make_unlaunched_events_and_orphan_flows():
    events = load("alexnet_a100.json.gz")
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and e["name"] == "cudaLaunchKernel"]
    dropped = {e["args"]["correlation"] for e in launches[:10]}
    kept = [e for e in events if e not in launches[:10]]
    flows = {e["id"] for e in events if e.get("cat") == "ac2g" and e.get("ph") in ("s", "f")}
    before, after = attribute(events, is_cpu_range), attribute(kept, is_cpu_range)
    lost = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and e["args"].get("correlation") in dropped]
    assert len(lost) == 10
    assert after.unlaunched == before.unlaunched + 10
    assert after.unlaunched_ns == before.unlaunched_ns + sum(ns(e["dur"]) for e in lost)
    assert after.orphan_flows == before.orphan_flows + len(dropped & flows) > before.orphan_flows
    assert after.device_ns == before.device_ns


def test_a_gpu_event_without_correlation_is_tied_by_its_flow():
    events = load("triton_example.json.gz")
    for event in events:
        if event.get("cat") == "kernel":
            del event["args"]["correlation"]
    found = attribute(events, is_cpu_range)
    assert found.unlaunched == 0 and [r.name for r in found.ranges if r.kernels] == ["triton_poi_fused_add_cos_sin_0"]


HTA = json.loads((DATA / "hta_expected.json").read_text())


def by_name(found, inside: tuple[int, int] | None = None) -> dict[str, tuple[int, int]]:
    """Kernels and whole microseconds per range name (HTA keeps whole microseconds), launched within ``inside``."""
    named: dict[str, list[int]] = {}
    for timed in found.ranges:
        if timed.kernels and (inside is None or inside[0] <= timed.start <= inside[1]):
            entry = named.setdefault(timed.name, [0, 0])
            entry[0] += timed.kernels
            entry[1] += timed.device_ns
    return {name: (kernels, round(total / 1000)) for name, (kernels, total) in named.items()}


def hta(name: str, key: str) -> dict[str, tuple[int, int]]:
    return {range_name: (v["kernels"], round(v["us"])) for range_name, v in HTA[name][key].items()}


def test_hta_ties_the_same_kernels_to_the_same_innermost_op():
    """HTA's call graph (``hta_reference.py``): each GPU event's launch and the first cpu_op/user_annotation above it."""
    found = attribute(load("alexnet_a100.json.gz"), is_cpu_range)
    assert by_name(found) == hta("alexnet_a100.json.gz", "by_launch_parent_cpu_op")
    assert (found.kernels, round(found.device_ns / 1000)) == (HTA["alexnet_a100.json.gz"]["kernels"], HTA["alexnet_a100.json.gz"]["kernel_us"])
    annotations = attribute(load("alexnet_a100.json.gz"), lambda e: e.get("cat") == "user_annotation")
    assert by_name(annotations) == hta("alexnet_a100.json.gz", "by_launch_user_annotation_innermost")


def test_hta_agrees_on_the_step_it_keeps_of_a_128_rank_trace():
    """HTA drops the last ProfilerStep of a trace by default (``include_last_profiler_step=False``): compare the first."""
    events = load("sampled_rank0.json.gz")
    (step,) = [e for e in events if e.get("name") == "ProfilerStep#551"]
    found = attribute(events, is_cpu_range)
    assert by_name(found, (ns(step["ts"]), ns(step["ts"] + step["dur"]))) == hta("sampled_rank0.json.gz", "by_launch_parent_cpu_op")


def test_hta_and_we_differ_on_the_triton_launch_only_by_its_stream_rule():
    """HTA's call stack leaves out CPU ops that carry a stream (Inductor's ``triton_*`` op has ``stream: 0``), so it
    credits the enclosing ``Torch-Compiled Region``; by time containment the op is the innermost range. With HTA's
    rule we give HTA's answer."""
    events = load("triton_example.json.gz")
    hta_rule = attribute(events, lambda e: is_cpu_range(e) and e.get("args", {}).get("stream", -1) == -1)
    assert {name: kernels for name, (kernels, _) in by_name(hta_rule).items()} == \
        {name: kernels for name, (kernels, _) in hta("triton_example.json.gz", "by_launch_parent_cpu_op").items()}


# The run-time side, without a device ----------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_node_ranges_of_a_real_trace_give_each_node_its_own_kernels(tmp_path):
    """A real CPU trace with fxprof's node ranges, and a GPU kernel written under each of its ops (as Kineto
    writes them: a cudaLaunchKernel inside the op, the kernel on the GPU's pid with the same correlation)."""
    from fxprof_lightning import Profiler

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, dirpath=tmp_path, wait=0, warmup=1, active=2, repeat=1) as prof:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    (cycle,) = prof.cycles
    (path,) = cycle.trace_paths
    document = json.loads(gzip.decompress(path.read_bytes()))
    events = document["traceEvents"]
    nodes = {"fc1", "act", "fc2"}
    ours = [e for e in events if e.get("cat") == "user_annotation" and (e["name"] in nodes or e["name"].removesuffix(" backward") in nodes)]
    assert {e["name"] for e in ours} >= {"fc1", "fc2", "fc1 backward", "fc2 backward"}
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e["name"] in ("aten::addmm", "aten::mm")]
    added = []
    for correlation, op in enumerate(ops, start=10_000):
        duration = 1.0 + correlation % 7  # us
        added.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": op["pid"], "tid": op["tid"],
                      "ts": op["ts"] + min(0.001, op["dur"] / 2), "dur": 0.0, "args": {"correlation": correlation}})
        added.append({"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": op["ts"] + 5, "dur": duration,
                      "args": {"correlation": correlation}})
    names = {e["name"] for e in ours}
    found = attribute(events + added, lambda e: e.get("cat") == "user_annotation" and e.get("name") in names)
    forward, backward, spans, _ = node_device_times(["fc1", "act", "fc2"], found)
    # The ops inside each node range, by the trace's own nesting: what the node's device time must be.
    expected: dict[str, list[int]] = {}
    for ours_range in sorted(ours, key=lambda e: e["ts"]):
        inside = [i for i, op in enumerate(ops) if op["pid"] == ours_range["pid"] and op["tid"] == ours_range["tid"]
                  and ours_range["ts"] <= op["ts"] + min(0.001, op["dur"] / 2) <= ours_range["ts"] + ours_range["dur"]]
        expected.setdefault(ours_range["name"], []).append(sum(ns(1.0 + (10_000 + i) % 7) for i in inside))
    assert forward == [expected.get("fc1", []), expected.get("act", []), expected.get("fc2", [])]
    assert backward == [expected.get("fc1 backward", []), expected.get("act backward", []), expected.get("fc2 backward", [])]
    assert len(forward[0]) == cycle.nodes[[n.name for n in cycle.nodes].index("fc1")].calls == 2
    assert all(t > 0 for t in forward[0] + forward[2] + backward[0] + backward[2]) and forward[1] == [0, 0]
    assert found.outside == 0 and found.unlaunched == 0
    assert len(spans[0]) == 2 and all(span > 0 for span in spans[0])


def test_on_cuda_with_trace_ranges_the_graph_adds_no_event_sync_or_peak_reset():
    traced = fx.symbolic_trace(MLP())
    lean = FxNodeTimer(traced, device="cuda", trace_ranges=True)
    code = lean.graph_module.code
    assert "perf_counter_ns" in code
    assert not any(word in code for word in ("Event", "synchronize", "memory", "reset_peak"))
    assert lean.trace_ranges and lean.uses_backward_events
    fallback = FxNodeTimer(traced, device="cuda")  # no profiler: CUDA events, the allocator's bytes, no reset
    assert "cuda_allocated" in fallback.graph_module.code and "reset_peak" not in fallback.graph_module.code
    package = Path(__file__).parents[1] / "fxprof_lightning"
    assert not [p.name for p in package.rglob("*.py") if "reset_peak_memory_stats" in p.read_text()]


@pytest.mark.parametrize(("device_name", "what", "bf16_tflops", "tb_per_s"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 3.35),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 2.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 3.9),
    ("NVIDIA H200", "H200 SXM", 989.4, 4.8),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 312.0, 2.039),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 312.0, 1.935),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, 1.555),
    ("NVIDIA L4", "L4", 121.0, 0.3),
    ("NVIDIA L40S", "L40S", 362.05, 0.864),
])
def test_spec_sheet_peaks_for_common_data_centre_gpus(device_name, what, bf16_tflops, tb_per_s):
    peaks = spec_sheet_peaks(device_name, torch.bfloat16)
    assert peaks.source == "spec sheet" and what in peaks.device
    assert (peaks.gflops_per_s, peaks.gbytes_per_s) == pytest.approx((bf16_tflops * 1e3, tb_per_s * 1e3))
    assert spec_sheet_peaks(device_name, torch.float32).gflops_per_s < spec_sheet_peaks(device_name, torch.float32, tf32=True).gflops_per_s


def test_no_spec_sheet_for_unknown_devices():
    assert spec_sheet_peaks("NVIDIA L40") is None and spec_sheet_peaks("Tesla T4") is None
