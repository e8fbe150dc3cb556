"""A user script with hand-made, uneven per-rank shards (Lightning issues #11242, #9851).

The user turns Lightning's DistributedSampler off and splits 60 samples by hand: rank 0 gets 32, rank 1 the
other 28, so with batch size 4 rank 0 runs 8 steps per epoch and rank 1 runs 7. DDP all-reduces gradients at
every step, so stock Lightning's rank 0 waits forever in its 8th step.

With ``--shrink-at-epoch E`` the shards are even (32 samples each) until rank 1's loses one batch (4 samples) at
epoch E: ``train_dataloader`` builds them from ``self.current_epoch``, and the Trainer reloads it every epoch
(``reload_dataloaders_every_n_epochs=1``, ``max_epochs=E + 1``).

Usage: python uneven_inputs.py --strategy safe_ddp|ddp [--uneven-inputs raise|warn] [--shrink-at-epoch E]
Every rank prints ``rank=R step=S epoch=E`` after each training step and ``rank=R fit-done`` when ``fit`` returns.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import torch
from lightning_namespace import SafeDDPStrategy, pl
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

PER_RANK = 32


class Regressor(pl.LightningModule):
    def __init__(self, shrink_at_epoch: int | None = None) -> None:
        super().__init__()
        self.shrink_at_epoch = shrink_at_epoch
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # one write: lines do not run together
        sys.stdout.write(f"rank={self.global_rank} step={batch_idx + 1} epoch={self.current_epoch}\n")
        sys.stdout.flush()

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g))
        rank = self.global_rank
        size = PER_RANK
        shrink = self.shrink_at_epoch
        if rank == 1 and (shrink is None or self.current_epoch >= shrink):
            size -= 4  # rank 1: 7 batches (from the start, or from epoch `shrink` on)
        return DataLoader(Subset(data, range(rank * PER_RANK, rank * PER_RANK + size)), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="safe_ddp")
    parser.add_argument("--uneven-inputs", default="raise")
    parser.add_argument("--shrink-at-epoch", type=int, default=None)
    args = parser.parse_args()
    shrink = args.shrink_at_epoch
    pl.seed_everything(0)
    strategy: Any = SafeDDPStrategy(uneven_inputs=args.uneven_inputs) if args.strategy == "safe_ddp" else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1 if shrink is None else shrink + 1,
        reload_dataloaders_every_n_epochs=0 if shrink is None else 1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(shrink))
    sys.stdout.write(f"rank={trainer.global_rank} fit-done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        # Test speed only: skip the interpreter's final garbage collection over torch's large heap (1 to 6 s per
        # process on the 2-core CI machine, more under load). Everything the tests check ran before this point.
        gc.freeze()
