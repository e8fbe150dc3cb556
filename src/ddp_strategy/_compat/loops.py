"""Lightning's evaluation and prediction loops, taught that a rank may have no batch while others have some.

Stock loops skip evaluation on a rank whose dataloaders are empty, which is right on one device and a deadlock
with exact sharding: that rank would miss the epoch-end hooks and metric syncs the other ranks run. These
subclasses of Lightning's private loop classes skip only when *no* rank has a batch, and call the strategy's
exact-evaluation coordinator (anything with the methods of :class:`LoopAgreements`; in practice
:class:`~ddp_strategy.evaluation.coordinator.ExactEvaluation`) where ranks must agree. They are installed on a
Trainer's own loop objects by :func:`install_exact_loops`; everything else is the stock loop.

The logged-result entries a rank must create for keys it never logged (:func:`new_result_entry`) live here too:
they are instances of Lightning's private result classes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

import torch
from typing_extensions import override

from .lightning import RunningStage, pl

if TYPE_CHECKING:
    from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop as EvaluationLoop
    from lightning.pytorch.loops.prediction_loop import _PredictionLoop as PredictionLoop
    from lightning.pytorch.trainer.connectors.logger_connector import result as _result
else:
    EvaluationLoop = import_module(f"{pl.__name__}.loops.evaluation_loop")._EvaluationLoop
    PredictionLoop = import_module(f"{pl.__name__}.loops.prediction_loop")._PredictionLoop
    _result = import_module(f"{pl.__name__}.trainer.connectors.logger_connector.result")

__all__ = [
    "ExactEvaluationLoop",
    "ExactPredictionLoop",
    "LoopAgreements",
    "install_exact_loops",
    "mark_entry_current",
    "new_result_entry",
    "pass_loop_end_boundary",
    "repeat_validation_on_resume",
    "validation_progress_state",
    "validation_runs_after_this_batch",
]


class LoopAgreements(Protocol):
    """What the exact loops ask of the strategy's exact-evaluation coordinator."""

    def on_loop_start(self, max_batches: Sequence[int | float]) -> None:
        """Learn every rank's batch counts at the start of a loop."""

    def any_rank_has_batches(self, dataloaders: Sequence[object]) -> bool:
        """Whether any rank has a batch in ``dataloaders`` (this rank's shards), without communication."""

    def dataloaders_with_batches(self, seen: dict[int, int], num_dataloaders: int) -> list[int]:
        """Indices of the dataloaders in which at least one rank ran a batch."""

    def agree_on_logged_keys(self, results: Any, trainer: Any) -> None:
        """Make every rank hold the same logged entries, in the same order."""

    def gather_predictions(self, results: Any, *, num_dataloaders: int) -> Any:
        """Every rank's predictions in dataset order."""


def _coordinator(trainer: pl.Trainer) -> LoopAgreements | None:
    return getattr(trainer.strategy, "exact_evaluation_coordinator", None)


@contextmanager
def _zero_length_allowed(trainer: pl.Trainer) -> Iterator[None]:
    """Let Lightning accept an empty shard on one rank while it sets up evaluation data (only then)."""
    module = trainer.lightning_module
    if _coordinator(trainer) is None or module is None:
        yield
        return
    previous = module.allow_zero_length_dataloader_with_multiple_devices
    module.allow_zero_length_dataloader_with_multiple_devices = True
    try:
        yield
    finally:
        module.allow_zero_length_dataloader_with_multiple_devices = previous


def _someone_has_batches(loop: EvaluationLoop | PredictionLoop, coordinator: LoopAgreements) -> bool:
    """Whether any rank has a batch in this loop, decided identically on every rank without communication."""
    trainer = loop.trainer
    limit = {
        "validate": trainer.limit_val_batches,
        "sanity_check": trainer.limit_val_batches,
        "test": trainer.limit_test_batches,
        "predict": trainer.limit_predict_batches,
    }.get(str(getattr(loop, "_stage", RunningStage.PREDICTING).value), 1.0)
    combined = loop._combined_loader
    if combined is None or limit == 0:
        return False
    return coordinator.any_rank_has_batches(list(combined.flattened))


