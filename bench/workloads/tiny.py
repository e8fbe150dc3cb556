"""The tiny model of the benchmarks `tiny_step.py`, `call_count.py`, `instructions_per_step.py` and others.

A 2-layer MLP (32 -> 64 -> 10, cross-entropy, SGD) on small random tensors: its step is almost all framework, as a
fast GPU step looks to the CPU. Lightning is imported when the module is made, not with this file: the raw DDP loop of
``bench/tiny_step.py`` uses :func:`network` alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SHAPE = (32, 64, 10)  # inputs, hidden units, classes


def network() -> nn.Sequential:
    """The model's layers, for a raw PyTorch loop."""
    return nn.Sequential(nn.Linear(SHAPE[0], SHAPE[1]), nn.ReLU(), nn.Linear(SHAPE[1], SHAPE[2]))


def tiny_module(*, sync_dist: bool, values: int = 1) -> Any:
    """The model as a ``LightningModule``; with ``sync_dist``, ``self.log("loss", loss, sync_dist=True)`` every step.

    ``values``: how many values each step logs so (``loss``, then ``loss1``, ``loss2``, ...: the loss scaled).
    """
    import lightning.pytorch as pl

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = network()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            if sync_dist:
                self.log("loss", loss, sync_dist=True)
                for i in range(1, values):
                    self.log(f"loss{i}", loss * i, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return TinyModule()


def fit_with_window(
    variant: str,
    mode: str,
    *,
    warmup: int,
    steps: int,
    start: Any,
    stop: Any,
    root: str,
    shuffle: bool = True,
    callbacks: Any = (),
) -> None:
    """A 2-rank fit of the model (Lightning's launcher, gloo, CPU) that measures a window of training steps.

    Rank 0 is the calling process; Lightning's launcher starts rank 1 by re-running its command. On every rank,
    ``start()`` runs at the start of training step ``warmup`` and ``stop(trainer)`` at the start of step
    ``warmup + steps``: the window holds ``steps`` whole steps, hooks included.

    Args:
        variant: ``"stock"`` (``DDPStrategy()``) or ``"safe"`` (``SafeDDPStrategy()``).
        mode: ``"nolog"``, or ``"sync_dist"``: ``self.log("loss", loss, sync_dist=True)`` every step.
        warmup: steps before the window.
        steps: steps in the window.
        start: called with no argument when the window opens.
        stop: called with the trainer when it closes.
        root: the trainer's ``default_root_dir``.
        shuffle: the data loader's ``shuffle``.
        callbacks: more callbacks for the Trainer (after the window's).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_strategy import SafeDDPStrategy

    class Window(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
            if index == warmup:
                start()
            elif index == warmup + steps:
                stop(trainer)

    torch.set_num_threads(1)
    samples = 32 * 2 * (warmup + steps + 1)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, SHAPE[0], generator=generator)
    data = TensorDataset(inputs, torch.randint(0, SHAPE[2], (samples,), generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy() if variant == "stock" else SafeDDPStrategy(),
        max_steps=warmup + steps + 1,
        max_epochs=1,
        callbacks=[Window(), *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(tiny_module(sync_dist=mode == "sync_dist"), DataLoader(data, batch_size=32, shuffle=shuffle))
