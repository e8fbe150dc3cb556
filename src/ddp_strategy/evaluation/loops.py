"""Lightning's evaluation and prediction loops, taught that a rank may have no batch while others have some.

Stock loops skip evaluation on a rank whose dataloaders are empty, which is right on one device and a deadlock
with exact sharding: that rank would miss the epoch-end hooks and metric syncs the other ranks run. These
subclasses skip only when *no* rank has a batch, and call :class:`~ddp_strategy.evaluation.coordinator.
ExactEvaluation` at the points where ranks must agree. They are installed on a Trainer's own loop objects by
:func:`install_exact_loops`; everything else is the stock loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from ddp_strategy.evaluation.sharding import BatchShardSampler, RankStridedIterable

if TYPE_CHECKING:
    from ddp_strategy.evaluation.coordinator import ExactEvaluation

__all__ = ["ExactEvaluationLoop", "ExactPredictionLoop", "install_exact_loops"]


def _coordinator(trainer: pl.Trainer) -> ExactEvaluation | None:
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


def _someone_has_batches(loop: _EvaluationLoop | _PredictionLoop) -> bool:
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
    for dataloader in combined.flattened:
        if isinstance(getattr(dataloader, "dataset", None), RankStridedIterable):
            return True
        shard = getattr(dataloader, "batch_sampler", None)
        shard = getattr(shard, "_batch_sampler", shard)  # Lightning's predict index wrapper
        if isinstance(shard, BatchShardSampler) and (shard.global_batches or 0) > 0:
            return True
    return False


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
        return _coordinator(self.trainer) is None or not _someone_has_batches(self)  # type: ignore[arg-type]


class ExactEvaluationLoop(_EmptyShardMixin, _EvaluationLoop):
    """``_EvaluationLoop`` that runs (with zero batches) on ranks whose shard is empty, and agrees on metrics."""

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


class ExactPredictionLoop(_EmptyShardMixin, _PredictionLoop):
    """``_PredictionLoop`` that runs on ranks with an empty shard and returns predictions in dataset order."""

    @override
    def _on_predict_start(self) -> None:
        coordinator = _coordinator(self.trainer)
        if coordinator is not None:
            coordinator.on_loop_start(self.max_batches)
        super()._on_predict_start()

    @override
    def on_run_end(self) -> Any:
        results = super().on_run_end()
        coordinator = _coordinator(self.trainer)
        if coordinator is None or results is None:
            return results
        return coordinator.gather_predictions(results, num_dataloaders=self.num_dataloaders)


_SWAPS: tuple[tuple[type, type], ...] = ((_EvaluationLoop, ExactEvaluationLoop), (_PredictionLoop, ExactPredictionLoop))


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
