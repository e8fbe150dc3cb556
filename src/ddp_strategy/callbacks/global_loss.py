"""``GlobalTrainingLoss``: log one training loss for the whole job, the mean over ranks, instead of one per rank.

Under DDP every rank computes the loss of its own batch, and ``self.log("train_loss", loss)`` logs that local
value: with 4 ranks there are 4 different "training losses", and the one in rank 0's logger is only rank 0's
(seed 001: "why do I see 4 losses?"). DDP then *averages* the gradients over ranks, so the loss whose gradient is
applied is the mean of the ranks' losses (not their sum: a sum would be ``world_size`` times larger and would
not match the single-device loss of the combined batch). This callback logs that mean, once per step and/or per
epoch, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from typing_extensions import override

from .._compat.lightning import Callback, pl

__all__ = ["GlobalTrainingLoss"]


class GlobalTrainingLoss(Callback):
    """Log the training loss averaged over all ranks.

    The per-step value is ``mean_r(loss_r)`` (one small all-reduce per step; every rank takes the same number of
    training steps, so it cannot deadlock). The epoch value is the sample-weighted mean over all steps and ranks.

    Args:
        name: the logged name; Lightning appends ``_step`` / ``_epoch`` when both are logged.
        on_step: log the per-step value.
        on_epoch: log the epoch value.
        prog_bar: show it in the progress bar.

    Raises:
        ValueError: neither ``on_step`` nor ``on_epoch``.

    """

    def __init__(
        self, name: str = "train_loss_global", *, on_step: bool = True, on_epoch: bool = True, prog_bar: bool = False
    ) -> None:
        if not (on_step or on_epoch):
            raise ValueError("GlobalTrainingLoss needs on_step=True or on_epoch=True (or both); got neither.")
        self.name = name
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.prog_bar = prog_bar

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor):  # the step returned no loss (e.g. it skipped the batch)
            return
        pl_module.log(
            self.name,
            loss.detach(),
            on_step=self.on_step,
            on_epoch=self.on_epoch,
            prog_bar=self.prog_bar,
            sync_dist=True,
            reduce_fx="mean",
        )
