"""The padded-duplicates example: ``trainer.test`` accuracy on 10 samples, of which exactly 9 are classified right.

The model's logits are its inputs (a one-hot vector of the predicted class), so the prediction of every sample is
known: samples 0-8 are right, sample 9 is wrong. On one device the accuracy is 9/10. A padded
``DistributedSampler`` on 3 ranks evaluates 12 samples, repeating samples 0 and 1 (both right): 11/12.

Usage: python tests/scripts/padded_accuracy.py --devices N [--strategy ddp|safe_ddp] --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torchmetrics
from lightning_namespace import pl  # registers "safe_ddp" in that namespace's registry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLASSES = 3
SAMPLES = 10


def dataset() -> TensorDataset:
    predicted = torch.arange(SAMPLES) % CLASSES
    labels = predicted.clone()
    labels[SAMPLES - 1] = (predicted[SAMPLES - 1] + 1) % CLASSES  # the one wrong answer, on the last sample
    return TensorDataset(nn.functional.one_hot(predicted, CLASSES).float(), labels)


class KnownPredictions(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # DDP needs a parameter; 1.0 keeps the logits as they are
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.accuracy(x * self.scale, y)
        self.log("acc", self.accuracy)
        self.log("samples", float(len(y)), reduce_fx="sum", sync_dist=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="safe_ddp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="auto" if args.devices == 1 else args.strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (results,) = trainer.test(KnownPredictions(), DataLoader(dataset(), batch_size=2), verbose=False)
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"world_size": trainer.world_size, **{k: float(v) for k, v in results.items()}}, f)


if __name__ == "__main__":
    sys.exit(main())
