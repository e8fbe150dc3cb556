"""Transfer learning under DDP: the trainable set changes after DDP was built (Lightning's launcher re-runs this).

Usage:
    python trainable_set.py --out DIR [--strategy safe_ddp|safe_ddp_spawn|ddp|single] [--ddp-option KEY=VALUE ...]
        [--comm-hook] [--scenario finetune|local_flip] [--barrier-timeout S]

The model is a small CNN ``backbone`` (with GroupNorm), a ``neck`` and a ``head``, trained with SGD (momentum) on a
mean cross-entropy loss, 4 epochs of 6 steps. Under DDP, Lightning shards the data with its shuffling
``DistributedSampler``; ``--strategy single`` (one device) trains on the same global batches, twice the size: batch i
of an epoch is the union of the two ranks' batches i (:class:`GlobalBatches`). The trainable set changes three times:

* Lightning's ``BackboneFinetuning(unfreeze_backbone_at_epoch=1)`` freezes the backbone before DDP is built and
  unfreezes it (adding an optimizer param group) at the start of epoch 1;
* a callback freezes the neck before batch 2 of epoch 2 and unfreezes it before batch 1 of epoch 3.

``--scenario local_flip``: instead, rank 1 alone freezes ``neck.0.bias`` before batch 2 of epoch 1 (a rank-dependent
branch), which DDP cannot follow.

Every rank writes ``DIR/rank<g>.pt`` (its initial and final ``state_dict``) and ``DIR/rank<g>.json`` (what it saw:
rebuilds, the final DDP wrapper's options, the communication hook's calls per epoch, the param groups' learning rates).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any

import torch
from lightning_namespace import SafeDDPStrategy, pl
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if os.environ.get("DDP_TEST_NAMESPACE") == "pytorch_lightning":
    from pytorch_lightning.callbacks import BackboneFinetuning, Callback
else:
    from lightning.pytorch.callbacks import BackboneFinetuning, Callback

BATCH = 4  # per rank; --strategy single uses 2 * BATCH
STEPS = 6  # per epoch
EPOCHS = int(os.environ.get("TS_EPOCHS", "4"))


class TransferModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(2, 8),  # per-sample statistics: a rank's batch size does not matter
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.neck = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(self.backbone(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)  # the mean over this rank's batch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # As BaseFinetuning asks: only what is trainable now; BackboneFinetuning adds the backbone's group later.
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCH * STEPS, 3, 8, 8, generator=g)
    y = (x.mean(dim=(2, 3)) @ torch.randn(3, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Epoch:
    """Holds the epoch Lightning sets (``set_epoch``) at the start of every training epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class GlobalBatches:
    """A batch sampler for one device: per epoch, the global batches two DDP ranks train on (same seed, same epoch).

    Lightning gives each rank a ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)`` and calls ``set_epoch``;
    batch i of the global batch is rank 0's batch i followed by rank 1's. Lightning calls ``set_epoch`` on a batch
    sampler's ``sampler``, so the epoch is kept there.
    """

    def __init__(self, size: int, ranks: int = 2, batch: int = BATCH) -> None:
        self.size, self.ranks, self.batch = size, ranks, batch
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.sampler = Epoch()

    def _shards(self) -> list[list[int]]:
        shards = []
        for rank in range(self.ranks):
            sampler = DistributedSampler(range(self.size), self.ranks, rank, shuffle=True, seed=self.seed)
            sampler.set_epoch(self.sampler.epoch)
            shards.append(list(sampler))
        return shards

    def __iter__(self) -> Any:
        shards = self._shards()
        for start in range(0, len(shards[0]), self.batch):
            yield [index for shard in shards for index in shard[start : start + self.batch]]

    def __len__(self) -> int:
        return -(-self.size // (self.ranks * self.batch))


def backbone_lr_factor(epoch: int) -> float:
    """BackboneFinetuning's per-epoch growth of the backbone's learning rate (a function: spawn pickles it)."""
    return 1.5


class ToggleNeck(Callback):
    """Freeze the neck before batch 2 of epoch 2, unfreeze it before batch 1 of epoch 3 (on every rank)."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (2, 2):
            pl_module.neck.requires_grad_(False)
        if (trainer.current_epoch, batch_idx) == (3, 1):
            pl_module.neck.requires_grad_(True)


class FreezeOnRank1Only(Callback):
    """A rank-dependent branch: rank 1 alone freezes one parameter before batch 2 of epoch 1."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (1, 2) and trainer.global_rank == 1:
            pl_module.neck[0].bias.requires_grad_(False)


class HookCalls:
    """State of a communication hook that counts its calls per epoch (and all-reduces as DDP's default does)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.calls: dict[int, int] = {}


def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real (not string) annotations
    state.calls[state.epoch] = state.calls.get(state.epoch, 0) + 1
    return default_hooks.allreduce_hook(None, bucket)


class Report(Callback):
    """Each rank writes its initial and final weights and what it saw."""

    def __init__(self, out: str, comm_hook: bool) -> None:
        self.out, self.comm_hook = out, comm_hook
        self.hook_state = HookCalls()
        self.initial: dict[str, torch.Tensor] = {}
        self.options: dict[str, bool] | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.initial = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        model = trainer.strategy.model
        if self.comm_hook and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self.hook_state, counting_allreduce)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.hook_state.epoch = trainer.current_epoch

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # the DDP wrapper is gone by on_fit_end
        model = trainer.strategy.model
        self.options = (
            {
                "static_graph": bool(model.static_graph),
                "find_unused_parameters": bool(model.find_unused_parameters),
                "gradient_as_bucket_view": bool(model.gradient_as_bucket_view),
            }
            if isinstance(model, DistributedDataParallel)
            else None
        )

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        rank = trainer.global_rank
        final = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"initial": self.initial, "final": final}, os.path.join(self.out, f"rank{rank}.pt"))
        info = {
            "rank": rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "strategy_module": type(trainer.strategy).__module__,
            "global_step": trainer.global_step,
            "trainable_set_changes": getattr(trainer.strategy, "trainable_set_changes", None),
            "ddp_options": self.options,
            "comm_hook_calls": {str(k): v for k, v in sorted(self.hook_state.calls.items())},
            "param_group_lrs": [group["lr"] for group in trainer.optimizers[0].param_groups],
            "requires_grad": {n: p.requires_grad for n, p in pl_module.named_parameters()},
        }
        with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
            json.dump(info, f)


def option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    return key, {"true": True, "false": False}.get(value.lower(), value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="safe_ddp", choices=["safe_ddp", "safe_ddp_spawn", "ddp", "single"])
    parser.add_argument("--ddp-option", action="append", type=option, default=[], help="KEY=VALUE for DDP")
    parser.add_argument("--comm-hook", action="store_true", help="register a counting all-reduce hook at fit start")
    parser.add_argument("--scenario", default="finetune", choices=["finetune", "local_flip"])
    parser.add_argument("--barrier-timeout", type=float, default=120.0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(1234)
    kwargs = dict(args.ddp_option)
    if args.strategy.startswith("safe_ddp"):
        start_method = "spawn" if args.strategy == "safe_ddp_spawn" else "popen"
        strategy: Any = SafeDDPStrategy(
            barrier_timeout=args.barrier_timeout, heartbeat_interval=0.2, start_method=start_method, **kwargs
        )
    elif args.strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(**kwargs)
    else:
        strategy = "auto"
    single = args.strategy == "single"
    toggles = [FreezeOnRank1Only()] if args.scenario == "local_flip" else [ToggleNeck()]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if single else 2,
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=backbone_lr_factor),
            *toggles,
            Report(args.out, args.comm_hook),
        ],
    )
    data = dataset()
    loader = (
        DataLoader(data, batch_sampler=GlobalBatches(len(data)))
        if single
        else DataLoader(data, batch_size=BATCH, shuffle=True)  # Lightning replaces the sampler with its own
    )
    trainer.fit(TransferModel(), loader)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        # Test speed only: skip the interpreter's final garbage collection over torch's large heap (1 to 6 s per
        # process on the 2-core CI machine, more under load). Everything the tests check ran before this point.
        gc.freeze()
