"""Overlapped snapshots of asynchronous saves: which tensors may be copied late, and the gates that wait for them.

With ``SafeDDPStrategy(async_save=True)`` (``async_snapshot="overlap"``, the default), a checkpoint saved during
training is copied to CPU memory in two parts. Buffers, containers and everything that is not a parameter or an
optimizer-state tensor are copied before the save returns. Parameters and optimizer state, which only the optimizer
step changes, are copied by the writer thread while training goes on with the next batch's forward and backward; the
strategy waits for that copy right before the optimizer updates them (in the optimizer closure, after backward), and
:class:`SnapshotGate`, the first callback of the Trainer, waits for it before any other callback's epoch-end,
validation or end-of-training hook, where callbacks such as Lightning's ``WeightAveraging`` copy weights into the
model.

A change that bypasses these gates (a parameter changed in place by the LightningModule's own
``on_train_batch_end``/``on_train_batch_start`` or in ``training_step``) is detected by the tensors' version
counters and fails that write loudly (the previous checkpoint stays intact); writes through ``.data`` are not
counted by PyTorch, so code that does that in those hooks needs ``async_snapshot="blocking"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from typing_extensions import override

from .._compat.lightning import Callback, TrainerFn, add_callback, pl

__all__ = ["SnapshotGate", "deferrable_tensors", "install_snapshot_gate", "optimizer_owned_addresses"]


def deferrable_tensors(trainer: pl.Trainer) -> Callable[[Tensor], bool] | None:
    """Which tensors of a checkpoint saved now may be copied after the save returns, or ``None`` for none.

    Only during ``fit``'s training (not in validation or the sanity check) with automatic optimization: then the
    parameters and the optimizers' state tensors change only in the next optimizer step, which waits for the copy.
    """
    module = trainer.lightning_module
    if (
        trainer.state.fn != TrainerFn.FITTING
        or not trainer.training
        or trainer.sanity_checking
        or not module.automatic_optimization
    ):
        return None
    addresses = optimizer_owned_addresses(module, trainer.optimizers)

    def deferred(tensor: Tensor) -> bool:
        return tensor.numel() > 0 and tensor.data_ptr() in addresses

    return deferred


def optimizer_owned_addresses(module: nn.Module, optimizers: Iterable[Any]) -> set[int]:
    """Data pointers of ``module``'s parameters and of the optimizers' state tensors (what only a step changes)."""
    addresses = {p.data_ptr() for p in module.parameters() if p.numel()}
    for optimizer in optimizers:
        for state in optimizer.state.values():
            addresses.update(t.data_ptr() for t in state.values() if isinstance(t, Tensor) and t.numel())
    return addresses


class SnapshotGate(Callback):
    """Waits for an overlapped snapshot before other callbacks' hooks that may change weights in place.

    :func:`install_snapshot_gate` puts it first in ``trainer.callbacks``, so it runs before every other callback of
    the same hook. It deliberately does not wait in ``on_train_batch_start``: the overlap is with the next batch's
    forward and backward, and the optimizer closure waits before the weights change.

    Args:
        wait: blocks until the pending snapshot (if any) is copied.
    """

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._wait()


def install_snapshot_gate(trainer: pl.Trainer, wait: Callable[[], None]) -> SnapshotGate:
    """Insert a :class:`SnapshotGate` at the front of ``trainer.callbacks`` (once) and return it."""
    gate = SnapshotGate(wait)
    # A previous fit's gate waits on a previous strategy's writer: replace it.
    add_callback(trainer, gate, first=True, replace=SnapshotGate)
    return gate
