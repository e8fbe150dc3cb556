"""Every rank fails by itself at the same step: a data check in ``training_step`` that every rank's batch fails
(the shape of a NaN loss or a bad-label guard), 2 CPU ranks, Lightning's subprocess launcher.

    python tests/scripts/same_failure.py --strategy safe_ddp   (or ddp)
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_strategy  # noqa: F401  (registers "safe_ddp")


class GuardedRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == 2:  # every rank's batch fails the same guard at the same step
            raise ValueError("labels out of range in this batch")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="safe_ddp")
    args = parser.parse_args()
    pl.seed_everything(3)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GuardedRegression(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
