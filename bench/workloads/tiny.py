"""The tiny model of ``bench/tiny_step.py``, ``bench/strategy_cost.py --workloads tiny`` and ``bench/call_count.py``.

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
