"""A user's LightningModule with one rank-dependent collective (or uneven data), as the DDP hang threads write it.

Usage: python desync.py CASE [--strategy safe_ddp|ddp] [--launcher popen|spawn] [--accelerator cpu|gpu]

Cases (each the user's own mistake, at a line the tests look for in the error):
  log-in-rank-zero-branch   ``self.log("x", ..., sync_dist=True)`` inside ``if self.trainer.is_global_zero:`` in
                            ``on_train_epoch_end`` (Lightning #19604)
  log-in-training-step-rank-zero  ``self.log("step_x", loss, sync_dist=True)`` on rank 0 only in ``training_step``
                            (batch 2): rank 1's next collective is DDP's larger gradient all-reduce
  broadcast-on-rank-zero    ``self.trainer.strategy.broadcast(obj)`` on rank 0 only, in ``training_step``
  all-gather-on-rank-zero   ``self.all_gather(tensor)`` on rank 0 only, in ``training_step``
  differing-keys            ``self.log(f"loss_rank{rank}", loss, sync_dist=True)``: each rank logs another name
                            (Lightning #19106): the backend pairs the calls and mixes the values silently
  metric-compute-on-rank-zero  a torchmetrics ``MeanMetric``'s ``compute()`` on rank 0 only, in
                            ``on_train_epoch_end``
  all-gather-shapes         ``self.all_gather`` of a tensor whose shape differs per rank, in ``training_step``
  validation-rank-zero      ``self.log("val_x", ..., sync_dist=True)`` under ``is_global_zero`` in
                            ``on_validation_epoch_end``
  validation-step-rank-zero ``self.all_gather(tensor)`` on rank 0 only in ``validation_step`` (batch 0, not in the
                            sanity check)
  test-rank-zero            ``self.log("test_x", ..., sync_dist=True)`` under ``is_global_zero`` in
                            ``on_test_epoch_end``, run by ``trainer.test`` (no fit)
  predict-rank-zero         ``self.all_gather(tensor)`` on rank 0 only in ``predict_step``, run by ``trainer.predict``
                            (no fit)
  silent-pairing            in ``on_train_epoch_end`` of epoch 0 rank 0 all-reduces one tensor, rank 1 another of the
                            same shape at another line: gloo pairs the two calls, nothing waits, the values mix
                            silently (8 epochs, 0.1 s a step, so the ranks go on for seconds)
  silent-pairing-at-end     the same in the last epoch: the run ends right after
  uneven-iterable           no DistributedSampler; an IterableDataset of 8 batches on rank 0 and 6 on rank 1
  slow-rank-zero            correct: rank 0 spends 8 s alone in ``on_train_epoch_end`` (a large checkpoint write)
                            while rank 1 waits in the next collective

Every rank prints ``rank=R diverged-at=T`` when it takes the rank-dependent branch (or runs out of data),
``rank=R step=S`` after each training step, ``rank=R fit-done`` when ``fit`` returns (``test-done``, ``predict-done``
for the cases run by ``test``, ``predict``) and ``rank=R exits-at=T`` at the end (not after an ``os._exit``).
``--launcher spawn`` uses the spawn launcher (the ranks import this file anew: the case reaches them in
``DESYNC_CASE``); ``--accelerator gpu`` runs on 2 GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import torch
import torchmetrics
from lightning_namespace import SafeDDPStrategy, pl
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

CASE = os.environ.get("DESYNC_CASE", "")  # set by main(); a rank of the spawn launcher imports this file anew


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: lines of two ranks do not run together
    sys.stdout.flush()


def diverged(rank: int) -> None:
    say(f"rank={rank} diverged-at={time.time():.3f}")


class Shard(IterableDataset):
    """Rank 0 yields 32 samples, rank 1 24: 8 and 6 batches of 4, a count no rank knows in advance."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.rank)
        count = 32 if self.rank == 0 else 24
        for i in range(count):
            if i == count - 1 and self.rank == 1:
                diverged(self.rank)
            yield torch.randn(8, generator=g), torch.randn((), generator=g)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.mean_loss = torchmetrics.MeanMetric()
        self.logged_once = False
        self.last_loss = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        if CASE == "silent-pairing":
            time.sleep(0.1)  # a longer run: the ranks go on after the divergence for about 12 s
        if CASE == "log-in-training-step-rank-zero" and batch_idx == 2 and self.trainer.is_global_zero:
            diverged(self.global_rank)  # rank 1's next collective is DDP's gradient all-reduce, of 161 floats
            self.log("step_x", loss, sync_dist=True)  # USER-LINE log-in-training-step-rank-zero
        if CASE == "broadcast-on-rank-zero" and batch_idx == 2 and self.trainer.is_global_zero:
            diverged(self.global_rank)
            self.trainer.strategy.broadcast({"lr": 0.1})  # USER-LINE broadcast-on-rank-zero
        if CASE == "all-gather-on-rank-zero" and batch_idx == 2 and self.trainer.is_global_zero:
            diverged(self.global_rank)
            self.all_gather(loss.detach())  # USER-LINE all-gather-on-rank-zero
        if CASE == "all-gather-shapes" and batch_idx == 2:
            diverged(self.global_rank)
            self.all_gather(torch.zeros(self.global_rank + 1, device=self.device))  # USER-LINE all-gather-shapes
        if CASE == "differing-keys":
            if not self.logged_once:
                diverged(self.global_rank)
                self.logged_once = True
            self.log(f"loss_rank{self.global_rank}", loss, sync_dist=True)  # USER-LINE differing-keys
            self.last_loss = loss.item()
        self.mean_loss.update(loss.detach())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        sanity = self.trainer.sanity_checking
        if CASE == "validation-step-rank-zero" and batch_idx == 0 and self.trainer.is_global_zero and not sanity:
            diverged(self.global_rank)
            self.all_gather(x.sum())  # USER-LINE validation-step-rank-zero
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if CASE == "validation-rank-zero" and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            diverged(self.global_rank)
            self.log("val_x", torch.tensor(1.0, device=self.device), sync_dist=True)  # USER-LINE validation-rank-zero

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def on_test_epoch_end(self) -> None:
        if CASE == "test-rank-zero" and self.trainer.is_global_zero:
            diverged(self.global_rank)
            self.log("test_x", torch.tensor(1.0, device=self.device), sync_dist=True)  # USER-LINE test-rank-zero

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        if CASE == "predict-rank-zero" and batch_idx == 0 and self.trainer.is_global_zero:
            diverged(self.global_rank)
            self.all_gather(x.sum())  # USER-LINE predict-rank-zero
        return self.net(x)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        say(f"rank={self.global_rank} step={batch_idx + 1}")

    def on_train_epoch_end(self) -> None:
        if CASE == "log-in-rank-zero-branch" and self.trainer.is_global_zero:
            diverged(self.global_rank)
            self.log("x", torch.tensor(1.0, device=self.device), sync_dist=True)  # USER-LINE log-in-rank-zero-branch
        if CASE == "slow-rank-zero" and self.trainer.is_global_zero and self.current_epoch == 0:
            time.sleep(8.0)
        if CASE == "metric-compute-on-rank-zero" and self.trainer.is_global_zero:
            diverged(self.global_rank)
            self.mean_loss.compute()  # USER-LINE metric-compute-on-rank-zero
        last = self.trainer.max_epochs - 1
        if CASE.startswith("silent-pairing") and self.current_epoch == (last if CASE.endswith("at-end") else 0):
            diverged(self.global_rank)  # each rank all-reduces another tensor of one shape: gloo pairs them
            if self.global_rank == 0:
                torch.distributed.all_reduce(torch.ones(1))  # USER-LINE silent-pairing-rank0
            else:
                torch.distributed.all_reduce(torch.zeros(1))  # USER-LINE silent-pairing-rank1
        self.mean_loss.reset()

    def train_dataloader(self) -> DataLoader:
        if CASE == "uneven-iterable":
            return DataLoader(Shard(self.global_rank), batch_size=4)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g))
        return DataLoader(data, batch_size=4)

    def val_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, generator=g)), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    global CASE
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("--strategy", default="safe_ddp", choices=("safe_ddp", "ddp"))
    parser.add_argument("--launcher", default="popen", choices=("popen", "spawn"))
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    args = parser.parse_args()
    os.environ["DESYNC_CASE"] = CASE = args.case
    pl.seed_everything(0)
    stock = "ddp" if args.launcher == "popen" else "ddp_spawn"
    strategy: Any = SafeDDPStrategy(start_method=args.launcher) if args.strategy == "safe_ddp" else stock
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=strategy,
        max_epochs=8 if CASE == "silent-pairing" else 2,
        use_distributed_sampler=CASE != "uneven-iterable",
        limit_val_batches=1.0 if CASE in ("validation-rank-zero", "validation-step-rank-zero") else 0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    if CASE == "test-rank-zero":
        trainer.test(model, verbose=False)
    elif CASE == "predict-rank-zero":
        trainer.predict(model, return_predictions=False)
    else:
        trainer.fit(model)
    stage = {"test-rank-zero": "test", "predict-rank-zero": "predict"}.get(CASE, "fit")
    say(f"rank={trainer.global_rank} {stage}-done")
    if CASE == "differing-keys" and args.launcher == "popen":  # stock Lightning gets here: what each rank logged
        key = f"loss_rank{trainer.global_rank}"
        synced = trainer.callback_metrics[key].item()
        say(f"rank={trainer.global_rank} {key}={synced:.6f} own={model.last_loss:.6f} (last step)")


if __name__ == "__main__":
    try:
        main()
    finally:
        say(f"rank={int(__import__('os').environ.get('LOCAL_RANK', 0))} exits-at={time.time():.3f}")
        gc.freeze()  # test speed only: skip the final garbage collection over torch's heap
