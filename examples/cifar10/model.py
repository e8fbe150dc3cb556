"""A small ResNet-style CIFAR-10 classifier as a :class:`~lightning.pytorch.LightningModule`.

The network is deliberately small (about 0.3 M parameters with the default ``width=32``) so that an epoch
over a few thousand images takes seconds per process on one CPU core, while still learning quickly enough
for the accuracy to rise visibly within two or three epochs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["BasicBlock", "CIFAR10Classifier", "ResNetBackbone", "one_cycle_factor"]

Batch = tuple[Tensor, Tensor]

# optimizer name -> (default peak learning rate, default weight decay)
_OPTIMIZER_DEFAULTS: dict[str, tuple[float, float]] = {"adamw": (3e-3, 0.05), "sgd": (0.1, 5e-4)}


def one_cycle_factor(
    step: int,
    total_steps: int,
    pct_start: float = 0.25,
    div_factor: float = 10.0,
    final_div_factor: float = 100.0,
) -> float:
    """Learning-rate multiplier of a cosine one-cycle schedule (like ``torch.optim.lr_scheduler.OneCycleLR``).

    The multiplier rises from ``1 / div_factor`` to 1 over the first ``pct_start`` of the steps, then falls to
    ``1 / (div_factor * final_div_factor)`` at ``total_steps``, and stays there afterwards.

    Args:
        step: Number of optimizer steps taken so far.
        total_steps: Length of the schedule in optimizer steps.
        pct_start: Fraction of the steps spent warming up.
        div_factor: Ratio of the peak to the initial learning rate.
        final_div_factor: Ratio of the initial to the final learning rate.

    Returns:
        The factor to multiply the peak learning rate with.

    """
    start = 1.0 / div_factor
    end = start / final_div_factor
    warmup = max(1, round(pct_start * total_steps))
    if step < warmup:
        return start + (1.0 - start) * (1.0 - math.cos(math.pi * step / warmup)) / 2.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return end + (1.0 - end) * (1.0 + math.cos(math.pi * progress)) / 2.0


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 conv + BatchNorm layers with a residual shortcut.

    Args:
        in_channels: Number of input channels.
        out_channels: Number of output channels.
        stride: Stride of the first convolution (2 halves the spatial resolution).

    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: Input of shape ``(N, in_channels, H, W)``.

        Returns:
            Output of shape ``(N, out_channels, H / stride, W / stride)``.

        """
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetBackbone(nn.Module):
    """Stem convolution, three stages of :class:`BasicBlock`, global average pooling and a linear head.

    Args:
        width: Channels of the stem and the first stage; the stages use ``width``, ``2 * width`` and
            ``4 * width`` channels at resolutions 32, 16 and 8.
        num_classes: Number of output logits.
        dropout: Dropout probability applied to the pooled features before the head (0 disables it).

    """

    def __init__(self, width: int = 16, num_classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        self.stages = nn.Sequential(
            BasicBlock(width, width, stride=1),
            BasicBlock(width, 2 * width, stride=2),
            BasicBlock(2 * width, 4 * width, stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(4 * width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Compute class logits.

        Args:
            x: Normalised images of shape ``(N, 3, H, W)``.

        Returns:
            Logits of shape ``(N, num_classes)``.

        """
        features: Tensor = self.pool(self.stages(self.stem(x))).flatten(1)
        logits: Tensor = self.head(self.dropout(features))
        return logits


class CIFAR10Classifier(LightningModule):
    """Small ResNet for CIFAR-10, trained with AdamW (or SGD with Nesterov momentum) and a one-cycle schedule.

    Logs ``train_loss`` (per step), ``train_acc``, ``val_loss``, ``val_acc``, ``test_loss`` and
    ``test_acc`` (per epoch). The accuracies are :class:`~torchmetrics.classification.MulticlassAccuracy`
    metric objects, which synchronise their state across processes themselves; the losses are averaged with
    ``sync_dist=True``.

    Args:
        lr: Peak learning rate of the one-cycle schedule; ``None`` picks the optimizer's default
            (``3e-3`` for AdamW, ``0.1`` for SGD).
        width: Base channel width of the network (see :class:`ResNetBackbone`).
        dropout: Dropout probability before the linear head.
        weight_decay: Weight decay, applied to convolution and linear weights only; ``None`` picks the
            optimizer's default (``0.05`` for AdamW, ``5e-4`` for SGD).
        num_classes: Number of classes.
        momentum: SGD (Nesterov) momentum, or AdamW's first-moment coefficient ``beta1``.
        optimizer: ``"adamw"`` (default; learns fastest in the first epochs) or ``"sgd"``.

    """

    def __init__(
        self,
        lr: float | None = None,
        width: int = 32,
        dropout: float = 0.0,
        weight_decay: float | None = None,
        num_classes: int = 10,
        momentum: float = 0.9,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        if optimizer not in _OPTIMIZER_DEFAULTS:
            raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_DEFAULTS)}, got {optimizer!r}")
        self.save_hyperparameters()
        default_lr, default_weight_decay = _OPTIMIZER_DEFAULTS[optimizer]
        self.optimizer_name = optimizer
        self.lr = default_lr if lr is None else lr
        self.weight_decay = default_weight_decay if weight_decay is None else weight_decay
        self.momentum = momentum
        self.net = ResNetBackbone(width=width, num_classes=num_classes, dropout=dropout)
        # average="micro": the fraction of correctly classified images (torchmetrics defaults to "macro",
        # the mean of the per-class accuracies).
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: Tensor) -> Tensor:
        """Compute class logits.

        Args:
            x: Normalised images of shape ``(N, 3, 32, 32)``.

        Returns:
            Logits of shape ``(N, num_classes)``.

        """
        logits: Tensor = self.net(x)
        return logits

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Compute and log the training loss and accuracy of one batch.

        Args:
            batch: Images and integer labels.
            batch_idx: Index of the batch in the epoch.

        Returns:
            The cross-entropy loss to backpropagate.

        """
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        """Accumulate the validation loss and accuracy of one batch.

        Args:
            batch: Images and integer labels.
            batch_idx: Index of the batch in the epoch.

        """
        self._evaluate(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        """Accumulate the test loss and accuracy of one batch.

        Args:
            batch: Images and integer labels.
            batch_idx: Index of the batch in the epoch.

        """
        self._evaluate(batch, "test")

    def _evaluate(self, batch: Batch, stage: str) -> None:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        metric = self.val_acc if stage == "val" else self.test_acc
        metric(logits, labels)
        self.log(f"{stage}_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log(f"{stage}_acc", metric, on_step=False, on_epoch=True, prog_bar=True)
        # how many images the epoch value covers, summed over ranks: equals the data set size when every sample
        # is evaluated exactly once (SafeDDPStrategy); stock DDP's padded sampler counts some twice
        self.log(f"{stage}_samples", float(len(labels)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """Create the optimizer (AdamW or SGD with Nesterov momentum) and a per-step one-cycle schedule.

        Weight decay is applied to convolution and linear weights only, not to BatchNorm parameters or biases.

        Returns:
            The optimizer and its step-wise scheduler configuration.

        """
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for param in self.parameters():
            if not param.requires_grad:
                continue
            (decay if param.ndim > 1 else no_decay).append(param)
        groups: list[dict[str, Any]] = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "sgd":
            nesterov = self.momentum > 0
            optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, nesterov=nesterov)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(self.momentum, 0.999))
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        # A LambdaLR (rather than OneCycleLR) keeps the schedule length out of the checkpoint, so a run
        # resumed with a larger --max-epochs follows a schedule of the new length instead of failing.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: one_cycle_factor(step, total_steps, pct_start=0.25)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
