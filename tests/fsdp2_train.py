"""FSDP2 in a plain loop on 2 gloo processes, with and without ``Profiler``:
``python fsdp2_train.py OUT_DIR [keep] [bf16] [change] [unrolled] [untraced]``.

Each rank trains a model sharded with ``fully_shard`` per block and at the root (``reshard_after_forward``: True by
default, False with ``keep``; with ``bf16``, a ``MixedPrecisionPolicy`` computing in bfloat16), first without and
then with the profiler, from the same seed and batches; with ``change``, the second block is skipped from step 2 on
(a Python flag its forward reads: Dynamo's guard on it fails in a recorded step); with ``unrolled``, the root calls its
blocks one by one instead of in a loop (Dynamo captures the root's frame, broken at each block's FSDP2 hooks, and the
code it runs eagerly between two graphs is a row); with ``untraced``, the profiler writes no trace
(``torch_profiler=False``). Rank 0 writes ``OUT_DIR/result.json``: whether the full weights are bitwise equal, what
the profiler reported, and each rank's own report of the cycle (``per_rank``).
"""

from __future__ import annotations

import csv
import json
import os
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

from fxprof_lightning import CsvSink, Profiler
from fxprof_lightning.engine.cycle import Cycle

STEPS = 5


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.used = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x))) if self.used else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 4)
        self.out_bias = nn.Parameter(torch.zeros(4))  # the root's own parameter: FSDP2 swaps it at every forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc_in(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.out_bias


class UnrolledNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc_in(x)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        return self.head(x) + self.out_bias


def train(rank: int, mesh, profiler_dir: Path | None, options: list[str]) -> tuple[dict[str, torch.Tensor], Profiler | None]:
    torch.manual_seed(0)
    model = UnrolledNet() if "unrolled" in options else Net()
    sharding = {"reshard_after_forward": "keep" not in options}
    if "bf16" in options:
        sharding["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **sharding)
    fully_shard(model, mesh=mesh, **sharding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(STEPS)]
    profiler = None
    if profiler_dir is not None:
        # ranks=[0]: rank 1 writes no trace, but times nodes and takes part in the gather.
        profiler = Profiler(model, wait=1, warmup=1, active=2, repeat=1, dirpath=profiler_dir, sinks=[CsvSink()], ranks=[0],
                            torch_profiler="untraced" not in options)
        profiler.start()
    for step, (x, y) in enumerate(batches):
        if step == 2 and "change" in options:
            model.blocks[1].used = False
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()
    weights = {name: value.full_tensor() for name, value in model.state_dict().items()}
    return weights, profiler


def fsdp2_rows(report) -> dict[str, list]:
    """The report's rows of FSDP2's collectives: name -> module path, layer, forward calls and ms per call, backward."""
    return {n.name: [n.module_path, n.layer, n.calls, n.mean_ms, n.bwd_calls, n.bwd_mean_ms] for n in report.nodes
            if n.op == "fsdp2"}


def own_report(reports: list) -> Callable[..., Any]:
    """``Cycle.measure`` that also keeps this rank's own report of the cycle (``Cycle.report`` as a one-rank run makes
    it, with the forward wall: the merged report of two ranks has none); what it measures passes on unchanged."""
    measure = Cycle.measure

    def measured(cycle: Cycle, module: nn.Module, warn: Callable[[str], None]) -> Any:
        nodes = measure(cycle, module, warn)
        report = cycle.report("train", nodes or [], [], 1, False, lambda path: type(module.get_submodule(path)).__name__)
        reports.append({"rows": fsdp2_rows(report), "forward_wall_ms": report.forward_wall_ms,
                        "backward_wall_ms": report.backward_wall_ms, "backward_outside_ms": report.backward_outside_ms,
                        "forward_ms_per_step": report.forward_ms_per_step,
                        "backward_ms_per_step": report.backward_ms_per_step, "unowned": report.unowned(),
                        "breaks": {n.name: n.mean_ms for n in report.nodes if n.op == "graph_break"}})
        return nodes

    return measured


def worker(rank: int, port: int, out: Path, options: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        plain, _ = train(rank, mesh, None, options)
        reports: list[dict] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Cycle.measure, measure = own_report(reports), Cycle.measure
            try:
                profiled, profiler = train(rank, mesh, out / "fxprof", options)
            finally:
                Cycle.measure = measure
        per_rank: list[Any] = [None, None]
        dist.all_gather_object(per_rank, reports)
        if rank == 0:
            (cycle,) = profiler.cycles
            result = {
                "bitwise_equal": all(torch.equal(plain[k], profiled[k]) for k in plain),
                "steps": cycle.steps,
                "ranks": cycle.ranks,
                "method": cycle.capture.method,
                "leaves": cycle.capture.leaves,
                "untimed": cycle.capture.untimed,
                "error": cycle.capture.error,
                "warnings": [str(w.message) for w in caught if "Profiler" in str(w.message)],
                "nodes": {n.name: [n.op, n.calls, n.mean_ms, n.bwd_calls] for n in cycle.nodes},
                "flops": {n.name: [n.fwd_flops, n.bwd_flops] for n in cycle.nodes},
                "saved": {n.name: n.saved_bytes for n in cycle.nodes},
                "module_memory": {m.path: [m.saved_bytes_per_step, m.param_bytes] for m in cycle.modules},
                "ranges": [[r.name, r.module, r.ms_per_step] for r in cycle.ranges],
                "markdown": cycle.to_markdown(),
                "files": sorted(p.name for p in cycle.directory.iterdir()),
                "fsdp2": fsdp2_rows(cycle),
                "csv_rows": [row["name"] for row in csv.DictReader((cycle.directory / "fx_nodes.csv").open())
                             if row["op"] == "fsdp2"] if (cycle.directory / "fx_nodes.csv").exists() else [],
                "tracked": cycle.tracked,
                "per_rank": [rank_reports[0] if rank_reports else None for rank_reports in per_rank],
            }
            (out / "result.json").write_text(json.dumps(result))
        dist.barrier()  # without it, a rank can abort in teardown while the other still talks to it
    finally:
        dist.destroy_process_group()
    # Done: leave without running C++ static destructors. Now and then, at interpreter exit, a rank still aborted
    # with "terminate called without an active exception" (a C++ thread left joinable, after all the work and the
    # process group's destruction), which mp.spawn reports as a failure of the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(worker, args=(free_port, Path(sys.argv[1]), sys.argv[2:]), nprocs=2)
