"""Profile a torchvision ResNet18 trained with Lightning on FakeData (CPU, nothing downloaded).

    python examples/train_resnet18.py                 # 75 steps, 5 cycles: under a minute on 2 CPU cores
    python examples/train_resnet18.py --max-steps 12  # a quick look

The profiler prints one line per cycle as it completes and a summary at the end of fit. Each
cycle directory holds the trace (open it in https://ui.perfetto.dev), the node and module
tables (CSV), cycle.jsonl and two pictures; `python -m fxprof_lightning report <dir>` summarises
the run. TensorBoard shows the totals and tracked layers (SCALARS, CUSTOM SCALARS), the tables
(TEXT) and the pictures (IMAGES).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torchvision
from lightning.pytorch.loggers import TensorBoardLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torchvision import transforms

from fxprof_lightning import FXProfilerCallback


class LitResNet(pl.LightningModule):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.model = torchvision.models.resnet18(num_classes=classes)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=75)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--root", default="lightning_logs_example", help="where logs and traces go")
    parser.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu (default), cuda, auto")
    args = parser.parse_args()

    pl.seed_everything(0)
    data = torchvision.datasets.FakeData(
        size=args.max_steps * args.batch_size,
        image_size=(3, args.image_size, args.image_size),
        num_classes=10,
        transform=transforms.ToTensor(),
    )
    profiler = FXProfilerCallback(skip_first=5, wait=10, warmup=1, active=3, module="model", top_k=10)
    logger = TensorBoardLogger(save_dir=args.root, name="resnet18")
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator=args.accelerator,
        logger=logger,
        callbacks=[profiler],
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # keeps the profiler's one line per cycle readable
    )
    trainer.fit(LitResNet(), DataLoader(data, batch_size=args.batch_size, num_workers=0))
    # The callback's summary ends with where to look (the report command, TensorBoard, the traces): nothing to add.


if __name__ == "__main__":
    main()
