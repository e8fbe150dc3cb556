"""The cross-rank agreements exact evaluation needs, run by ``SafeDDPStrategy`` on its control plane."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from .._compat.lightning import (
    RunningStage,
    move_data_to_device,
    pl,
    rank_zero_warn,
    unwrap_index_batch_sampler,
    uses_distributed_sampler,
    wrap_evaluation_dataloader_preparation,
)
from .._compat.loops import install_exact_loops
from .._compat.torch import sync_ddp_buffers
from ..errors import UnevenEvaluationError
from .logged import active_keys, add_missing_entries, merge_keys
from .sharding import BatchShardSampler, RankStridedIterable, shard_evaluation_dataloader

if TYPE_CHECKING:
    from ..control import ControlPlane

__all__ = ["PREDICTIONS_ON", "ExactEvaluation", "interleave_batches", "sync_buffers_before_evaluation"]

#: Where ``trainer.predict`` returns the predictions of all ranks.
PREDICTIONS_ON = frozenset({"global_zero", "all"})


def interleave_batches(per_rank: Sequence[Sequence[Any]]) -> list[Any]:
    """Undo the round-robin dealing of batches: batch ``i`` of the whole run is ``per_rank[i % W][i // W]``.

    Args:
        per_rank: each rank's batches (or batch outputs), in the order that rank ran them.

    Returns:
        All batches in the order one device would have run them.

    Raises:
        ValueError: the shares do not come from round-robin dealing (a later rank holds more than an earlier one).

    Example:
        Five batches dealt to two ranks (rank 0 ran batches 0, 2, 4; rank 1 ran 1, 3):

        >>> interleave_batches([["b0", "b2", "b4"], ["b1", "b3"]])
        ['b0', 'b1', 'b2', 'b3', 'b4']

    """
    world = len(per_rank)
    lengths = [len(share) for share in per_rank]
    if any(lengths[r] < lengths[r + 1] for r in range(world - 1)) or (lengths and lengths[0] - lengths[-1] > 1):
        raise ValueError(f"Batch counts per rank {lengths} are not a round-robin deal.")
    total = sum(lengths)
    return [per_rank[i % world][i // world] for i in range(total)]


def sync_buffers_before_evaluation(model: object) -> None:
    """Do, on every rank at once, the buffer broadcast DDP would do in its first evaluation forward.

    Evaluation steps then bypass the DDP wrapper, whose first forward would broadcast buffers: a hidden collective
    that a rank with fewer (or no) steps would miss.

    Args:
        model: the strategy's model; anything but a ``DistributedDataParallel`` is left alone.

    """
    if not isinstance(model, DistributedDataParallel):
        return
    sync_ddp_buffers(model)
    model.require_forward_param_sync = False  # as after DDP's own forward without gradients


class ExactEvaluation:
    """Exact-evaluation state of one strategy: step-count agreement, logged-key agreement, prediction gathering.

    Args:
        control: a callable returning the strategy's control plane (``None`` outside a run).
        predictions_on: ``"global_zero"``: ``trainer.predict`` returns every rank's predictions, in dataset
            order, on global rank 0 (other ranks get their own share); ``"all"``: on every rank.

    """

    def __init__(self, control: Callable[[], ControlPlane | None], *, predictions_on: str = "global_zero") -> None:
        if predictions_on not in PREDICTIONS_ON:
            raise ValueError(f"`predictions_on` must be one of {sorted(PREDICTIONS_ON)}, got {predictions_on!r}.")
        self._control = control
        self.predictions_on: Literal["global_zero", "all"] = predictions_on  # type: ignore[assignment]
        #: Batches per dataloader on each rank in the current evaluation loop.
        self.batches_per_rank: list[list[float]] = []
        self._in_step: str | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ installation
    def install(self, trainer: pl.Trainer) -> bool:
        """Switch ``trainer`` to exact evaluation: its loops, and how its evaluation dataloaders are prepared.

        Returns:
            ``False`` (with a warning, nothing changed) when one of the Trainer's loops is a customised class.

        """
        custom = install_exact_loops(trainer)
        if custom:
            rank_zero_warn(
                f"ddp_strategy: exact evaluation is off because these Trainer loops are customised: {custom}. "
                "Evaluation uses Lightning's padded DistributedSampler (samples may be counted twice)."
            )
            return False

        def prepare_dataloader(prepare: Callable[..., object], dataloader: object, shuffle: bool, mode: Any) -> object:
            if (
                mode == RunningStage.TRAINING
                or getattr(trainer.strategy, "exact_evaluation_coordinator", None) is not self
                or not uses_distributed_sampler(trainer)  # the user shards by themselves
            ):
                return prepare(dataloader, shuffle, mode)
            result = shard_evaluation_dataloader(
                dataloader,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                predicting=mode == RunningStage.PREDICTING,
                name=f"{mode.dataloader_prefix}_dataloader",
                seed=int(os.getenv("PL_GLOBAL_SEED", "0")),
            )
            if result.warning is not None and result.warning not in self._warned:
                self._warned.add(result.warning)
                rank_zero_warn(result.warning)
            return result.dataloader if result.sharded else prepare(dataloader, shuffle, mode)

        wrap_evaluation_dataloader_preparation(trainer, prepare_dataloader, marker="__ddp_strategy__")
        return True

    # ------------------------------------------------------------------ step counts
    def on_loop_start(self, max_batches: Sequence[int | float]) -> None:
        """Learn every rank's batch counts (one small gather) so per-step collectives can be checked."""
        control = self._control()
        if control is None:
            self.batches_per_rank = []
            return
        counts = [float(count) for count in max_batches]
        self.batches_per_rank = control.all_gather_object(counts, name="exact-eval:batch-counts")

    def any_rank_has_batches(self, dataloaders: Sequence[object]) -> bool:
        """Whether any rank has a batch in these (sharded) dataloaders, decided the same way on every rank.

        A :class:`BatchShardSampler` knows the whole run's batch count, so no communication is needed; an iterable
        shard's length is unknown, so it counts as having batches.
        """
        for dataloader in dataloaders:
            if isinstance(getattr(dataloader, "dataset", None), RankStridedIterable):
                return True
            shard = unwrap_index_batch_sampler(getattr(dataloader, "batch_sampler", None))
            if isinstance(shard, BatchShardSampler) and (shard.global_batches or 0) > 0:
                return True
        return False

    @property
    def steps_uneven(self) -> bool:
        """Whether ranks take different numbers of evaluation steps (or a count is unknown) in this loop."""
        if not self.batches_per_rank:
            return False
        totals = [sum(counts) for counts in self.batches_per_rank]
        return any(math.isinf(total) for total in totals) or len(set(totals)) > 1

    def dataloaders_with_batches(self, seen: dict[int, int], num_dataloaders: int) -> list[int]:
        """Indices of the dataloaders in which at least one rank ran a batch (one small gather).

        Args:
            seen: this rank's number of batches run per dataloader index.
            num_dataloaders: how many dataloaders the loop has.

        """
        control = self._control()
        mine = [int(seen.get(i, 0)) for i in range(num_dataloaders)]
        if control is None:
            return [i for i, count in enumerate(mine) if count > 0]
        everyone = control.all_gather_object(mine, name="exact-eval:batches-run")
        return [i for i in range(num_dataloaders) if any(counts[i] > 0 for counts in everyone)]

    @contextmanager
    def step(self, hook: str) -> Iterator[None]:
        """Mark the body as an evaluation step (``validation_step``/``test_step``/``predict_step``)."""
        self._in_step, previous = hook, self._in_step
        try:
            yield
        finally:
            self._in_step = previous

    def check_collective(self, what: str) -> None:
        """Raise before a data-plane collective that would deadlock inside an uneven evaluation step.

        Raises:
            UnevenEvaluationError: called inside an evaluation step while ranks take different step counts.

        """
        if self._in_step is None or not self.steps_uneven:
            return
        counts = ", ".join(
            f"rank {rank}: {'unknown' if math.isinf(sum(c)) else int(sum(c))}"
            for rank, c in enumerate(self.batches_per_rank)
        )
        raise UnevenEvaluationError(
            f"{what} was called inside `{self._in_step}`, but with exact evaluation the ranks run different numbers "
            f"of steps ({counts}), so a per-step collective would wait forever on the ranks that finished. "
            "Log epoch values instead: `self.log(name, value, on_step=False, on_epoch=True, sync_dist=True)` gives "
            "the sample-weighted mean over all ranks, or log a torchmetrics Metric; for a per-rank step value use "
            "`sync_dist=False`."
        )

    # ------------------------------------------------------------------ logged values
    def agree_on_logged_keys(self, results: dict[str, Any], trainer: pl.Trainer) -> None:
        """Make every rank hold the same logged entries, in the same order, before epoch values are computed."""
        control = self._control()
        if control is None:
            return
        mine = active_keys(results, dataloader_idx=getattr(results, "dataloader_idx", None))
        everyone = control.all_gather_object(mine, name="exact-eval:logged-keys")
        if all(keys == mine for keys in everyone):
            return
        module = trainer.lightning_module
        add_missing_entries(
            results,
            merge_keys(everyone),
            module=module,
            sync_fn=trainer.strategy.reduce,
            device=trainer.strategy.root_device,
        )

    # ------------------------------------------------------------------ predictions
    def gather_predictions(self, results: Any, *, num_dataloaders: int) -> Any:
        """Every rank's predictions in dataset order, on rank 0 (or on all ranks with ``predictions_on="all"``)."""
        control = self._control()
        if control is None:
            return results
        shares = [results] if num_dataloaders == 1 else list(results)
        shares = move_data_to_device(shares, torch.device("cpu"))
        if self.predictions_on == "all":
            gathered: list[Any] | None = control.all_gather_object(shares, name="exact-eval:predictions")
        else:
            gathered = control.gather_object(shares, name="exact-eval:predictions")
        if gathered is None:  # not the destination rank: keep this rank's own share
            return results
        ordered = [interleave_batches([rank_shares[i] for rank_shares in gathered]) for i in range(num_dataloaders)]
        return ordered[0] if num_dataloaders == 1 else ordered
