"""A LightningModule with a layer that does not take part in the loss, under DDP's default
``find_unused_parameters=False`` (the Lightning forum's most common DDP error).

    python tests/scripts/unused_params.py --strategy safe_ddp [--unused-from-step N] [--find-unused] [--static-graph]

``aux_head`` is used in the loss before step N (default 0: never used); ``--find-unused`` and ``--static-graph`` pass
``SafeDDPStrategy(find_unused_parameters=True)`` / ``(static_graph=True)``, the fixes the error names.
2 CPU ranks, Lightning's subprocess launcher. Prints ``FINISHED step=<global_step>`` on rank 0 when fit returns.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import SafeDDPStrategy


class WithAuxHead(pl.LightningModule):
    def __init__(self, unused_from_step: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.aux_head = nn.Linear(16, 4)  # meant for an auxiliary loss that is not wired in
        self.unused_from_step = unused_from_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = self.backbone(x)
        loss = nn.functional.mse_loss(self.head(features), y)
        if self.global_step < self.unused_from_step:
            loss = loss + 0.1 * self.aux_head(features).pow(2).mean()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="safe_ddp")
    parser.add_argument("--unused-from-step", type=int, default=0)
    parser.add_argument("--find-unused", action="store_true")
    parser.add_argument("--static-graph", action="store_true")
    args = parser.parse_args()
    strategy: object = args.strategy
    if args.strategy == "safe_ddp" and (args.find_unused or args.static_graph):
        kwargs = {"find_unused_parameters": True} if args.find_unused else {"static_graph": True}
        strategy = SafeDDPStrategy(**kwargs)
    pl.seed_everything(7)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(WithAuxHead(args.unused_from_step), DataLoader(data, batch_size=8))
    if trainer.is_global_zero:
        print(f"FINISHED step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
