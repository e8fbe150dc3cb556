"""GlobalTrainingLoss on 2 ranks: rank r's loss at batch b is exactly ``r + 1 + b``, so the global mean is known.

Writes rank 0's view of the logged values as JSON: {"step": [...], "epoch": float}.
Usage: python tests/scripts/global_loss.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy.callbacks import GlobalTrainingLoss


class RankLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.steps: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        offset = float(self.global_rank + 1 + batch_idx)
        return (self.layer(batch[0]) * 0).sum() + offset

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append(float(self.trainer.callback_metrics["train_loss_global_step"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = RankLoss()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="safe_ddp",
        max_epochs=1,
        callbacks=[GlobalTrainingLoss()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # 8 samples, batch size 2: 2 batches per rank
    trainer.fit(model, DataLoader(TensorDataset(torch.ones(8, 1)), batch_size=2))
    if trainer.is_global_zero:
        epoch = float(trainer.callback_metrics["train_loss_global_epoch"])
        with open(args.out, "w") as f:
            json.dump({"step": model.steps, "epoch": epoch}, f)


if __name__ == "__main__":
    sys.exit(main())
