"""A user's torchrun script whose process group is not the strategy's: torch's Flight Recorder then keeps 2000 calls.

Usage: torchrun --standalone --nproc-per-node 2 user_made_group.py GROUP [--steps N]

GROUP says who makes the process group, which fixes the recorder's size (torch reads it once, at the first group):
  user         the script calls ``dist.init_process_group("gloo")`` itself before the Trainer, as torchrun examples
               do, and broadcasts a setting from rank 0 (its own collective)
  earlier-fit  a first ``Trainer.fit`` with stock ``DDPStrategy`` makes it; then a second Trainer fits with
               ``SafeDDPStrategy()`` (a second phase of training in the same processes)
  strategy     ``SafeDDPStrategy()`` makes it (it sizes the recorder for desync detection)

Every dump of the recorder's entries (a call of torch's ``_dump_fr_trace`` with its collectives) made while the
``SafeDDPStrategy`` fit's training steps run is counted, on every thread: each rank prints
``rank=R dumps-in-training=[n, ...]`` (the entries each dump held, in order) and ``rank=R fit-done``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
from lightning_namespace import SafeDDPStrategy, pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

C10D = torch._C._distributed_c10d
DUMPS: list[int] = []  # entries held by each dump made while training
TRAINING = False


def counted_dump(original: Any) -> Any:
    def dump(*args: Any, **kwargs: Any) -> bytes:
        out = original(*args, **kwargs)
        if TRAINING and kwargs.get("includeCollectives", True) is not False:
            DUMPS.append(len(pickle.loads(out).get("entries", [])) if out else 0)
        return out

    return dump


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CountWhileTraining(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        global TRAINING
        TRAINING = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        global TRAINING
        TRAINING = False


def fit(strategy: Any, steps: int, callbacks: list[pl.Callback]) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * 2 * steps, 16), torch.randn(8 * 2 * steps, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("group", choices=["user", "earlier-fit", "strategy"])
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    C10D._dump_fr_trace = counted_dump(C10D._dump_fr_trace)
    if args.group == "user":
        dist.init_process_group("gloo")
        setting = torch.tensor([args.steps])
        dist.broadcast(setting, src=0)  # the user's own collective: one setting for every rank
        args.steps = int(setting.item())
    elif args.group == "earlier-fit":
        fit("ddp", 200, [])
    fit(SafeDDPStrategy(), args.steps, [CountWhileTraining()])
    rank = int(os.environ["RANK"])
    sys.stdout.write(f"rank={rank} dumps-in-training={DUMPS}\nrank={rank} fit-done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