class _EmptyShardMixin:
    """Set-up shared by both loops: accept an empty shard, and skip only when no rank has a batch."""

    trainer: pl.Trainer

    def setup_data(self) -> None:
        with _zero_length_allowed(self.trainer):
            super().setup_data()  # type: ignore[misc]

    @property
    def skip(self) -> bool:
        if not super().skip:  # type: ignore[misc]
            return False
        coordinator = _coordinator(self.trainer)
        return coordinator is None or not _someone_has_batches(self, coordinator)  # type: ignore[arg-type]


class ExactEvaluationLoop(_EmptyShardMixin, EvaluationLoop):
    """Lightning's evaluation loop, run (with no batch) on ranks whose shard is empty; agrees on metrics."""

    @override
    def _on_evaluation_start(self, *args: Any, **kwargs: Any) -> None:
        coordinator = _coordinator(self.trainer)
        if coordinator is not None:
            coordinator.on_loop_start(self.max_batches)
        super()._on_evaluation_start(*args, **kwargs)

    @override
    def _store_dataloader_outputs(self) -> None:
        # Stock Lightning computes a dataloader's epoch values when *this rank* moves on to its next dataloader;
        # with uneven shards ranks move at different moments. Defer to `on_run_end`, where every rank computes
        # every dataloader's values in the same order.
        if _coordinator(self.trainer) is None:
            super()._store_dataloader_outputs()

    @override
    def on_run_end(self) -> list[Any]:
        pass_loop_end_boundary(self.trainer)
        coordinator = _coordinator(self.trainer)
        if coordinator is not None:
            several = self._is_sequential and self.num_dataloaders > 1
            connector = self.trainer._logger_connector
            stores = coordinator.dataloaders_with_batches(self._seen_batches_per_dataloader, self.num_dataloaders)
            if several and stores and stores[0] != 0:
                # Stock Lightning also "moves on" from dataloader 0 at the first batch when dataloader 0 is empty,
                # which adds one empty result; keep the returned list identical to a single device's.
                stores.insert(0, 0)
            for dataloader_idx in stores:
                self._results.dataloader_idx = dataloader_idx if several else None
                coordinator.agree_on_logged_keys(self._results, self.trainer)
                connector.epoch_end_reached()
                self._logged_outputs.append(connector.update_eval_epoch_metrics())
        return super().on_run_end()

    @override
    def _on_evaluation_epoch_end(self) -> None:
        super()._on_evaluation_epoch_end()
        coordinator = _coordinator(self.trainer)
        if coordinator is not None:  # values logged in the epoch-end hooks (no dataloader index)
            coordinator.agree_on_logged_keys(self._results, self.trainer)


class ExactPredictionLoop(_EmptyShardMixin, PredictionLoop):
    """Lightning's prediction loop that runs on ranks with an empty shard and returns predictions in dataset order."""

    @override
    def _on_predict_start(self) -> None:
        coordinator = _coordinator(self.trainer)
        if coordinator is not None:
            coordinator.on_loop_start(self.max_batches)
        super()._on_predict_start()

    @override
    def on_run_end(self) -> Any:
        pass_loop_end_boundary(self.trainer)
        results = super().on_run_end()
        coordinator = _coordinator(self.trainer)
        if coordinator is None or results is None:
            return results
        return coordinator.gather_predictions(results, num_dataloaders=self.num_dataloaders)


_SWAPS: tuple[tuple[type, type], ...] = ((EvaluationLoop, ExactEvaluationLoop), (PredictionLoop, ExactPredictionLoop))


def install_exact_loops(trainer: pl.Trainer) -> list[str]:
    """Switch the Trainer's stock evaluation and prediction loops to the exact ones (in place, state kept).

    Returns:
        Names of loops left alone because they are not Lightning's stock classes (a user-customised loop).

    """
    loops = {
        "fit_loop.epoch_loop.val_loop": trainer.fit_loop.epoch_loop.val_loop,
        "validate_loop": trainer.validate_loop,
        "test_loop": trainer.test_loop,
        "predict_loop": trainer.predict_loop,
    }
    custom = []
    for name, loop in loops.items():
        for stock, exact in _SWAPS:
            if type(loop) is exact:
                break
            if type(loop) is stock:
                loop.__class__ = exact
                break
        else:
            custom.append(name)
    return custom


