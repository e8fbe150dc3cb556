"""Samplers that make training data order resumable."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any, cast

from torch.utils.data import BatchSampler, DataLoader, Sampler

from ._compat.lightning import RunningStage, update_dataloader

__all__ = ["ResumeSampler", "skip_consumed_batches"]


class ResumeSampler(Sampler[Any]):
    """Wraps a sampler so that its next iteration skips the indices consumed before a mid-epoch checkpoint.

    Only the first iteration skips; later epochs pass through unchanged. ``set_epoch`` is forwarded, so a wrapped
    ``DistributedSampler`` keeps its epoch-seeded shuffle. The length is the full epoch's, because Lightning counts
    the restored batches as part of the epoch.

    The skip belongs to one epoch: when ``epoch`` is given and ``set_epoch`` moves to another epoch before the first
    iteration, nothing is skipped. Lightning 2.4 ends a restored epoch whose batches were all consumed (a checkpoint
    after its last batch) without drawing from the loader, and the skip must not fall on the next epoch.

    Args:
        sampler: the sampler to wrap (typically the ``DistributedSampler`` Lightning inserted).
        skip: how many indices to skip on the first iteration.
        epoch: the epoch the skipped indices belong to, or ``None`` for whichever comes first.

    """

    def __init__(self, sampler: Sampler[Any], skip: int, epoch: int | None = None) -> None:
        if skip < 0:
            raise ValueError(f"`skip` must be >= 0, got {skip}.")
        self.sampler = sampler
        self.skip = skip
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped sampler, if it takes one; another epoch than the skip's drops the skip."""
        if self.epoch is not None and epoch != self.epoch:
            self.skip = 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError(f"{type(self.sampler).__name__} has no length")
        return len(self.sampler)


def skip_consumed_batches(dataloader: object, batches: int, epoch: int | None = None) -> DataLoader[Any] | None:
    """A copy of ``dataloader`` whose next epoch (``epoch``, when given) starts after its first ``batches`` batches.

    Returns:
        The new DataLoader, or ``None`` when that cannot be done exactly (no standard ``BatchSampler`` over a
        sampler, e.g. a custom batch sampler or an IterableDataset).

    """
    if not isinstance(dataloader, DataLoader) or type(dataloader.batch_sampler) is not BatchSampler:
        return None
    batch_sampler = dataloader.batch_sampler
    if batch_sampler.batch_size is None:
        return None
    sampler = ResumeSampler(cast(Sampler[Any], batch_sampler.sampler), batches * batch_sampler.batch_size, epoch)
    return cast(DataLoader[Any], update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING))
