"""Make every rank compute the same logged epoch values, in the same order, even ranks that ran no batch.

Lightning computes an epoch value (a ``self.log``-ed tensor with ``sync_dist=True``, or a torchmetrics ``Metric``)
with one or more collectives, for each key the rank logged. With exact sharding a rank may have no batch of a
dataloader and so never log its keys: the ranks that did would wait forever in the metric sync. Before the epoch
values are computed, the ranks exchange their list of logged keys; a rank missing a key gets an empty entry for
it (the reduction's identity: zero sum and zero count, or the torchmetrics object in its reset state), and every
rank orders its entries the same way. The sync itself stays Lightning's and torchmetrics'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat.loops import mark_entry_current, new_result_entry

__all__ = ["LoggedKey", "active_keys", "add_missing_entries", "merge_keys"]

_REDUCTIONS: dict[str, Callable[..., Any]] = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}


@dataclass(frozen=True)
class LoggedKey:
    """What is needed to recreate a logged entry on a rank that never logged it.

    Attributes:
        key: the result collection's key (``"{fx}.{name}"``, plus ``".{dataloader_idx}"``).
        fx: the hook that logged it (with the dataloader suffix).
        name: the logged name.
        is_tensor: a tensor value (``False``: a torchmetrics ``Metric``).
        reduce: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
        on_step: logged per step.
        on_epoch: logged per epoch.
        prog_bar: shown in the progress bar.
        logger: sent to the logger.
        enable_graph: the graph was kept.
        add_dataloader_idx: the dataloader index is appended to the name.
        dataloader_idx: the dataloader index, if several.
        metric_attribute: the ``Metric``'s attribute path in the LightningModule.
        sync: ``sync_dist`` was set.
        rank_zero_only: ``rank_zero_only`` was set.

    """

    key: str
    fx: str
    name: str
    is_tensor: bool
    reduce: str
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    enable_graph: bool
    add_dataloader_idx: bool
    dataloader_idx: int | None
    metric_attribute: str | None
    sync: bool
    rank_zero_only: bool


def _reduce_name(fn: Callable[..., Any]) -> str:
    for name, reduce in _REDUCTIONS.items():
        if fn is reduce:
            return name
    return {sum: "sum", max: "max", min: "min"}.get(fn, "mean")


def active_keys(results: dict[str, Any], dataloader_idx: int | None) -> list[LoggedKey]:
    """The entries of a Lightning result collection holding values of this epoch for one dataloader, in order."""
    keys = []
    for key, entry in results.items():
        if entry.has_reset or entry.meta.dataloader_idx != dataloader_idx:
            continue
        meta = entry.meta
        keys.append(
            LoggedKey(
                key=key,
                fx=meta.fx,
                name=meta.name,
                is_tensor=entry.is_tensor,
                reduce=_reduce_name(meta.reduce_fx),
                on_step=meta.on_step,
                on_epoch=meta.on_epoch,
                prog_bar=meta.prog_bar,
                logger=meta.logger,
                enable_graph=meta.enable_graph,
                add_dataloader_idx=meta.add_dataloader_idx,
                dataloader_idx=meta.dataloader_idx,
                metric_attribute=meta.metric_attribute,
                sync=meta.sync.should,
                rank_zero_only=meta.sync.rank_zero_only,
            )
        )
    return keys


def merge_keys(per_rank: Sequence[Sequence[LoggedKey]]) -> list[LoggedKey]:
    """All ranks' keys in one order every rank computes the same way: rank 0's order, then what others add."""
    merged: dict[str, LoggedKey] = {}
    for keys in per_rank:
        for logged in keys:
            merged.setdefault(logged.key, logged)
    return list(merged.values())


def add_missing_entries(
    results: dict[str, Any],
    merged: Sequence[LoggedKey],
    *,
    module: torch.nn.Module,
    sync_fn: Callable[..., Any],
    device: torch.device,
) -> int:
    """Give ``results`` an empty entry for every merged key it lacks, and put its entries in the merged order.

    Args:
        results: this rank's Lightning ``_ResultCollection``.
        merged: every rank's active keys, from :func:`merge_keys`.
        module: the LightningModule (to find logged ``Metric`` objects by attribute path).
        sync_fn: the function Lightning syncs logged tensors with (the strategy's ``reduce``).
        device: the device of new entries.

    Returns:
        How many entries were added or re-activated.

    Raises:
        RuntimeError: a logged ``Metric`` has no attribute path in the module (Lightning always records one).

    """
    changed = 0
    for logged in merged:
        entry = results.get(logged.key)
        if entry is not None and not entry.has_reset:
            continue
        if entry is None:
            metric = None
            if not logged.is_tensor:
                if logged.metric_attribute is None:
                    raise RuntimeError(f"ddp_strategy: logged Metric {logged.name!r} has no attribute path")
                metric = module.get_submodule(logged.metric_attribute)
            entry = new_result_entry(
                fx=logged.fx,
                name=logged.name,
                is_tensor=logged.is_tensor,
                reduce_fx=_REDUCTIONS[logged.reduce],
                sync_fn=sync_fn,
                sync=logged.sync,
                rank_zero_only=logged.rank_zero_only,
                device=device,
                metric=metric,
                prog_bar=logged.prog_bar,
                logger=logged.logger,
                on_step=logged.on_step,
                on_epoch=logged.on_epoch,
                enable_graph=logged.enable_graph,
                add_dataloader_idx=logged.add_dataloader_idx,
                dataloader_idx=logged.dataloader_idx,
                metric_attribute=logged.metric_attribute,
            )
            results[logged.key] = entry
        # An entry in its reset state: nothing seen here. Mark it current, like on every other rank.
        mark_entry_current(entry)
        changed += 1
    order = {logged.key: i for i, logged in enumerate(merged)}
    if list(results)[: len(order)] != list(order):
        entries = sorted(results.items(), key=lambda item: order.get(item[0], len(order)))
        results.clear()
        results.update(entries)
    return changed
