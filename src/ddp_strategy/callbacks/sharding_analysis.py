"""What :class:`~ddp_strategy.callbacks.ShardingCheck` compares, and the comparison: pure functions, no collective.

Each rank describes its training dataloaders (:func:`describe_loader`) and fingerprints its first batches
(:func:`batch_fingerprint`, and :func:`batch_indices` where the indices can be known without side effects) into a
:class:`BatchReport`; :func:`analyse` turns every rank's report into a :class:`Finding`, or ``None``. What is
reported and what is not a false alarm: :mod:`ddp_strategy.callbacks.sharding_check`.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ..fingerprint import fingerprint_tensors
from ..positions import format_ranks

__all__ = [
    "BatchReport",
    "Finding",
    "LoaderFacts",
    "analyse",
    "batch_fingerprint",
    "batch_indices",
    "describe_loader",
    "indices_fingerprint",
]

_INDEXABLE_SAMPLERS = (DistributedSampler, SequentialSampler)  # iterating them has no side effect


@dataclass(frozen=True)
class LoaderFacts:
    """How one training dataloader picks its samples on one rank.

    Attributes:
        kind: the dataloader's class name (``"DataLoader"``, or the type of another iterable).
        dataset: the dataset's class name, ``""`` when there is none.
        iterable: the dataset is an ``IterableDataset`` (no sampler applies) or the loader is no ``DataLoader``.
        sampler: the sampler's class name (that of ``batch_sampler.sampler`` under a custom batch sampler).
        batch_sampler: the batch sampler's class name, ``""`` when there is none.
        distributed: the sampler is a ``DistributedSampler`` (or a subclass).
        num_replicas: ``DistributedSampler.num_replicas``.
        rank: ``DistributedSampler.rank``.
        seed: ``DistributedSampler.seed``.
        shuffle: ``DistributedSampler.shuffle``.
        generator_seed: the initial seed of a ``RandomSampler``'s own generator.

    """

    kind: str
    dataset: str = ""
    iterable: bool = False
    sampler: str = ""
    batch_sampler: str = ""
    distributed: bool = False
    num_replicas: int | None = None
    rank: int | None = None
    seed: int | None = None
    shuffle: bool | None = None
    generator_seed: int | None = None


@dataclass(frozen=True)
class BatchReport:
    """What one rank contributes to the comparison.

    Attributes:
        rank: global rank.
        use_distributed_sampler: ``Trainer(use_distributed_sampler=...)``, ``None`` when unknown.
        global_seed: ``PL_GLOBAL_SEED`` or ``None``.
        loaders: one entry per training dataloader.
        data: one fingerprint per checked batch (``None``: nothing in the batch could be fingerprinted).
        indices: one fingerprint of the batch's dataset indices per checked batch (``None``: unknown).

    """

    rank: int
    use_distributed_sampler: bool | None
    global_seed: str | None
    loaders: tuple[LoaderFacts, ...]
    data: tuple[str | None, ...]
    indices: tuple[str | None, ...]


@dataclass(frozen=True)
class Finding:
    """The outcome of :func:`analyse` when something is wrong.

    Attributes:
        message: the full report.
        cause: the cause sentence.
        ranks: every rank involved.
        duplicates: groups of ranks that received identical batches.

    """

    message: str
    cause: str
    ranks: tuple[int, ...]
    duplicates: tuple[tuple[int, ...], ...]


# ---------------------------------------------------------------------------------------------- fingerprints
def _leaves(obj: Any, path: str, tensors: list[tuple[str, str, Tensor]], plain: list[str]) -> None:
    if isinstance(obj, Tensor):
        tensors.append((path, "batch", obj))
    elif isinstance(obj, Mapping):
        for key in obj:
            _leaves(obj[key], f"{path}[{key!r}]", tensors, plain)
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            _leaves(item, f"{path}[{i}]", tensors, plain)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            _leaves(getattr(obj, f.name), f"{path}.{f.name}", tensors, plain)
    elif obj is None or isinstance(obj, str | bytes | int | float | complex):
        plain.append(f"{path}={obj!r}")
    # other objects (NumPy arrays, custom classes) are not fingerprinted: their repr may hold memory addresses


def batch_fingerprint(batch: Any) -> str | None:
    """A digest of a batch's tensors (bytes, shapes, dtypes), strings and numbers, in the batch's structure.

    Tensors are hashed where they live (see :func:`~ddp_strategy.fingerprint.fingerprint_tensors`); tensors,
    mappings, lists, tuples and dataclasses are walked. Returns ``None`` when nothing could be fingerprinted.
    """
    tensors: list[tuple[str, str, Tensor]] = []
    plain: list[str] = []
    _leaves(batch, "batch", tensors, plain)
    if not tensors and not plain:
        return None
    h = hashlib.blake2b(digest_size=12)
    for fp in fingerprint_tensors(tensors):
        h.update(repr((fp.name, fp.shape, fp.dtype, fp.digest)).encode())
    for item in plain:
        h.update(item.encode())
    return h.hexdigest()


def indices_fingerprint(indices: Sequence[int] | None) -> str | None:
    """A short digest of a batch's dataset indices (``None`` when they are unknown)."""
    if indices is None:
        return None
    return hashlib.blake2b(repr(list(indices)).encode(), digest_size=12).hexdigest()


