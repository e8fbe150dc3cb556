"""What ``trainer.predict_dataloaders[i].batch_sampler.sampler`` is, per rank, and which samples each rank predicts.

Two predict dataloaders of odd sizes (7 and 5 samples, batch size 2) on 2 CPU ranks. Each sample's input is its
dataset index, so the inputs a rank sees in ``predict_step`` are the indices it ran. In ``on_predict_epoch_end``
each rank records, per dataloader: the class name of ``batch_sampler.sampler``, whether it is Lightning's
``UnrepeatedDistributedSampler`` (what Lightning's own test ``test_trainer_predict_ddp_spawn`` asserts under stock
DDP), ``list(iter(sampler))``, the batch indices a ``BasePredictionWriter`` received, and the indices seen in
``predict_step``. Every rank writes ``<out>.rank<R>.json``.

Usage: python tests/scripts/predict_sampler.py --strategy safe_ddp|ddp --out result.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from importlib import import_module
from typing import Any

import torch
from lightning_namespace import pl  # registers "safe_ddp" in that namespace's registry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SIZES = (7, 5)
BATCH_SIZE = 2
UnrepeatedDistributedSampler = import_module(f"{pl.__name__}.overrides.distributed").UnrepeatedDistributedSampler


class IndexEcho(pl.LightningModule):
    """Predicts its input (a sample's dataset index) through one parameter, and notes the indices it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # DDP needs a parameter
        self.seen: list[list[int]] = [[] for _ in SIZES]

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        (x,) = batch
        self.seen[dataloader_idx].extend(int(i) for i in x.tolist())
        return x * self.scale


class Recorder(pl.callbacks.BasePredictionWriter):
    def __init__(self, out: str) -> None:
        super().__init__(write_interval="epoch")
        self.out = out
        self.batch_indices: list[Any] = []

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        self.batch_indices = batch_indices

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_predict_epoch_end(trainer, pl_module)  # calls write_on_epoch_end
        loaders = []
        for i, dataloader in enumerate(trainer.predict_dataloaders):
            sampler = getattr(dataloader.batch_sampler, "sampler", None)
            loaders.append(
                {
                    "sampler_type": type(sampler).__name__,
                    "unrepeated": isinstance(sampler, UnrepeatedDistributedSampler),
                    "sampler_indices": [int(j) for j in sampler] if sampler is not None else None,
                    "batch_indices": [[int(j) for j in batch] for batch in self.batch_indices[i]],
                    "seen": pl_module.seen[i],
                }
            )
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "loaders": loaders}
        with open(f"{self.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="safe_ddp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        callbacks=[Recorder(args.out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = [DataLoader(TensorDataset(torch.arange(n, dtype=torch.float32)), batch_size=BATCH_SIZE) for n in SIZES]
    trainer.predict(IndexEcho(), loaders)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        # Test speed only: skip the interpreter's final garbage collection over torch's large heap (1 to 6 s per
        # process on the 2-core CI machine, more under load). Everything the tests check ran before this point.
        gc.freeze()
