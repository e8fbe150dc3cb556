"""Exact-evaluation scenario: many evaluation dataloaders (sample counts x batch sizes) in one run.

Runs ``trainer.validate``, ``trainer.test``, ``trainer.predict`` and a ``trainer.fit`` with validation (learning
rate 0, so the weights stay those of the devices=1 reference) and writes rank 0's results as JSON. The test
compares a run on several ranks with a devices=1 run of the same script.

Usage: python tests/scripts/exact_eval.py --devices 2 --out result.json [--strategy safe_ddp|ddp]
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from lightning_namespace import pl  # registers "safe_ddp" in that namespace's registry
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler, TensorDataset, get_worker_info

NUM_CLASSES = 3
FEATURES = 4
POOL = 13


def configs(sizes: list[int], batch_sizes: list[int]) -> list[tuple[int, int]]:
    """The (samples, batch size) of each evaluation dataloader, in dataloader-index order."""
    return [(n, bs) for n in sizes for bs in batch_sizes]


def pool() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(POOL, FEATURES, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (POOL,), generator=generator)
    target = torch.randn(POOL, generator=generator)
    return TensorDataset(x, y, target)


class IterableTensors(IterableDataset[tuple[torch.Tensor, ...]]):
    """The rows of a TensorDataset as a stream, split between DataLoader workers as PyTorch recommends."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, len(self.data), workers):
            yield self.data[i]


class ReversedSampler(Sampler[int]):
    """A custom (deterministic) sampler: the data set backwards."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.length - 1, -1, -1))

    def __len__(self) -> int:
        return self.length


def loaders(cfgs: list[tuple[int, int]], kind: str = "plain", world_size: int = 1, workers: int = 0) -> list[Any]:
    data = pool()
    result: list[Any] = []
    for n, bs in cfgs:
        subset = TensorDataset(*(t[:n] for t in data.tensors))
        if kind == "iterable":
            result.append(DataLoader(IterableTensors(subset), batch_size=bs, num_workers=workers))
        elif kind == "custom_sampler":
            result.append(DataLoader(subset, batch_size=bs, sampler=ReversedSampler(n), num_workers=workers))
        elif kind == "user_sampler" and world_size > 1:  # a hand-made, padded DistributedSampler
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            sampler = DistributedSampler(subset, num_replicas=world_size, rank=rank, shuffle=False)
            result.append(DataLoader(subset, batch_size=bs, sampler=sampler, num_workers=workers))
        else:
            result.append(DataLoader(subset, batch_size=bs, num_workers=workers))
    return result


def metric_set() -> nn.ModuleDict:
    return nn.ModuleDict(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
            "mse": torchmetrics.MeanSquaredError(),
            "count": torchmetrics.SumMetric(),
            "collection": torchmetrics.MetricCollection(
                {
                    "precision": torchmetrics.classification.MulticlassPrecision(NUM_CLASSES, average="macro"),
                    "recall": torchmetrics.classification.MulticlassRecall(NUM_CLASSES, average="macro"),
                },
                prefix="mc_",
            ),
        }
    )


class EvalModel(pl.LightningModule):
    def __init__(self, num_loaders: int, step_sync: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        # BatchNorm (a buffer DDP broadcasts) with momentum 0: training steps leave the running statistics as they
        # are, so the validation inside fit sees the same model on one device and on several.
        norm = nn.BatchNorm1d(8, momentum=0.0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), norm, nn.Tanh(), nn.Linear(8, NUM_CLASSES + 1))
        self.val_metrics = nn.ModuleList([metric_set() for _ in range(num_loaders)])
        self.test_metrics = nn.ModuleList([metric_set() for _ in range(num_loaders)])
        self.step_sync = step_sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self(x)[:, :NUM_CLASSES], y)

    def _evaluate(self, metrics: nn.ModuleDict, batch: Any) -> None:
        x, y, target = batch
        out = self(x)
        logits, regression = out[:, :NUM_CLASSES], out[:, NUM_CLASSES]
        metrics["acc"](logits, y)
        metrics["mse"](regression, target)
        metrics["count"](torch.ones(len(y)))
        metrics["collection"](logits, y)
        self.log("acc", metrics["acc"])
        self.log("mse", metrics["mse"])
        self.log("count_metric", metrics["count"])
        self.log_dict(metrics["collection"])
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, on_epoch=True, sync_dist=True, batch_size=len(y))
        self.log("samples", float(len(y)), reduce_fx="sum", sync_dist=True)
        self.log("max_target", target.max(), reduce_fx="max", sync_dist=True)
        if self.step_sync:
            self.log("loss_step_synced", loss, on_step=True, on_epoch=False, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(self.val_metrics[dataloader_idx], batch)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(self.test_metrics[dataloader_idx], batch)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def as_floats(results: list[dict[str, Any]] | dict[str, Any]) -> Any:
    if isinstance(results, dict):
        return {k: float(v) for k, v in results.items()}
    return [as_floats(r) for r in results]


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` shows where a rank is
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL data plane)")
    parser.add_argument("--strategy", default="safe_ddp")
    parser.add_argument("--sizes", default=",".join(str(n) for n in range(POOL + 1)))
    parser.add_argument("--batch-sizes", default="1,2,5")
    parser.add_argument("--stages", default="validate,test,predict,fit")
    parser.add_argument("--step-sync", action="store_true", help="log a value with on_step=True, sync_dist=True")
    parser.add_argument("--loader", choices=("plain", "iterable", "custom_sampler", "user_sampler"), default="plain")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cfgs = configs([int(n) for n in args.sizes.split(",")], [int(b) for b in args.batch_sizes.split(",")])
    model = EvalModel(len(cfgs), step_sync=args.step_sync)
    strategy: Any = "auto" if args.devices == 1 else args.strategy
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    out: dict[str, Any] = {"configs": cfgs, "world_size": trainer.world_size, "trainer": type(trainer).__module__}
    stages = args.stages.split(",")

    def make() -> list[Any]:
        return loaders(cfgs, args.loader, args.devices, args.num_workers)

    if "validate" in stages:
        out["validate"] = as_floats(trainer.validate(model, make(), verbose=False))
    if "test" in stages:
        out["test"] = as_floats(trainer.test(model, make(), verbose=False))
    if "predict" in stages:
        predictions = trainer.predict(model, make())
        per_loader = predictions if len(cfgs) > 1 else [predictions]
        out["predict"] = [[batch.tolist() for batch in loader] for loader in per_loader or []]
    if "fit" in stages:
        train = DataLoader(pool(), batch_size=2, drop_last=True)
        trainer.fit(model, train, make())
        out["fit"] = as_floats({k: v for k, v in trainer.callback_metrics.items() if "/" in k or len(cfgs) == 1})
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        # Test speed only: skip the interpreter's final garbage collection over torch's large heap (1 to 6 s per
        # process on the 2-core CI machine, more under load). Everything the tests check ran before this point.
        gc.freeze()
