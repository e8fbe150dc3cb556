"""``ShardingCheck``: verify at the first training batches that the ranks train on different data.

Every rank fingerprints its first ``batches`` training batches (a CRC-32 of every tensor's bytes, computed
on the batch's device; see :mod:`ddp_strategy.fingerprint`) and, where it can be known without side effects, the
dataset indices of the samples in them. One small all-gather then compares the ranks, together with a description
of each rank's training sampler. After that the callback does nothing (zero per-step cost).

What is reported (``on_duplicate="raise"`` raises :class:`~ddp_strategy.errors.ShardingError` on every rank,
``"warn"`` warns once on rank 0):

* two or more ranks received identical batches (same data, and same sample indices where those are known), with
  a sentence naming the cause (``Trainer(use_distributed_sampler=False)`` with a plain sampler, a sampler seeded
  identically on every rank, a ``DistributedSampler`` built with the wrong ``num_replicas``/``rank``, an
  ``IterableDataset``) and the fix;
* ``DistributedSampler`` settings that make shards overlap or leave data out even when the first batches differ:
  different ``seed`` on different ranks with ``shuffle=True``, ``num_replicas`` other than the world size, or two
  ranks with the same sampler ``rank``.

What is not a false alarm: when every rank's training sampler is a ``DistributedSampler`` with ``num_replicas``
equal to the world size, distinct ``rank`` values and one seed, sharding is correct by construction and identical
batches are coincidence (a dataset whose samples all hold the same values, or the padding a ``DistributedSampler``
adds to a dataset smaller than the world size). When indices are known (a standard ``BatchSampler`` over a
``DistributedSampler`` or ``SequentialSampler``), batches with equal data but different indices are coincidence too,
and batches with equal indices but different data come from a dataset that shards itself by rank.

What cannot be told apart: with another sampler (``RandomSampler``, a custom sampler or batch sampler, an
``IterableDataset``) the indices are unknown, so equal data on two ranks is reported even if the samples only look
alike (use ``on_duplicate="warn"`` or leave the check out for such data). Ranks reading the same samples but
augmenting them differently (per-rank random transforms) produce different data and are not detected.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Literal

import torch.distributed as dist
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from typing_extensions import override

from .._compat.lightning import (
    Callback,
    add_callback,
    find_callback,
    pl,
    rank_zero_warn,
    training_dataloaders,
    uses_distributed_sampler,
)
from ..errors import ShardingError
from ..fingerprint import fingerprint_tensors
from ..positions import format_ranks

__all__ = [
    "BatchReport",
    "Finding",
    "LoaderFacts",
    "ShardingCheck",
    "analyse",
    "batch_fingerprint",
    "batch_indices",
    "describe_loader",
    "ensure_sharding_check",
]

log = logging.getLogger(__name__)

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


def _indices_fingerprint(indices: Sequence[int] | None) -> str | None:
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


# ---------------------------------------------------------------------------------------------- callback
class ShardingCheck(Callback):
    """Compare the first ``batches`` training batches across ranks; report ranks that train on the same data.

    One all-gather of a few short strings per rank, at the ``batches``-th training batch (or at the end of training
    if it had fewer), on the control plane of :class:`~ddp_strategy.SafeDDPStrategy`; with another strategy, on
    the default ``torch.distributed`` group. Nothing is done afterwards, and nothing in a single-process run. See
    the module documentation for what can and cannot be detected.

    Args:
        batches: how many of the first training batches to compare. Ranks count as duplicates only when they
            received identical batches in every one of them.
        on_duplicate: ``"raise"`` a :class:`~ddp_strategy.errors.ShardingError` on every rank, or ``"warn"``
            once on rank 0.

    Attributes:
        finding: the problem found, ``None`` when none was (or before the comparison).
        compared: whether the comparison ran in the current (last) fit.
        reports: every rank's :class:`BatchReport`, in rank order, once compared.

    Raises:
        ValueError: ``batches`` is not a positive integer or ``on_duplicate`` is unknown.

    """

    def __init__(self, batches: int = 2, *, on_duplicate: Literal["raise", "warn"] = "raise") -> None:
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
            raise ValueError(f"`batches` must be a positive integer, got {batches!r}.")
        if on_duplicate not in ("raise", "warn"):
            raise ValueError(f"`on_duplicate` must be 'raise' or 'warn', got {on_duplicate!r}.")
        self.batches = batches
        self.on_duplicate = on_duplicate
        self.finding: Finding | None = None
        self.compared = False
        self.reports: list[BatchReport] | None = None
        self._data: list[str | None] = []
        self._indices: list[str | None] = []
        self._done = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finding, self.compared, self.reports, self._done = None, False, None, trainer.world_size < 2
        self._data, self._indices = [], []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        loaders = training_dataloaders(trainer)
        self._data.append(batch_fingerprint(batch))
        self._indices.append(_indices_fingerprint(batch_indices(loaders[0], batch_idx) if len(loaders) == 1 else None))
        if len(self._data) >= self.batches:
            self.check(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._done and self._data:  # training took fewer steps than `batches`; every rank took as many
            self.check(trainer)

    def check(self, trainer: pl.Trainer) -> None:
        """Gather the fingerprints collected so far and compare them (every rank must call it, once).

        Raises:
            ShardingError: ``on_duplicate="raise"`` and ranks train on the same data.
            RuntimeError: several ranks but neither a control plane nor an initialised ``torch.distributed``.

        """
        self._done = True
        report = BatchReport(
            rank=trainer.global_rank,
            use_distributed_sampler=uses_distributed_sampler(trainer),
            global_seed=os.environ.get("PL_GLOBAL_SEED"),
            loaders=tuple(describe_loader(dl) for dl in training_dataloaders(trainer)),
            data=tuple(self._data),
            indices=tuple(self._indices),
        )
        reports = _gather(trainer, report)
        self.compared, self.reports = True, reports
        self.finding = analyse(reports, len(reports))
        n = len(self._data)
        if self.finding is None:
            if trainer.is_global_zero:
                log.debug("ShardingCheck: %d ranks received different data in %d batch(es).", len(reports), n)
            return
        if self.on_duplicate == "raise":
            raise ShardingError(self.finding.message, ranks=self.finding.ranks, cause=self.finding.cause)
        rank_zero_warn(self.finding.message)


def _gather(trainer: pl.Trainer, report: BatchReport) -> list[BatchReport]:
    control = getattr(trainer.strategy, "control_plane", None)
    if control is not None:
        gathered: list[BatchReport] = control.all_gather_object(report, name="sharding-check")
        return gathered
    if dist.is_available() and dist.is_initialized():
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, report)
        return out
    raise RuntimeError(
        f"ShardingCheck runs with world size {trainer.world_size} but found neither SafeDDPStrategy's control plane "
        f"nor an initialised torch.distributed process group (strategy {type(trainer.strategy).__name__}). Use it "
        "with a DDP-style strategy, or remove it from the callbacks."
    )


def ensure_sharding_check(trainer: pl.Trainer, on_duplicate: Literal["raise", "warn"] = "raise") -> ShardingCheck:
    """Append a ``ShardingCheck`` to ``trainer.callbacks`` unless the user added one; return the one in effect.

    Meant for strategies that enable the check by default (call it from ``Strategy.setup(trainer)``).
    """
    existing: ShardingCheck | None = find_callback(trainer, ShardingCheck)
    if existing is not None:
        return existing
    check = ShardingCheck(on_duplicate=on_duplicate)
    add_callback(trainer, check)
    return check
