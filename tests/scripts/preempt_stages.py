"""A classifier with a slow validation, stopped by SIGTERM during validation inside fit, or during validate, test
or predict (issue 28). Lightning's launcher re-runs this script per rank.

Usage::

    python preempt_stages.py --stage fit|validate|test|predict --strategy safe_ddp|ddp
        [--sigterm-at RANK:BATCH ...] [--signal-at-step S] [--ckpt-dir DIR] [--resume last] [--metrics-out FILE]
        [--save-weights FILE] [--launcher subprocess|spawn]

Evaluation batches take ``--eval-sleep`` seconds each (in ``fit``: in the validation at the signal's step, or the
next one; the others are fast). ``--sigterm-at RANK:BATCH``: that rank sends itself SIGTERM at the end of that
evaluation batch (in ``fit``: of the validation at global step ``--signal-at-step``, not the sanity check);
``RANK:-1``: at the end of the training batch that made ``global_step`` ``--signal-at-step``. Every rank prints
``preempt_stages: rank R finished STAGE`` when the stage returns. Rank 0 appends each validation's metrics
(``fit``, outside the sanity check) to ``--metrics-out`` as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch
import torchmetrics
from lightning_namespace import ModelCheckpoint, SafeDDPStrategy, pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self, step_sleep: float, eval_sleep: float, slow_at_step: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.step_sleep, self.eval_sleep, self.slow_at_step = step_sleep, eval_sleep, slow_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_sleep)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        fitting = self.trainer.state.fn == "fit"
        time.sleep(self.eval_sleep if not fitting or self.global_step == self.slow_at_step else 0.002)
        x = x + 0.01 * torch.randn_like(x)  # a random test-time augmentation: the validation draws from the RNG
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        time.sleep(self.eval_sleep)
        self.test_acc(self.net(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.eval_sleep)
        return self.net(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


class SignalAt(pl.Callback):
    """Rank ``rank`` sends itself SIGTERM at the end of evaluation batch ``batch`` (in fit: at ``step``)."""

    def __init__(self, targets: dict[int, int], step: int, sanity: bool = False) -> None:
        self.targets, self.step, self.sanity = targets, step, sanity

    def _maybe(self, trainer: pl.Trainer, batch_idx: int, stage: str) -> None:
        if trainer.global_rank not in self.targets or batch_idx != self.targets[trainer.global_rank]:
            return
        in_fit = stage == "validation" and trainer.state.fn == "fit"
        if in_fit and (trainer.sanity_checking != self.sanity or trainer.global_step != self.step):
            return
        print(
            f"preempt_stages: sending SIGTERM at t={time.time():.3f} on rank {trainer.global_rank} at {stage} batch "
            f"{batch_idx} (step {trainer.global_step})",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.targets.get(trainer.global_rank) == -1 and trainer.global_step == self.step:  # RANK:-1 in training
            print(f"preempt_stages: sending SIGTERM at t={time.time():.3f} on rank {trainer.global_rank} at training "
                  f"step {trainer.global_step}", flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe(trainer, args[3], "validation")

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe(trainer, args[3], "test")

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe(trainer, args[3], "predict")


class BatchWriter(pl.callbacks.BasePredictionWriter):
    """Each rank saves each prediction batch to ``DIR/rank<r>-batch<b>.pt`` as it comes."""

    def __init__(self, directory: str) -> None:
        super().__init__(write_interval="batch")
        self.directory = directory

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: Any, prediction: Any, *args: Any) -> None:
        os.makedirs(self.directory, exist_ok=True)
        batch_idx = args[2]  # (batch_indices, batch, batch_idx, dataloader_idx)
        torch.save(prediction, os.path.join(self.directory, f"rank{trainer.global_rank}-batch{batch_idx}.pt"))


class RecordValidation(pl.Callback):
    """Rank 0 appends each validation's metrics (outside the sanity check) to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        values = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val_")}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, **values}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", default="fit", choices=["fit", "validate", "test", "predict"])
    parser.add_argument("--strategy", default="safe_ddp", choices=["safe_ddp", "ddp"])
    parser.add_argument("--launcher", default="subprocess", choices=["subprocess", "spawn"])
    parser.add_argument("--sigterm-at", action="append", default=[], help="RANK:BATCH (repeatable)")
    parser.add_argument("--signal-at-step", type=int, default=4)
    parser.add_argument("--in-sanity-check", action="store_true", help="--sigterm-at batches of fit's sanity check")
    parser.add_argument("--prediction-writer", help="a BasePredictionWriter saving each batch's predictions here")
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--resume")
    parser.add_argument("--metrics-out")
    parser.add_argument("--save-weights")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--eval-batches", type=int, default=40, help="evaluation batches per rank")
    parser.add_argument("--eval-sleep", type=float, default=0.15)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    args = parser.parse_args()

    pl.seed_everything(1234, workers=True)
    model = Classifier(
        args.step_sleep, args.eval_sleep, slow_at_step=args.signal_at_step + (args.signal_at_step % 4 != 0)
    )
    targets = {int(r): int(b) for r, b in (s.split(":") for s in args.sigterm_at)}
    step = 0 if args.in_sanity_check else args.signal_at_step
    callbacks: list[pl.Callback] = [SignalAt(targets, step, sanity=args.in_sanity_check)]
    if args.prediction_writer:
        callbacks.append(BatchWriter(args.prediction_writer))
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=-1))
    if args.metrics_out:
        callbacks.append(RecordValidation(args.metrics_out))
    strategy: Any = SafeDDPStrategy() if args.strategy == "safe_ddp" else "ddp"
    if args.launcher == "spawn":
        strategy = f"{args.strategy}_spawn"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.max_epochs, val_check_interval=4,
        num_sanity_val_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks, deterministic=True,
    )  # fmt: skip
    train = DataLoader(dataset(128, 0), batch_size=8, shuffle=True)  # 8 batches per rank and epoch
    evaluation = DataLoader(dataset(2 * 4 * args.eval_batches, 1), batch_size=4)
    if args.stage == "fit":
        trainer.fit(model, train, evaluation, ckpt_path=args.resume)
    elif args.stage == "validate":
        trainer.validate(model, evaluation)
    elif args.stage == "test":
        trainer.test(model, evaluation)
    else:
        trainer.predict(model, evaluation)
    print(f"preempt_stages: rank {trainer.global_rank} finished {args.stage} at step {trainer.global_step}", flush=True)
    if args.save_weights and trainer.is_global_zero:
        torch.save(model.state_dict(), args.save_weights)


if __name__ == "__main__":
    main()