# ---------------------------------------------------------------------------------------------- logged results
def new_result_entry(
    *,
    fx: str,
    name: str,
    is_tensor: bool,
    reduce_fx: Callable[..., Any],
    sync_fn: Callable[..., Any],
    sync: bool,
    rank_zero_only: bool,
    device: torch.device,
    metric: Any | None = None,
    **meta: Any,
) -> Any:
    """A Lightning logged-result entry as ``self.log`` would have created it on this rank, holding nothing.

    Args:
        fx: the hook that logged it (with the dataloader suffix).
        name: the logged name.
        is_tensor: a tensor value (``False``: the torchmetrics ``metric``).
        reduce_fx: the reduction (``torch.mean``, ``torch.sum``, ``torch.max`` or ``torch.min``).
        sync_fn: the function Lightning syncs logged tensors with (the strategy's ``reduce``).
        sync: ``sync_dist`` was set.
        rank_zero_only: ``rank_zero_only`` was set.
        device: the device of the entry.
        metric: the logged ``Metric`` object when ``is_tensor`` is ``False``.
        **meta: the other ``self.log`` options (``prog_bar``, ``logger``, ``on_step``, ``on_epoch``,
            ``enable_graph``, ``add_dataloader_idx``, ``dataloader_idx``, ``metric_attribute``).

    """
    metadata = _result._Metadata(fx=fx, name=name, reduce_fx=reduce_fx, **meta)
    metadata.sync = _result._Sync(fn=sync_fn, _should=sync, rank_zero_only=rank_zero_only)
    entry = _result._ResultMetric(metadata, is_tensor)
    if not is_tensor:
        entry.value = metric
    entry.to(device)
    return entry


def mark_entry_current(entry: Any) -> None:
    """Make a logged entry count as logged this epoch (so it is computed, and synced, like on the other ranks).

    Any value cached from an earlier epoch is dropped, and torchmetrics' "compute before update" warning is
    silenced for a rank whose shard was empty.
    """
    entry.has_reset = False
    entry._computed = None
    entry._update_count = max(entry._update_count, 1)


#: The extra callback hook the exact loops call (see :func:`pass_loop_end_boundary`).
LOOP_END_HOOK = "on_loop_batches_done"


def pass_loop_end_boundary(trainer: pl.Trainer) -> None:
    """Call ``on_loop_batches_done(trainer)`` on each callback that has it: this rank's batches of the loop are done.

    With uneven shards ranks run different numbers of batches; this is a point every rank passes once, before the
    loop's end collectives (the preemption stop agrees on it, see ``PreemptionStop``).
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        hook = getattr(callback, LOOP_END_HOOK, None)
        if callable(hook):
            hook(trainer)


def _validation_progress(trainer: pl.Trainer) -> Any:
    return trainer.fit_loop.epoch_loop.val_loop.batch_progress


def validation_progress_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The batch counters of ``fit``'s validation loop (a copy), e.g. as they are when a validation starts."""
    return copy.deepcopy(_validation_progress(trainer).state_dict())


def repeat_validation_on_resume(trainer: pl.Trainer, before: dict[str, Any]) -> None:
    """Set ``fit``'s validation counters so that a checkpoint saved now makes the resumed run repeat this validation.

    ``before`` is :func:`validation_progress_state` at the start of the validation. The counters become those of a
    validation that started its first batch and completed none: Lightning's restart then runs the validation loop
    again from its first batch (>= 2.5: "restarted mid-evaluation"; 2.4 runs a due validation on every restart),
    before the next training batch.
    """
    state = {
        "total": dict(before["total"]),
        "current": {k: 0 if isinstance(v, int) else v for k, v in before["current"].items()},
        **{k: v for k, v in before.items() if k not in ("total", "current")},
    }
    state["total"]["ready"] = state["total"]["completed"] + 1
    state["total"]["started"] = state["total"]["completed"] + 1
    state["total"]["processed"] = state["total"]["completed"]
    _validation_progress(trainer).load_state_dict(state)


def validation_runs_after_this_batch(trainer: pl.Trainer) -> bool:
    """In ``on_train_batch_end``: whether ``fit`` validates after this training batch (Lightning's own decision)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(epoch_loop._should_check_val_fx(fetcher))
