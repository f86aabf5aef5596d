"""FSDP2 in a plain loop on 2 gloo processes, with and without ``Profiler``:
``python fsdp2_train.py OUT_DIR [keep] [bf16] [change]``.

Each rank trains a model sharded with ``fully_shard`` per block and at the root (``reshard_after_forward``: True by
default, False with ``keep``; with ``bf16``, a ``MixedPrecisionPolicy`` computing in bfloat16), first without and
then with the profiler, from the same seed and batches; with ``change``, the second block is skipped from step 2 on
(a Python flag its forward reads: Dynamo's guard on it fails in a recorded step). Rank 0 writes ``OUT_DIR/result.json``:
whether the full weights are bitwise equal, and what the profiler reported.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

from fxprof_lightning import CsvSink, Profiler

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


def train(rank: int, mesh, profiler_dir: Path | None, options: list[str]) -> tuple[dict[str, torch.Tensor], Profiler | None]:
    torch.manual_seed(0)
    model = Net()
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
        profiler = Profiler(model, wait=1, warmup=1, active=2, repeat=1, dirpath=profiler_dir, sinks=[CsvSink()], ranks=[0])
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


def worker(rank: int, port: int, out: Path, options: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        plain, _ = train(rank, mesh, None, options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            profiled, profiler = train(rank, mesh, out / "fxprof", options)
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
                "ranges": [[r.name, r.module, r.ms_per_step] for r in cycle.ranges],
                "markdown": cycle.to_markdown(),
                "files": sorted(p.name for p in cycle.directory.iterdir()),
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
