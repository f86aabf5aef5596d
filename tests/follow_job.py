"""A training job for tests/test_follow.py, run in a subprocess: it trains until a cycle out of the schedule has been
written (or ``--seconds`` pass), then writes what each rank recorded to ``<out>/result<rank>.json``.

    python tests/follow_job.py OUT {plain,trainer,ddp} [--seconds S] [--slow-from STEP]

The schedule's ``wait`` is longer than the run, so only a request (``fxprof trigger OUT/fxprof``) or a jump of the
step time (``--slow-from``: each step sleeps 3x longer from that step on) starts a cycle. With ``ddp`` two gloo
ranks train, and only rank 0's ``dirpath`` is ``OUT/fxprof``: rank 1 writes to ``OUT/rank1`` (a file system only
rank 0 sees the request on).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
from torch import nn

STEP_S = 0.004


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def pause(step: int, slow_from: int | None) -> None:
    time.sleep(3 * STEP_S if slow_from is not None and step >= slow_from else STEP_S)


def plain(out: Path, rank: int, seconds: float, slow_from: int | None) -> None:
    from fxprof_lightning import Profiler

    net = model()
    dirpath = out / "fxprof" if rank == 0 else out / f"rank{rank}"
    started = time.monotonic()
    with Profiler(net, dirpath=dirpath, wait=10**6, warmup=1, active=3, torch_profiler=False, pictures=False) as prof:
        step = 0
        while True:
            net(torch.randn(8, 16)).sum().backward()
            pause(step, slow_from)
            prof.step()
            step += 1
            done = torch.tensor([len(prof.cycles) > 0 or time.monotonic() - started > seconds], dtype=torch.int32)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)  # every rank stops together
            if done.item():
                break
    write(out, rank, prof.cycles, step)


def trainer(out: Path, seconds: float, slow_from: int | None) -> None:
    import lightning.pytorch as pl
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from fxprof_lightning import FXProfilerCallback

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model()

        def training_step(self, batch, batch_idx):
            pause(self.global_step, slow_from)
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StopAfterACycle(pl.Callback):
        def __init__(self, started: float) -> None:
            self.started = started

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if callback.cycles or time.monotonic() - self.started > seconds:
                trainer.should_stop = True

    callback = FXProfilerCallback(module="model", wait=10**6, warmup=1, active=3, dirpath=out / "fxprof",
                                  torch_profiler=False, pictures=False)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    fit = pl.Trainer(max_steps=10**6, callbacks=[callback, StopAfterACycle(time.monotonic())], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=out, accelerator="cpu", devices=1)
    fit.fit(Lit(), DataLoader(data, batch_size=8))
    write(out, 0, callback.cycles, fit.global_step)


def write(out: Path, rank: int, cycles: list, steps: int) -> None:
    result = {"steps_run": steps, "cycles": [{"steps": c.steps, "trigger": c.trigger, "label": c.label,
                                              "directory": c.directory.name} for c in cycles]}
    (out / f"result{rank}.json").write_text(json.dumps(result))


def ddp_rank(rank: int, out: Path, port: int, seconds: float) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        plain(out, rank, seconds, None)
    finally:
        torch.distributed.destroy_process_group()
    # Done (the result written): leave without C++ static destructors. Now and then a rank aborted at interpreter exit
    # with "terminate called without an active exception" (a C++ thread left joinable; CI, 2026-11-27), as
    # fsdp2_train.py's ranks did.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=("plain", "trainer", "ddp"))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slow-from", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "plain":
        plain(args.out, 0, args.seconds, args.slow_from)
    elif args.mode == "trainer":
        trainer(args.out, args.seconds, args.slow_from)
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        torch.multiprocessing.spawn(ddp_rank, args=(args.out, port, args.seconds), nprocs=2)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
