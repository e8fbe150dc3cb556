"""``self.log(..., sync_dist=True)`` in every training step: the values each rank logs, what the ranks agreed on,
and which ``torch.distributed`` collectives the logging made.

A small regression model on 2 CPU ranks logs three values per step with ``sync_dist=True``: the loss (mean), the
batch's sample count (``reduce_fx="sum"``) and its largest target (``reduce_fx="max"``). A wrapper around
``torch.distributed.barrier``, ``all_reduce`` and ``all_gather_single`` counts the calls made inside the step's
``self.log`` calls, and a wrapper around ``torch.distributed.broadcast`` the calls Lightning's training loop makes
before every batch to share rank 0's SIGTERM flag (``_broadcast_sigterm_tensor``, Lightning >= 2.5). Each rank
writes ``OUT.rank<R>.json``: its own values per step before syncing, the synced values it logged, the count of each
collective, and the count of those broadcasts.

Usage: python tests/scripts/sync_dist_calls.py --strategy ddp|safe_ddp --out PATH
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from lightning_namespace import pl  # registers "safe_ddp" in that namespace's registry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 6  # full batches of 5 per rank; a seventh of 2 samples ends the epoch
COUNTED = ("barrier", "all_reduce", "all_gather_single")
calls_in_log = dict.fromkeys(COUNTED, 0)
_logging = [False]


def counted(name: str) -> Any:
    original = getattr(dist, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _logging[0]:
            calls_in_log[name] += 1
        return original(*args, **kwargs)

    return call


for _name in COUNTED:  # Lightning's _sync_ddp and the strategy read them from torch.distributed at every call
    setattr(dist, _name, counted(_name))

sigterm_broadcasts = [0]
_broadcast = dist.broadcast


def broadcast(*args: Any, **kwargs: Any) -> Any:
    if sys._getframe(1).f_code.co_name == "_broadcast_sigterm_tensor":  # Lightning's loop reads it at every call
        sigterm_broadcasts[0] += 1
    return _broadcast(*args, **kwargs)


dist.broadcast = broadcast


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.raw: list[dict[str, float]] = []
        self.synced: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
        values = {"loss": loss.detach().clone(), "seen": torch.tensor(float(len(y))), "biggest": y.max()}
        self.raw.append({k: float(v) for k, v in values.items()})
        _logging[0] = True
        try:
            self.log("loss", loss, sync_dist=True)
            self.log("seen", float(len(y)), reduce_fx="sum", sync_dist=True)
            self.log("biggest", y.max(), reduce_fx="max", sync_dist=True)
        finally:
            _logging[0] = False
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = self.trainer.callback_metrics
        self.synced.append({k: float(metrics[k]) for k in ("loss", "seen", "biggest")})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="safe_ddp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    generator = torch.Generator().manual_seed(7)
    samples = 2 * STEPS * 5 + 3  # 32 per rank after the sampler's padding: 6 batches of 5 and one of 2
    data = TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples, generator=generator))
    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=5))
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        loop_broadcasts = hasattr(type(trainer.fit_loop.epoch_loop), "_broadcast_sigterm_tensor")
        json.dump(
            {
                "raw": model.raw,
                "synced": model.synced,
                "calls_in_log": calls_in_log,
                "sigterm_broadcasts": sigterm_broadcasts[0],
                "lightning_broadcasts_sigterm": loop_broadcasts,
            },
            f,
        )


if __name__ == "__main__":
    sys.exit(main())
