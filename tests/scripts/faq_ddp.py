"""The FAQ's claims about DDP, demonstrated by one real 2-process run (Lightning's launcher re-runs this script).

Usage: python faq_ddp.py --dir DIR

Every rank writes what it saw to ``DIR/rank<R>.json``; ``tests/test_faq.py`` compares the ranks and recomputes
the single-device answer. Two fits run in the same processes:

1. ``mean``: ``cross_entropy(reduction="mean")``, 2 epochs over 16 indexed samples (batch 4 per rank, shuffled),
   validation on 9 samples, and at the end of the last epoch a ``trainer.save_checkpoint`` whose write on rank 0
   is delayed by 2 s (:class:`SlowCheckpointIO`), after which every rank immediately reads the file.
2. ``sum``: ``reduction="sum"``, one step.

In both, each rank initialises its model from a different seed (``100 + rank``), so the weights differ before
DDP wraps the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_strategy import SafeDDPStrategy
from ddp_strategy.checkpoint import SafeCheckpointIO, verify

WRITE_DELAY = 2.0
LR = 0.5


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))  # one node: the local rank is the global rank


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """``n`` fixed random samples that also return their index, so each rank can report what it saw."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class SlowCheckpointIO(SafeCheckpointIO):
    """Records which rank writes and waits ``WRITE_DELAY`` seconds before writing."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        (self.out / f"written-by-rank{rank()}").touch()
        time.sleep(WRITE_DELAY)
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def tensors(module: nn.Module) -> dict[str, list[Any]]:
    return {k: v.detach().cpu().tolist() for k, v in module.state_dict().items()}


class FaqModel(pl.LightningModule):
    def __init__(self, reduction: str, out: Path) -> None:
        super().__init__()
        torch.manual_seed(100 + rank())  # a different initialisation on every rank
        self.net = nn.Linear(4, 3)
        self.reduction, self.out = reduction, out
        self.record: dict[str, Any] = {"initial": tensors(self.net), "train": [], "val": []}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, i = batch
        self.record["train"].append([self.current_epoch, i.tolist()])
        return nn.functional.cross_entropy(self.net(x), y, reduction=self.reduction)

    def on_train_start(self) -> None:
        self.record["after_wrapping"] = tensors(self.net)  # DDP has broadcast rank 0's weights by now

    def on_after_backward(self) -> None:
        if self.global_step == 0:
            self.record["grads"] = {k: p.grad.tolist() for k, p in self.net.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == 1 and "after_first_step" not in self.record:
            self.record["after_first_step"] = tensors(self.net)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, i = batch
        self.record["val"].append([self.current_epoch, i.tolist()])
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.print(f"faq: epoch {self.current_epoch} validated")  # LightningModule.print: rank 0 only

    def on_train_epoch_end(self) -> None:
        if self.reduction != "mean" or self.current_epoch != self.trainer.max_epochs - 1:
            return
        path = self.out / "faq.ckpt"
        start = time.monotonic()
        self.trainer.save_checkpoint(path)  # no barrier after it
        self.record["save_returned_after_s"] = time.monotonic() - start
        self.record["file_valid_right_after_save"] = path.exists() and verify(str(path)) is not None
        self.record["final"] = tensors(self.net)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(reduction: str, out: Path) -> dict[str, Any]:
    pl.seed_everything(1234)
    model = FaqModel(reduction, out)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SafeDDPStrategy(barrier_timeout=60, heartbeat_interval=0.2, checkpoint_io=SlowCheckpointIO(out)),
        max_epochs=2 if reduction == "mean" else 1,
        max_steps=-1 if reduction == "mean" else 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(Indexed(16, seed=0), batch_size=4, shuffle=True)
    val = DataLoader(Indexed(9, seed=1), batch_size=4) if reduction == "mean" else None
    trainer.fit(model, train, val)
    return model.record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, type=Path)
    args = parser.parse_args()
    result = {"world_size": 2, "lr": LR, "mean": fit("mean", args.dir), "sum": fit("sum", args.dir)}
    (args.dir / f"rank{rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
