"""What a run leaves behind in the process: every rank records its environment, signal handlers, logging and torch
settings and the strategy's threads before the Trainer exists and after ``fit``, ``validate`` and ``test`` returned.

    python tests/scripts/side_effects.py --strategy safe_ddp --out DIR   (or --strategy ddp, stock Lightning)

Each rank writes ``DIR/rank<r>.json``: ``before`` and ``after`` snapshots. Launched by Lightning's subprocess
launcher (2 CPU ranks): rank 1 starts with the variables the launcher set for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_strategy  # noqa: F401  (registers "safe_ddp")

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGCHLD")
LOGGERS = ("", "lightning.pytorch", "lightning.fabric", "torch.distributed", "ddp_strategy")


def snapshot() -> dict:
    return {
        "env": dict(os.environ),
        "signals": {name: repr(signal.getsignal(getattr(signal, name))) for name in SIGNALS},
        "logging": {name: [logging.getLogger(name).level, len(logging.getLogger(name).handlers)] for name in LOGGERS},
        "torch": {
            "num_threads": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "grad_enabled": torch.is_grad_enabled(),
        },
        "switch_interval": sys.getswitchinterval(),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("ddp_strategy")),
    }


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    before = snapshot()
    pl.seed_everything(7)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, loader, loader)
    trainer.validate(model, loader, verbose=False)
    trainer.test(model, loader, verbose=False)
    after = snapshot()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
