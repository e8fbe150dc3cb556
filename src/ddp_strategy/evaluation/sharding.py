"""Exact sharding of evaluation data: every sample to exactly one rank, no padding, no dropping.

Stock Lightning gives each rank a :class:`~torch.utils.data.DistributedSampler`, which pads the shares to equal
length with repeated samples. Here the devices=1 batches are rebuilt (the user's batch size, ``drop_last`` and
batch sampler, over the user's sampler) and *whole batches* are dealt to the ranks round-robin: batch ``i`` goes to
rank ``i % world_size``. Each rank therefore sees exactly the batches a single device would see (same composition,
same numerics), shards may be uneven or empty, and the original order is recovered by interleaving.

Each :class:`BatchShardSampler` also carries, as its ``sampler`` attribute, a :class:`RankShareSampler`: the rank's
share as sample indices, a subclass of Lightning's ``UnrepeatedDistributedSampler`` (what stock ``trainer.predict``
puts there), so code that inspects ``dataloader.batch_sampler.sampler`` finds a distributed sampler as under stock
``DDPStrategy``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from .._compat.lightning import (
    IndexBatchSamplerWrapper,
    RunningStage,
    UnrepeatedDistributedSampler,
    dataloader_init_args,
    reinstantiate_dataloader,
    unwrap_index_batch_sampler,
)

__all__ = [
    "BatchShardSampler",
    "RankShareSampler",
    "RankStridedIterable",
    "SeededPermutationSampler",
    "ShardResult",
    "shard_evaluation_dataloader",
]


class SeededPermutationSampler(Sampler[int]):
    """A shuffled order that every rank computes identically: a permutation seeded with ``seed + epoch``.

    Replaces a ``RandomSampler`` (whose order comes from each process's own RNG) in evaluation, so that dealing
    batches to ranks neither repeats nor drops a sample. The order follows ``DistributedSampler(shuffle=True)``.

    Args:
        length: number of samples.
        seed: the seed shared by all ranks.

    """

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length = length
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


class BatchShardSampler(Sampler[list[int]]):
    """The devices=1 batches of ``batch_sampler`` dealt round-robin: rank ``r`` gets batches ``r, r+W, r+2W, ...``.

    Args:
        batch_sampler: the batch sampler a single device would use (yields lists of dataset indices).
        rank: this process's global rank.
        world_size: number of ranks.
        dataset: the dataset the indices refer to, kept as ``sampler.dataset`` (``None`` when not known).

    Attributes:
        sampler: this rank's share as sample indices (:class:`RankShareSampler`). An instance attribute, so that
            Lightning's predict index wrapper, which copies the instance ``__dict__``, exposes it as well. The
            batches are drawn from ``batch_sampler`` directly, never through it.

    """

    def __init__(self, batch_sampler: Any, rank: int, world_size: int, *, dataset: object = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Need 0 <= rank < world_size, got rank={rank}, world_size={world_size}.")
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size
        self.sampler = RankShareSampler(self, dataset)

    @property
    def global_batches(self) -> int | None:
        """Number of batches over all ranks (what a single device would run), ``None`` if unknown."""
        return len(self.batch_sampler) if isinstance(self.batch_sampler, Sized) else None

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the batch sampler and its sampler, where they take one."""
        for target in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if callable(getattr(target, "set_epoch", None)):
                target.set_epoch(epoch)  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.rank, None, self.world_size)

    def __len__(self) -> int:
        total = self.global_batches
        if total is None:
            raise TypeError(f"{type(self.batch_sampler).__name__} has no length")
        return max(0, (total - self.rank + self.world_size - 1) // self.world_size)


class RankShareSampler(UnrepeatedDistributedSampler):
    """One rank's share of an exactly sharded evaluation dataloader, as the sample indices it yields, in order.

    The flattened batches ``r, r+W, r+2W, ...`` of the single-device batch sampler that a
    :class:`BatchShardSampler` deals to rank ``r`` of ``W``: over all ranks every sample the single device would
    run is yielded exactly once, with no padding. It is the ``sampler`` attribute of its :class:`BatchShardSampler`,
    so ``trainer.predict_dataloaders[i].batch_sampler.sampler`` (and ``batch_sampler.sampler`` of the validation and
    test dataloaders) is one, as stock ``DDPStrategy`` puts a Lightning ``UnrepeatedDistributedSampler`` there
    (padded ``DistributedSampler`` for validation and test). The dataloader does not draw from it: it draws whole
    batches from the :class:`BatchShardSampler`.

    A subclass of Lightning's ``UnrepeatedDistributedSampler`` (a ``torch.utils.data.DistributedSampler``), so
    ``isinstance`` checks written for stock hold. The base initialisers are not called, because they compute a
    share of their own (and Lightning's asserts that every rank has a sample, which an exact shard need not have);
    the attributes they set are set here to this share's values: ``dataset``, ``num_replicas`` (the world size),
    ``rank``, ``epoch`` (0 until :meth:`set_epoch`), ``drop_last`` (``False``: nothing is padded or dropped beyond
    what the single-device batch sampler drops), ``shuffle`` (the single-device order is a random permutation:
    a :class:`SeededPermutationSampler` or a ``RandomSampler``), ``seed`` (that of the
    :class:`SeededPermutationSampler`, whose order is ``seed + epoch`` as ``DistributedSampler``'s; else 0), and
    ``num_samples`` / ``total_size`` (this rank's and all ranks' sample counts; reading them raises
    ``AttributeError`` where :meth:`__len__` raises ``TypeError``).

    Iterating it iterates the single-device batch sampler once more, as :class:`BatchShardSampler` does; with a
    custom sampler whose order depends on a generator's state, that moves the generator on.

    Args:
        shard: the :class:`BatchShardSampler` whose batches this rank runs.
        dataset: the dataset the indices refer to (``None`` when not known).

    """

    def __init__(self, shard: BatchShardSampler, dataset: object = None) -> None:
        # Not super().__init__(): see the class docstring. These are the attributes DistributedSampler.__init__ sets.
        self.shard = shard
        self.dataset = cast(Any, dataset)  # typed Dataset by torch; None when not known
        self.num_replicas = shard.world_size
        self.rank = shard.rank
        self.epoch = 0
        self.drop_last = False
        order = getattr(shard.batch_sampler, "sampler", None)
        self.shuffle = isinstance(order, (SeededPermutationSampler, RandomSampler))
        self.seed = order.seed if isinstance(order, SeededPermutationSampler) else 0

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        """This rank's number of samples (as ``len``); ``AttributeError`` when it is not known without iterating."""
        counts = self._counts()
        if counts is None:
            raise AttributeError(f"the sample count of a {type(self.shard.batch_sampler).__name__} is not known")
        return counts[0]

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """All ranks' number of samples; ``AttributeError`` when it is not known without iterating."""
        counts = self._counts()
        if counts is None:
            raise AttributeError(f"the sample count of a {type(self.shard.batch_sampler).__name__} is not known")
        return counts[1]

    def _counts(self) -> tuple[int, int] | None:
        """``(this rank's samples, all ranks' samples)``, known for a standard ``BatchSampler`` over a sized sampler."""
        batches = self.shard.batch_sampler
        if type(batches) is not BatchSampler or not isinstance(batches.sampler, Sized):
            return None
        size, count = batches.batch_size, len(batches)
        total = count * size if batches.drop_last else len(batches.sampler)
        mine = len(range(self.rank, count, self.num_replicas)) * size
        if count > 0 and (count - 1) % self.num_replicas == self.rank:
            mine -= count * size - total  # the last batch is this rank's: it may be short
        return mine, total

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` and forward it as :meth:`BatchShardSampler.set_epoch` does (the batches follow it)."""
        self.epoch = epoch
        self.shard.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:  # type: ignore[override]
        return (index for batch in self.shard for index in batch)

    def __len__(self) -> int:
        counts = self._counts()
        if counts is None:
            raise TypeError(f"the share of a {type(self.shard.batch_sampler).__name__} has no known length")
        return counts[0]


class RankStridedIterable(IterableDataset[Any]):
    """An IterableDataset whose stream is dealt round-robin to ranks: item ``j`` goes to rank ``j % world_size``.

    Striding happens inside each DataLoader worker on that worker's own stream, so a dataset that splits its
    stream between workers (as PyTorch asks IterableDatasets to do) is still covered exactly once.

    Args:
        dataset: the wrapped dataset; it must yield the same items in the same order on every rank.
        rank: this process's global rank.
        world_size: number of ranks.

    """

    def __init__(self, dataset: IterableDataset[Any], rank: int, world_size: int) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.rank, None, self.world_size)

    def __getattr__(self, name: str) -> Any:
        # Attributes of the wrapped dataset (e.g. `classes`) stay reachable through the DataLoader.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


@dataclass(frozen=True)
class ShardResult:
    """What :func:`shard_evaluation_dataloader` did.

    Attributes:
        dataloader: the dataloader to use (the input when nothing was changed).
        sharded: whether the dataloader is now sharded exactly by this package.
        warning: a sentence to show once when exactness cannot be guaranteed, else ``None``.

    """

    dataloader: object
    sharded: bool
    warning: str | None = None


def _single_device_sampler(sampler: object, dataset: object, seed: int) -> tuple[Sampler[Any], bool]:
    """The sampler a single device would use, with an order that every rank computes identically.

    Returns:
        ``(sampler, known)``: the sampler, and whether its order is known to be the same on every rank.

    """
    if isinstance(sampler, DistributedSampler) and isinstance(dataset, Sized):  # a user-made, padded one
        if sampler.shuffle:
            return SeededPermutationSampler(len(dataset), sampler.seed), True
        return SequentialSampler(dataset), True
    if isinstance(sampler, RandomSampler) and sampler.generator is None and not sampler.replacement:
        return SeededPermutationSampler(len(sampler), seed), True
    return cast(Sampler[Any], sampler), isinstance(sampler, SequentialSampler)


def shard_evaluation_dataloader(
    dataloader: object, *, rank: int, world_size: int, predicting: bool, name: str, seed: int = 0
) -> ShardResult:
    """Shard a user's evaluation dataloader so that every sample goes to exactly one rank.

    Called instead of Lightning's distributed-sampler injection, on the dataloader as the user returned it.

    Args:
        dataloader: the user's dataloader.
        rank: this process's global rank.
        world_size: number of ranks.
        predicting: the dataloader serves ``trainer.predict`` (Lightning then tracks its batch indices, and never
            drops the last partial batch).
        name: how to name the dataloader in warnings, e.g. ``"val_dataloader"``.
        seed: seed of the order shared by all ranks when the dataloader shuffles.

    Returns:
        The new dataloader and what was done; see :class:`ShardResult`. ``sharded=False`` means: leave the
        dataloader to Lightning.

    """
    warning: str | None = None
    if world_size == 1:
        return ShardResult(dataloader, sharded=False)
    if not isinstance(dataloader, DataLoader):
        warning = (
            f"ddp_strategy: the {name} is a {type(dataloader).__name__}, not a DataLoader, so it cannot be sharded: "
            "every rank evaluates all of it and each sample is counted once per rank. Return a DataLoader."
        )
        return ShardResult(dataloader, sharded=False, warning=warning)
    mode = RunningStage.PREDICTING if predicting else None
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        dl_args, dl_kwargs = dataloader_init_args(dataloader, None, mode)
        dl_kwargs["dataset"] = RankStridedIterable(dataset, rank, world_size)
        warning = (
            f"ddp_strategy: the {name} over the IterableDataset {type(dataset).__name__} is sharded by dealing its "
            f"items round-robin to the {world_size} ranks (item j to rank j % {world_size}, within each worker). "
            "This is exact only if the dataset yields the same items in the same order on every rank and does not "
            "shard by rank itself; if it does, pass `SafeDDPStrategy(exact_evaluation=False)`."
        )
        return ShardResult(reinstantiate_dataloader(dataloader, *dl_args, **dl_kwargs), True, warning)
    if dataloader.batch_size is None and dataloader.batch_sampler is None:
        warning = (
            f"ddp_strategy: the {name} has automatic batching disabled (`batch_size=None`), so it is not sharded "
            "exactly: it keeps Lightning's padded DistributedSampler and some samples are counted twice."
        )
        return ShardResult(dataloader, sharded=False, warning=warning)

    batch_sampler: Any = dataloader.batch_sampler
    sampler = batch_sampler.sampler if _has_sampler(batch_sampler) else dataloader.sampler
    single, known_order = _single_device_sampler(sampler, dataset, seed)
    # Lightning rebuilds the user's batch sampler (same class, batch size, drop_last) over `single`: the batches
    # one device would run. In predict mode it also forces drop_last=False and adds its index-tracking wrapper.
    dl_args, dl_kwargs = dataloader_init_args(dataloader, single, mode)
    single_batches = dl_kwargs.get("batch_sampler")
    single_batches = unwrap_index_batch_sampler(single_batches)
    if single_batches is None:  # a standard BatchSampler, given to the DataLoader or made by it
        size = cast(int, getattr(batch_sampler, "batch_size", dataloader.batch_size))
        drop_last = bool(getattr(batch_sampler, "drop_last", dataloader.drop_last))
        single_batches = BatchSampler(single, size, drop_last and not predicting)
    custom_batches = type(single_batches) is not BatchSampler
    shard: Any = BatchShardSampler(single_batches, rank, world_size, dataset=dataset)
    if predicting:
        shard = IndexBatchSamplerWrapper(shard)
    dl_kwargs.update(sampler=None, shuffle=False, batch_sampler=shard, batch_size=1, drop_last=False)
    new = reinstantiate_dataloader(dataloader, *dl_args, **dl_kwargs)
    if not known_order or custom_batches:
        kind = type(single_batches) if custom_batches else type(single)
        what = f"{'batch sampler' if custom_batches else 'sampler'} {kind.__name__}"
        warning = (
            f"ddp_strategy: the {name} uses the custom {what}; its batches are dealt whole to the {world_size} "
            "ranks, which is exact only if it yields the same batches in the same order on every rank (seed its "
            "random generator identically on all ranks)."
        )
    return ShardResult(new, sharded=True, warning=warning)


def _has_sampler(batch_sampler: object) -> bool:
    return batch_sampler is not None and hasattr(batch_sampler, "sampler")
