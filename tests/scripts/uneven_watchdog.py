"""A user script whose ranks stream uneven shards, watched by ``HangWatchdog`` only (issue 15's original report).

The user turns Lightning's DistributedSampler off and streams a shard per rank from an ``IterableDataset``:
rank 0's holds 8 batches, rank 1's 6. Rank 1 finishes its epoch after 6 steps and leaves the training loop;
rank 0 waits forever in DDP's gradient all-reduce of its 7th step (in C++). Neither the desync detection nor the
upfront batch-count check is on (``SafeDDPStrategy(desync_detection=False, uneven_inputs=None)``; an iterable
dataset has no length anyway), so the watchdog is the one that reports.

Usage: python uneven_watchdog.py --timeout S --dump-dir DIR [--grace S]
Every rank prints ``rank=R step=S`` after each training step and ``rank=R fit-done`` when ``fit`` returns.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Iterator
from typing import Any

import torch
from lightning_namespace import SafeDDPStrategy, callbacks, pl
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

BATCHES = {0: 8, 1: 6}  # batches of 4 samples in each rank's shard


class Shard(IterableDataset):  # type: ignore[type-arg]
    """This rank's shard of a stream of (x, y) samples, as a user would read it from per-rank files."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.rank)
        for _ in range(BATCHES[self.rank] * 4):
            yield torch.randn(8, generator=g), torch.randn((), generator=g)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        sys.stdout.write(f"rank={self.global_rank} step={batch_idx + 1}\n")  # one write: lines do not run together
        sys.stdout.flush()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Shard(self.global_rank), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=6.0, help="HangWatchdog(timeout=...)")
    parser.add_argument("--grace", type=float, default=3.0, help="HangWatchdog(grace_period=...)")
    parser.add_argument("--dump-dir", default=None, help="HangWatchdog(dump_dir=...)")
    parser.add_argument("--no-weight-check", action="store_true", help="SafeDDPStrategy(weight_check=None)")
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SafeDDPStrategy(
            desync_detection=False, uneven_inputs=None, weight_check=None if args.no_weight_check else "epoch"
        ),
        max_epochs=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callbacks.HangWatchdog(timeout=args.timeout, grace_period=args.grace, dump_dir=args.dump_dir)],
    )
    trainer.fit(Regressor())
    sys.stdout.write(f"rank={trainer.global_rank} fit-done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        # Test speed only: skip the interpreter's final garbage collection over torch's large heap (1 to 6 s per
        # process on the 2-core CI machine, more under load). Everything the tests check ran before this point.
        gc.freeze()
