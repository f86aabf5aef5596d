"""Lightning's FSDP strategies with the callback. They refuse the CPU, so these run only where CUDA is.

Written for a GPU machine: they have not run on one yet (see the README).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from fsdp2_train import Net
from helpers import notices
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.capture.dynamo import missing_for_dynamo
from fxprof_lightning.capture.verify import fsdp2_kept

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDP strategies need a CUDA GPU")
SCHEDULE = {"wait": 1, "warmup": 1, "active": 2, "repeat": 1}


def cuda_trainer(root, callback, strategy) -> pl.Trainer:
    return pl.Trainer(default_root_dir=str(root), callbacks=[callback], max_steps=5, accelerator="cuda", devices=1,
                      strategy=strategy, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(48, 16, generator=generator), torch.randint(0, 4, (48,), generator=generator)),
                      batch_size=8)


class LitNet(pl.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.shard = shard
        self.model = Net()

    def configure_model(self) -> None:
        if self.shard:  # ModelParallelStrategy: FSDP2 per block and at the root
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@notices("lacks what the Dynamo capture needs", "timed by module hooks")
def test_model_parallel_strategy_with_fully_shard(tmp_path):
    callback = FXProfilerCallback(**SCHEDULE, module="model")
    trainer = cuda_trainer(tmp_path, callback, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    trainer.fit(LitNet(shard=True), loader())
    (cycle,) = callback.cycles
    assert cycle.steps == [2, 3]
    timed = {n.name for n in cycle.nodes if n.bwd_calls}
    if fsdp2_kept() and missing_for_dynamo() is None:  # Dynamo: a row per layer inside the sharded blocks
        assert cycle.capture.method == "dynamo" and cycle.capture.leaves == {}
        assert {"fc_in", "blocks_0_fc1", "blocks_1_fc2", "head"} <= timed
    else:  # module hooks: a row per module
        assert cycle.capture.method == "module_hooks"
        assert {"fc_in", "blocks.0.fc1", "blocks.1.fc2", "head"} <= timed


@notices("lacks what the Dynamo capture needs")
def test_fsdp_strategy(tmp_path):
    callback = FXProfilerCallback(**SCHEDULE, module="model")
    trainer = cuda_trainer(tmp_path, callback, FSDPStrategy())
    trainer.fit(LitNet(shard=False), loader())
    (cycle,) = callback.cycles
    assert cycle.steps == [2, 3] and cycle.nodes and all(n.mean_ms > 0 for n in cycle.nodes)
