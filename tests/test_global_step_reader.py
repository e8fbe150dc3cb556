"""``_compat.global_step_reader``: ``trainer.global_step`` by attribute reads, for the strategy's per-step hook.

Lightning's property walks five more properties at every read; the reader must give the same number at every point
a hook can read it, in automatic optimization (also when gradient accumulation leaves batches without a step) and
in manual optimization (steps counted by the manual loop).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from ddp_strategy._compat.lightning import global_step_reader


class Compare(Callback):
    """Reads both at the start and the end of every training batch."""

    def __init__(self) -> None:
        self.read: Any = None
        self.pairs: list[tuple[int, int]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.read = global_step_reader(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.pairs.append((self.read(), trainer.global_step))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.pairs.append((self.read(), trainer.global_step))


class ManualEveryOther(BoringModel):
    """Manual optimization that steps the optimizer after every second batch only."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            optimizer = self.optimizers()
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        return loss


@pytest.mark.parametrize(
    ("module", "accumulate", "steps"),
    [(BoringModel, 1, 8), (BoringModel, 2, 4), (ManualEveryOther, 1, 4)],
    ids=["automatic", "automatic-accumulating", "manual"],
)
def test_the_reader_gives_global_step_at_every_batch_start_and_end(module: type, accumulate: int, steps: int):
    torch.manual_seed(0)
    compare = Compare()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=8,
        limit_val_batches=0,
        accumulate_grad_batches=accumulate,
        callbacks=[compare],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module())
    assert len(compare.pairs) == 16
    assert all(read == lightning for read, lightning in compare.pairs), compare.pairs
    assert compare.pairs[-1] == (steps, steps)  # the step count moved as the optimization made steps
    assert len({read for read, _ in compare.pairs}) == steps + 1  # 0 .. steps: the reader followed every step
