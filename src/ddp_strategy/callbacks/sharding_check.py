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

import logging
import os
from typing import Any, Literal

import torch.distributed as dist
from typing_extensions import override

from .._compat.callback_hooks import restore_hooks, skip_hooks, skip_inherited_batch_hooks
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
from .sharding_analysis import (
    BatchReport,
    Finding,
    LoaderFacts,
    analyse,
    batch_fingerprint,
    batch_indices,
    describe_loader,
    indices_fingerprint,
)

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

#: the hooks that collect fingerprints until the comparison is done
_COLLECTING = ("on_train_batch_start",)


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
        self._skip_idle = False

    def skip_idle_hooks(self) -> None:
        """Let Lightning pass over the per-batch hooks while they have nothing to do: for the strategy's own check.

        Those hooks are then ``None`` on this instance: the inherited ones always, ``on_train_batch_start`` once
        the comparison is done (until the next fit starts). Lightning skips a hook that is not callable, which saves
        its dispatch (about 1 us per hook and step); the strategy does this for the check it adds itself, which
        nothing else calls.
        """
        self._skip_idle = True
        skip_inherited_batch_hooks(self)
        self._set_done(self._done)

    def _set_done(self, done: bool) -> None:
        self._done = done
        if self._skip_idle and done:
            skip_hooks(self, _COLLECTING, unless_overridden_below=ShardingCheck)
        elif self._skip_idle:
            restore_hooks(self, _COLLECTING)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finding, self.compared, self.reports = None, False, None
        self._data, self._indices = [], []
        self._set_done(trainer.world_size < 2)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        loaders = training_dataloaders(trainer)
        self._data.append(batch_fingerprint(batch))
        self._indices.append(indices_fingerprint(batch_indices(loaders[0], batch_idx) if len(loaders) == 1 else None))
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
        self._set_done(True)
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
    check.skip_idle_hooks()  # the strategy's own: nothing else calls its hooks
    add_callback(trainer, check)
    return check