def batch_indices(dataloader: object, batch_idx: int) -> list[int] | None:
    """The dataset indices of batch ``batch_idx`` of the current epoch, when they can be known without side effects.

    Known for a ``DataLoader`` over a map-style dataset with a standard ``BatchSampler`` over a
    ``DistributedSampler`` or ``SequentialSampler`` (exact types: iterating them draws no random numbers).
    ``RandomSampler`` and custom samplers are never iterated here, as that would change the data order.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler or type(batch_sampler.sampler) not in _INDEXABLE_SAMPLERS:
        return None
    size = batch_sampler.batch_size
    return [int(i) for i in itertools.islice(iter(batch_sampler.sampler), batch_idx * size, (batch_idx + 1) * size)]


# ---------------------------------------------------------------------------------------------- loaders
def describe_loader(dataloader: object) -> LoaderFacts:
    """Describe how ``dataloader`` picks its samples (see :class:`LoaderFacts`)."""
    if not isinstance(dataloader, DataLoader):
        return LoaderFacts(kind=type(dataloader).__name__, iterable=True)
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        return LoaderFacts(kind=type(dataloader).__name__, dataset=type(dataset).__name__, iterable=True)
    batch_sampler = dataloader.batch_sampler
    sampler: object = dataloader.sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        sampler = getattr(batch_sampler, "sampler", sampler)
    generator = getattr(sampler, "generator", None) if isinstance(sampler, RandomSampler) else None
    facts = LoaderFacts(
        kind=type(dataloader).__name__,
        dataset=type(dataset).__name__,
        sampler=type(sampler).__name__,
        batch_sampler=type(batch_sampler).__name__ if batch_sampler is not None else "",
        generator_seed=int(generator.initial_seed()) if generator is not None else None,
    )
    if not isinstance(sampler, DistributedSampler):
        return facts
    return replace(
        facts,
        distributed=True,
        num_replicas=int(sampler.num_replicas),
        rank=int(sampler.rank),
        seed=int(sampler.seed),
        shuffle=bool(sampler.shuffle),
    )


# ---------------------------------------------------------------------------------------------- analysis
def _verified(reports: Sequence[BatchReport], world_size: int) -> bool:
    """Every training loader on every rank is a DistributedSampler that shards correctly by construction."""
    counts = {len(r.loaders) for r in reports}
    if len(counts) != 1 or counts == {0}:
        return False
    for i in range(len(reports[0].loaders)):
        facts = [r.loaders[i] for r in reports]
        if not all(f.distributed and f.num_replicas == world_size for f in facts):
            return False
        if sorted(f.rank for f in facts if f.rank is not None) != list(range(world_size)):
            return False
        if any(f.shuffle for f in facts) and len({f.seed for f in facts}) > 1:
            return False
    return True


def _sampler_problems(reports: Sequence[BatchReport], world_size: int) -> tuple[list[str], list[int]]:
    """DistributedSampler settings that make shards overlap or leave data out, whatever the batches look like."""
    problems: list[str] = []
    ranks: set[int] = set()
    if len({len(r.loaders) for r in reports}) != 1:
        return problems, []
    for i in range(len(reports[0].loaders)):
        facts = {r.rank: r.loaders[i] for r in reports}
        if not all(f.distributed for f in facts.values()):
            continue
        which = f"training dataloader {i}'s " if len(reports[0].loaders) > 1 else "the training "
        sampler = next(iter(facts.values())).sampler
        seeds = _grouped({rank: f.seed for rank, f in facts.items()})
        if len(seeds) > 1 and any(f.shuffle for f in facts.values()):
            problems.append(
                f"{which}{sampler} uses different seeds on different ranks ({_listing(seeds)}) with shuffle=True, "
                "so every rank shuffles the dataset differently: the shards overlap and some samples are never "
                "seen in an epoch. Fix: give every rank the same seed (Lightning's own DistributedSampler uses the "
                "global seed, seed=int(os.environ.get('PL_GLOBAL_SEED', 0)))"
            )
            ranks.update(facts)
        replicas = _grouped({rank: f.num_replicas for rank, f in facts.items()})
        if any(value != world_size for value, _ in replicas):
            problems.append(
                f"{which}{sampler} has num_replicas {_listing(replicas)} but the world size is {world_size}, so "
                "the ranks do not split the dataset between them. Fix: build it with num_replicas=trainer.world_size "
                "and rank=trainer.global_rank, or as DistributedSampler(dataset) once the process group exists "
                "(e.g. in train_dataloader()), or let Lightning insert it (use_distributed_sampler=True)"
            )
            ranks.update(rank for value, rs in replicas if value != world_size for rank in rs)
        shared = [(value, rs) for value, rs in _grouped({rank: f.rank for rank, f in facts.items()}) if len(rs) > 1]
        if shared:
            listed = "; ".join(f"rank={value} on ranks {format_ranks(rs)}" for value, rs in shared)
            problems.append(
                f"{which}{sampler} was given the same sampler rank on several ranks ({listed}), so they read the "
                "same shard. Fix: pass rank=trainer.global_rank (or omit it once the process group exists)"
            )
            ranks.update(rank for _, rs in shared for rank in rs)
    return problems, sorted(ranks)


def _grouped(values: Mapping[int, object]) -> list[tuple[object, list[int]]]:
    groups: dict[object, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def _listing(groups: list[tuple[object, list[int]]]) -> str:
    return "; ".join(f"{value} on rank(s) {format_ranks(ranks)}" for value, ranks in groups)


def _duplicate_groups(reports: Sequence[BatchReport]) -> list[tuple[tuple[int, ...], bool]]:
    """Groups of ranks with identical batches; each with whether the sample indices were known (and equal)."""
    groups: dict[tuple[tuple[str | None, ...], tuple[str | None, ...] | None], list[int]] = {}
    for r in reports:
        if not r.data or None in r.data:
            continue  # unknown data never counts as a duplicate
        known = r.indices if r.indices and None not in r.indices else None
        groups.setdefault((r.data, known), []).append(r.rank)
    return [(tuple(ranks), key[1] is not None) for key, ranks in groups.items() if len(ranks) > 1]


def _cause(report: BatchReport, world_size: int) -> tuple[str, str, bool]:
    """The likely cause and fix of identical batches, from one of the ranks' description.

    The flag says whether the sampler certainly does not shard (then equal data cannot be a coincidence of
    look-alike samples: the ranks read the same samples).
    """
    if not report.loaders:
        return (
            "the training dataloader could not be inspected",
            "make sure each rank loads a different part of the data (a DistributedSampler, or sharding by "
            "torch.distributed.get_rank())",
            False,
        )
    f = report.loaders[0]
    if f.iterable:
        what = f"an IterableDataset ({f.dataset})" if f.dataset else f"a {f.kind}, not a DataLoader"
        return (
            f"the training data comes from {what}, which Lightning cannot shard with a sampler, so every rank "
            "iterates the same stream",
            "shard inside the dataset's __iter__ by rank, e.g. itertools.islice(stream, rank, None, world_size) "
            "with torch.distributed.get_rank() and get_world_size() (and split again by "
            "torch.utils.data.get_worker_info() when num_workers > 0)",
            False,
        )
    if f.distributed:
        return (
            f"the training DataLoader's {f.sampler} has num_replicas={f.num_replicas}, rank={f.rank} on these "
            f"ranks (world size {world_size}), so they read the same shard",
            "build it with num_replicas=trainer.world_size and rank=trainer.global_rank, or as "
            "DistributedSampler(dataset) once the process group exists (e.g. in train_dataloader()), or let "
            "Lightning insert it (use_distributed_sampler=True, the default)",
            True,
        )
    if f.sampler == "RandomSampler" and f.generator_seed is not None:
        order = f"a RandomSampler whose generator has the same seed ({f.generator_seed}) on every rank"
    elif f.sampler == "RandomSampler":
        seed = report.global_seed if report.global_seed is not None else "not set"
        order = f"a RandomSampler drawing its order from the global RNG (PL_GLOBAL_SEED={seed} on every rank)"
    elif f.sampler == "SequentialSampler":
        order = "a SequentialSampler (the same order everywhere)"
    else:
        order = f"a {f.sampler}" + (f" under a {f.batch_sampler}" if f.batch_sampler != "BatchSampler" else "")
    standard = f.sampler in ("RandomSampler", "SequentialSampler") and f.batch_sampler == "BatchSampler"
    if report.use_distributed_sampler is False:
        return (
            f"Trainer(use_distributed_sampler=False) is set and the training DataLoader uses {order} instead of a "
            "DistributedSampler, so every rank iterates the whole dataset in the same order",
            "remove use_distributed_sampler=False so that Lightning inserts a DistributedSampler, or pass "
            "sampler=DistributedSampler(dataset, shuffle=True) to the training DataLoader, created once the "
            "process group exists (e.g. in train_dataloader())",
            standard,
        )
    return (
        f"the training DataLoader uses {order}, which Lightning did not replace by a DistributedSampler "
        "(a custom batch_sampler or sampler is kept as is), and it does not shard by rank",
        "make the sampler or batch sampler shard by rank (torch.distributed.get_rank()/get_world_size()), or use a "
        "standard sampler so that Lightning can insert a DistributedSampler",
        False,
    )


def analyse(reports: Sequence[BatchReport], world_size: int) -> Finding | None:
    """Compare the ranks' reports; a :class:`Finding` when ranks share data or samplers do not shard, else ``None``.

    Args:
        reports: one per rank, in rank order (as returned by an all-gather).
        world_size: the number of ranks.

    """
    problems, problem_ranks = _sampler_problems(reports, world_size)
    duplicates = [] if _verified(reports, world_size) else _duplicate_groups(reports)
    if not problems and not duplicates:
        return None
    by_rank = {r.rank: r for r in reports}
    parts: list[str] = []
    cause = ""
    if duplicates:
        n = len(reports[0].data)
        for ranks, indices_known in duplicates:
            same = "the same data and the same sample indices" if indices_known else "the same data"
            parts.append(
                f"ranks {format_ranks(list(ranks))} received identical training batches ({same} in each of the "
                f"first {n} batch(es))."
            )
        cause, fix, certain = _cause(by_rank[duplicates[0][0][0]], world_size)
        parts.append(f"Cause: {cause}. Fix: {fix}.")
        if not certain and not all(known for _, known in duplicates):
            parts.append(
                "The sample indices are unknown for this sampler: if it does shard and the dataset holds samples "
                "with identical values, this is a coincidence; then use ShardingCheck(on_duplicate='warn')."
            )
    for problem in problems:
        parts.append(problem[0].upper() + problem[1:] + ".")
    if not cause:
        cause = problems[0]
    involved = sorted({rank for group, _ in duplicates for rank in group} | set(problem_ranks))
    return Finding(
        message="ShardingCheck: " + " ".join(parts),
        cause=cause,
        ranks=tuple(involved),
        duplicates=tuple(group for group, _ in duplicates),
    )
