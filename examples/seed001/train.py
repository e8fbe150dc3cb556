"""Seed thread 001's hand-written CIFAR-10 DDP script, rewritten as a LightningModule with ``SafeDDPStrategy``.

What replaced what (see ``docs/migrating.md``):

* ``setup()`` / ``mp.spawn`` / ``cleanup()``: the Trainer with ``strategy="safe_ddp"`` starts one process per
  device, creates and destroys the process group; nothing is pickled, so no ``Can't get attribute 'main'``.
* ``net.to(rank)`` and ``DDP(net, device_ids=[rank])``: Lightning places and wraps the model; two ranks on one
  GPU raise ``DuplicateDeviceError`` instead of NCCL's "Duplicate GPU detected".
* ``DistributedSampler`` and ``set_epoch``: inserted and called by Lightning.
* Four printed losses: ``train_loss`` is averaged over ranks (``sync_dist=True``) and printed once, by rank 0.
* ``torch.save`` on rank 0 + ``dist.barrier()`` + ``map_location``: ``ModelCheckpoint`` and
  ``--resume`` (``trainer.fit(ckpt_path="last")``); saving and loading are collective, no barrier to forget.
* The accuracy loops: ``trainer.test`` with torchmetrics; every test image counted once over all ranks.

Run from the repository root::

    python examples/seed001/train.py --devices 2 --max-epochs 2
    python examples/seed001/train.py --devices 2 --max-epochs 3 --resume
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout: find examples.cifar10
    sys.path.insert(0, str(_REPO_ROOT))

from ddp_strategy import SafeDDPStrategy  # noqa: E402
from examples.cifar10.data import CIFAR10DataModule  # noqa: E402

CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class Net(LightningModule):
    """The seed thread's ``Net``, unchanged, plus the training/test steps that were its loops."""

    def __init__(self, lr: float = 0.001) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)
        self.accuracy = MulticlassAccuracy(num_classes=10, average="micro")
        self.per_class = MulticlassAccuracy(num_classes=10, average=None)

    def forward(self, x: Tensor) -> Tensor:
        """Return the class scores of a batch of images."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """One optimisation step; DDP averages the gradients over ranks in ``backward``."""
        inputs, labels = batch
        loss = F.cross_entropy(self(inputs), labels)
        # one value for the whole job: the mean over ranks, shown once (not one line per rank)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Accuracy on the validation split (every image counted once over all ranks)."""
        inputs, labels = batch
        self.accuracy(self(inputs), labels)
        self.log("val_acc", self.accuracy)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Overall and per-class accuracy, as the seed's two accuracy loops computed them on one GPU."""
        inputs, labels = batch
        predictions = self(inputs)
        self.accuracy(predictions, labels)
        self.per_class.update(predictions, labels)
        self.log("test_acc", self.accuracy)

    def on_test_epoch_end(self) -> None:
        """Print the per-class accuracy once (``compute`` syncs the counts of all ranks)."""
        for name, accuracy in zip(CLASSES, self.per_class.compute().tolist(), strict=True):
            self.print(f"Accuracy for class: {name:5s} is {100 * accuracy:.1f} %")
        self.per_class.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD with momentum, as in the seed script."""
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def main(argv: list[str] | None = None) -> None:
    """Train, checkpoint every epoch, optionally resume, then test."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process (the seed used 4)")
    parser.add_argument("--train-samples", type=int, default=5000)
    parser.add_argument("--val-samples", type=int, default=1000)
    parser.add_argument("--ckpt-dir", type=Path, default=_REPO_ROOT / "checkpoints" / "seed001")
    parser.add_argument("--data-dir", type=Path, default=_REPO_ROOT / "data")
    parser.add_argument("--no-archive", action="store_true", help="ignore the CIFAR-10 archive (synthetic data)")
    parser.add_argument("--resume", action="store_true", help="continue from <ckpt-dir>/last.ckpt")
    args = parser.parse_args(argv)

    seed_everything(42, workers=True)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    data = CIFAR10DataModule(
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        train_samples=args.train_samples,
        val_samples=args.val_samples,
        use_archive=not args.no_archive,
    )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=SafeDDPStrategy(),
        max_epochs=args.max_epochs,
        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, enable_version_counter=False)],
        default_root_dir=args.ckpt_dir,
        logger=False,
        enable_progress_bar=False,
    )
    resume = args.resume and (args.ckpt_dir / "last.ckpt").is_file()
    trainer.fit(Net(), datamodule=data, ckpt_path="last" if resume else None)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:  # printed once, not once per rank
        print(f"resumed: {resume}; finished epoch {trainer.current_epoch - 1}; {metrics}", flush=True)
    trainer.test(datamodule=data, ckpt_path="last", verbose=False)
    if trainer.is_global_zero:
        print("Finished Training", flush=True)


if __name__ == "__main__":
    main()
