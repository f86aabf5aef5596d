"""The roofline: a device's peak FLOP/s and bytes/s, and where each node sits under them.

``Peaks`` holds the two peaks; they are given (``Peaks(gflops_per_s=..., gbytes_per_s=...)``),
measured by ``measure_peaks`` (best of a few square matmuls for FLOP/s, best of a few large
``copy_`` calls for bytes/s, read plus write), or read back by ``device_peaks`` from a JSON
cache keyed by the device, the thread count, the torch version and the dtype, so each device is
measured once. ``with_roofline`` is a pure function over node statistics: achieved GB/s,
arithmetic intensity (FLOPs per byte moved, see ``flops`` for the bytes estimate), the side of
the ridge (``"compute"`` or ``"memory"``) and the share of what the roofline allows at that
intensity.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fxprof_lightning import FxprofWarning
from fxprof_lightning.report import NodeStats

__all__ = ["SPEC_SHEET", "Peaks", "default_cache_path", "describe_peaks", "device_name", "device_peaks", "measure_peaks", "raised_to",
           "spec_sheet_peaks", "with_roofline"]

SOURCES = ("measured", "cached", "given", "spec sheet")
DEFAULT_OP_FLOOR_US = 5.0  # when not measured: about what a tiny op costs on a CPU (and a kernel launch on a GPU)
OVERHEAD_PCT = 10.0  # a node under this % of its roofline whose roofline time is under one op's floor: overhead-bound

# Data-centre GPUs' spec-sheet peaks, dense (without 2:4 sparsity): TFLOP/s per dtype and memory TB/s, from NVIDIA's
# data sheets (H100/H200: "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200" product pages; A100: "NVIDIA A100 Tensor
# Core GPU" data sheet; L4, L40S: their data sheets). Matched against torch.cuda.get_device_name by its words
# (lower case, "-" splits words: "NVIDIA A100-SXM4-80GB"): all of a pattern's words present, first match wins. Used until the device is measured (``measure_peaks``, cached).
SPEC_SHEET: list[tuple[tuple[str, ...], str, dict[str, float], float]] = [
    # (words in the name, what it is, TFLOP/s by dtype, TB/s)
    (("h200", "nvl"), "H200 NVL", {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5}, 4.8),
    (("h100", "nvl"), "H100 NVL", {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5}, 3.9),
    (("h200",), "H200 SXM", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}, 4.8),
    (("h100", "pcie"), "H100 PCIe", {"float32": 51.0, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0}, 2.0),
    (("h100",), "H100 SXM", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}, 3.35),
    (("a100", "80gb", "pcie"), "A100 80GB PCIe", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}, 1.935),
    (("a100", "80gb"), "A100 80GB SXM", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}, 2.039),
    (("a100",), "A100 40GB", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}, 1.555),
    (("l40s",), "L40S", {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.05, "float16": 362.05}, 0.864),
    (("l4",), "L4", {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0}, 0.3),
]
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class Peaks:
    """Peak compute (GFLOP/s) and memory bandwidth (GB/s, 1e9 bytes/s) of a device.

    ``op_floor_us`` is the fixed cost of one op (the time of an op with next to no work: dispatch, kernel
    launch, Python), measured with the peaks. ``device`` names what they were measured on ('' when given), ``source`` says where they come
    from: ``"measured"``, ``"cached"`` (measured on an earlier run), ``"given"`` or ``"spec sheet"``
    (a known GPU's data-sheet numbers, ``SPEC_SHEET``, before any measurement).

    >>> Peaks(gflops_per_s=1000.0, gbytes_per_s=50.0).ridge
    20.0
    """

    gflops_per_s: float
    gbytes_per_s: float
    device: str = ""
    source: str = "given"
    op_floor_us: float = DEFAULT_OP_FLOOR_US  # the fixed cost of one op (dispatch, launch): an empty op's time

    def __post_init__(self) -> None:
        for name in ("gflops_per_s", "gbytes_per_s", "op_floor_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Peaks: {name} must be a positive finite number, got {value!r}")
        if self.source not in SOURCES:
            raise ValueError(f"Peaks: source must be one of {SOURCES}, got {self.source!r}")

    @property
    def ridge(self) -> float:
        """The intensity (FLOPs per byte) above which the roofline is flat: compute-bound from there on."""
        return self.gflops_per_s / self.gbytes_per_s


def describe_peaks(peaks: Peaks) -> str:
    """The peaks in one line, with where they come from.

    >>> describe_peaks(Peaks(1000.0, 50.0))
    '1000 GFLOP/s, 50 GB/s, 5.0 us per op (given)'
    """
    return (f"{peaks.gflops_per_s:.0f} GFLOP/s, {peaks.gbytes_per_s:.0f} GB/s, {peaks.op_floor_us:.1f} us per op "
            f"({peaks.source}{': ' + peaks.device if peaks.device else ''})")


def raised_to(peaks: Peaks, stats: list[NodeStats]) -> Peaks:
    """``peaks`` raised to the best rates the nodes achieved: a measured peak that a node beat was measured low
    (another process had the cores, or the micro-benchmark's sizes missed the device's best).

    >>> from fxprof_lightning.report import NodeStats
    >>> fast = NodeStats("mm", "call_function", "mm", "", 1, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0, fwd_gflops_per_s=80.0)
    >>> raised_to(Peaks(50.0, 10.0, source="measured"), [fast])
    Peaks(gflops_per_s=80.0, gbytes_per_s=10.0, device='', source='measured', op_floor_us=5.0)
    """
    flops = max([peaks.gflops_per_s, *(s.fwd_gflops_per_s for s in stats if s.fwd_gflops_per_s)])
    bandwidth = max([peaks.gbytes_per_s, *(s.fwd_gbytes_per_s for s in stats if s.fwd_gbytes_per_s)])
    return replace(peaks, gflops_per_s=flops, gbytes_per_s=bandwidth)


def with_roofline(stats: list[NodeStats], peaks: Peaks) -> list[NodeStats]:
    """``stats`` with ``fwd_gbytes_per_s``, ``intensity``, ``bound`` and ``pct_of_peak`` filled from ``peaks``.

    Per node: achieved GB/s is ``fwd_bytes`` over ``mean_ms``; ``intensity`` is
    ``fwd_flops / fwd_bytes`` (None without FLOPs); ``bound`` is ``"compute"`` at or above the
    ridge (``peaks.ridge``), else ``"memory"`` (a node that counts no FLOPs only moves bytes), or
    ``"overhead"`` for a node below ``OVERHEAD_PCT`` of its roofline whose roofline time (its compute or
    memory time, the larger) is under one op's fixed cost (``peaks.op_floor_us``): what it waits for is
    dispatch, launch and Python, not the device;
    ``pct_of_peak`` is the achieved GFLOP/s as a percentage of the attainable
    ``min(peak GFLOP/s, intensity * peak GB/s)``, or for a node without FLOPs the achieved GB/s as
    a percentage of the peak GB/s. Unknown or zero bytes leave all four empty, a zero ``mean_ms``
    leaves the rates and ``pct_of_peak`` empty.

    >>> node = NodeStats("mm", "function", "mm", "", calls=1, mean_ms=1.0, median_ms=1.0, min_ms=1.0,
    ...                  max_ms=1.0, total_ms=1.0, pct=100.0, fwd_flops=400_000_000, fwd_bytes=4_000_000)
    >>> (row,) = with_roofline([node], Peaks(gflops_per_s=1000.0, gbytes_per_s=50.0))
    >>> row.intensity, row.bound, row.fwd_gbytes_per_s, row.pct_of_peak
    (100.0, 'compute', 4.0, 40.0)
    """
    return [replace(s, **_roofline_fields(s, peaks)) for s in stats]


def _roofline_fields(s: NodeStats, peaks: Peaks) -> dict[str, Any]:
    if not s.fwd_bytes:
        return {"fwd_gbytes_per_s": None, "intensity": None, "bound": "", "pct_of_peak": None}
    intensity = s.fwd_flops / s.fwd_bytes if s.fwd_flops else None
    bound = "compute" if intensity is not None and intensity >= peaks.ridge else "memory"
    if s.mean_ms <= 0:
        return {"fwd_gbytes_per_s": None, "intensity": intensity, "bound": bound, "pct_of_peak": None}
    gbytes_per_s = s.fwd_bytes / (s.mean_ms * 1e6)
    if intensity is None:
        pct = 100.0 * gbytes_per_s / peaks.gbytes_per_s
    else:
        attainable = min(peaks.gflops_per_s, intensity * peaks.gbytes_per_s)
        pct = 100.0 * (s.fwd_flops / (s.mean_ms * 1e6)) / attainable
    roofline_us = 1e3 * s.mean_ms * pct / 100.0  # the time the roofline allows: max(compute time, memory time)
    if pct < OVERHEAD_PCT and roofline_us < peaks.op_floor_us:
        bound = "overhead"  # far above both its compute and its memory time, and too small for either to matter
    return {"fwd_gbytes_per_s": gbytes_per_s, "intensity": intensity, "bound": bound, "pct_of_peak": pct}


# Measuring ------------------------------------------------------------------------------------------------------------

def _resolve(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device | str = "cpu") -> str:
    """What the peaks of ``device`` depend on: the CPU model and torch's thread count, or the GPU's name.

    >>> device_name("cpu").startswith("cpu: ")
    True
    """
    device = _resolve(device)
    if device.type == "cpu":
        return f"cpu: {_cpu_model()}, {torch.get_num_threads()} threads"
    if device.type == "cuda":
        return f"{device}: {torch.cuda.get_device_name(device)}"
    return str(device)


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """A function that runs a callable once and returns its duration in seconds on ``device``."""
    if device.type == "cuda":
        def cuda_seconds(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_seconds

    backend = getattr(torch, device.type, None)
    synchronize = getattr(backend, "synchronize", None) if device.type != "cpu" else None

    def host_seconds(fn: Callable[[], Any]) -> float:
        if synchronize:
            synchronize()
        start = time.perf_counter()
        fn()
        if synchronize:
            synchronize()
        return time.perf_counter() - start
    return host_seconds


def _best(seconds: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], budget_s: float,
          min_reps: int = 3, max_reps: int = 20) -> float:
    """Shortest of several timed runs after one warm-up: at least ``min_reps``, more while within ``budget_s``."""
    seconds(fn)
    best, spent, reps = math.inf, 0.0, 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        took = seconds(fn)
        best, spent, reps = min(best, took), spent + took, reps + 1
    return max(best, 1e-9)


def _matmul_seconds(seconds: Callable[[Callable[[], Any]], float], n: int, device: torch.device,
                    dtype: torch.dtype) -> float:
    a = torch.empty(n, n, device=device, dtype=dtype).fill_(0.5)  # filled, not drawn: no random state used
    b = torch.empty(n, n, device=device, dtype=dtype).fill_(0.5)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return _best(seconds, lambda: torch.mm(a, b, out=c), budget_s=0.25)


def _copy_seconds(seconds: Callable[[Callable[[], Any]], float], nbytes: int, device: torch.device,
                  dtype: torch.dtype) -> float:
    src = torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(), device=device, dtype=dtype).fill_(1)
    dst = torch.empty_like(src)
    return _best(seconds, lambda: dst.copy_(src), budget_s=0.15)


def measure_peaks(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Peaks:
    """Peak GFLOP/s and GB/s of ``device`` for ``dtype`` by a short micro-benchmark (well under a second on CPU).

    FLOP/s: the best of several ``n x n`` matmuls (``2 n^3`` FLOPs; n = 1024 on CPU, 4096 on a GPU).
    Bytes/s: the best of several ``dst.copy_(src)`` of a buffer too large for caches (64 MB on CPU,
    256 MB on a GPU), counting the read and the write. The op floor: the best of 100 in-place adds to
    a one-element tensor, per add. Runs without autograd, draws no random
    numbers and leaves torch's thread settings alone; on CUDA timed with events.
    """
    device = _resolve(device)
    accelerator = device.type != "cpu"
    n = 4096 if accelerator else 1024
    copy_bytes = (256 if accelerator else 64) * 2**20
    seconds = _timer(device)
    context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), context:
        matmul_s = _matmul_seconds(seconds, n, device, dtype)
        copy_s = _copy_seconds(seconds, copy_bytes, device, dtype)
        tiny = torch.zeros(1, device=device, dtype=dtype)
        floor_s = _best(seconds, lambda: [tiny.add_(0) for _ in range(100)], budget_s=0.05) / 100
    return Peaks(gflops_per_s=2 * n**3 / matmul_s / 1e9, gbytes_per_s=2 * copy_bytes / copy_s / 1e9,
                 device=device_name(device), source="measured", op_floor_us=floor_s * 1e6)


# Caching --------------------------------------------------------------------------------------------------------------

def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/fxprof_lightning/peaks.json``, or ``~/.cache/fxprof_lightning/peaks.json``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "fxprof_lightning" / "peaks.json"


def _cache_key(device: torch.device, dtype: torch.dtype) -> str:
    return f"{device_name(device)} | torch {torch.__version__} | {dtype}"


def _read_cache(path: Path) -> dict[str, Any]:
    """The cached entries, or {} when the file is missing, unreadable or not what this module writes."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("peaks") if isinstance(data, dict) and data.get("format") == _CACHE_FORMAT else None
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace ``path`` atomically (a temporary file in the same directory, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peaks-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _CACHE_FORMAT, "peaks": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def spec_sheet_peaks(name: str, dtype: torch.dtype = torch.float32, tf32: bool = False) -> Peaks | None:
    """A known GPU's data-sheet peaks for ``dtype`` (``tf32``: float32 matmuls on TF32 tensor cores), or None.

    >>> spec_sheet_peaks("NVIDIA H100 80GB HBM3", torch.bfloat16)
    Peaks(gflops_per_s=989400.0, gbytes_per_s=3350.0, device='NVIDIA H100 80GB HBM3 (H100 SXM spec sheet)', source='spec sheet', op_floor_us=5.0)
    >>> spec_sheet_peaks("AMD EPYC 7B13") is None
    True
    """
    words = name.lower().replace("-", " ").split()
    key = "tf32" if dtype == torch.float32 and tf32 else str(dtype).removeprefix("torch.")
    for pattern, what, tflops, terabytes in SPEC_SHEET:
        if all(p in words for p in pattern) and key in tflops:
            return Peaks(gflops_per_s=tflops[key] * 1e3, gbytes_per_s=terabytes * 1e3, device=f"{name} ({what} spec sheet)",
                         source="spec sheet")
    return None


def device_peaks(device: torch.device | str = "cpu", cache_path: Path | str | None = None,
                 dtype: torch.dtype = torch.float32, calibrate: bool = True) -> Peaks:
    """The peaks of ``device`` for ``dtype``: read from the cache (source ``"cached"``), else measured and cached.

    The cache is a JSON file (``default_cache_path()`` when ``cache_path`` is None) with one entry
    per device name (CPU model and thread count, or GPU name), torch version and dtype. A missing,
    unreadable or corrupt file means measuring again; a cache that cannot be written only warns.
    ``calibrate=False``: a GPU in ``SPEC_SHEET`` with nothing cached gets its data-sheet peaks (source
    ``"spec sheet"``) instead of the micro-benchmark.
    """
    device = _resolve(device)
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = _cache_key(device, dtype)
    entry = _read_cache(path).get(key)
    if isinstance(entry, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return Peaks(gflops_per_s=entry["gflops_per_s"], gbytes_per_s=entry["gbytes_per_s"],
                         device=str(entry.get("device", "")), source="cached",
                         op_floor_us=float(entry.get("op_floor_us", DEFAULT_OP_FLOOR_US)))
    if not calibrate and device.type == "cuda":  # (a kernel launch and dispatch: DEFAULT_OP_FLOOR_US)
        known = spec_sheet_peaks(torch.cuda.get_device_name(device), dtype, torch.backends.cuda.matmul.allow_tf32)
        if known is not None:
            return known
    peaks = measure_peaks(device, dtype)
    entries = _read_cache(path)  # again: another process may have added its device meanwhile
    entries[key] = {"gflops_per_s": peaks.gflops_per_s, "gbytes_per_s": peaks.gbytes_per_s, "device": peaks.device,
                    "op_floor_us": peaks.op_floor_us,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        _write_cache(path, entries)
    except OSError as e:
        warnings.warn(f"fxprof_lightning: could not cache device peaks in {path} ({e}); they will be measured "
                      "again next time", FxprofWarning, stacklevel=2)
    return peaks
