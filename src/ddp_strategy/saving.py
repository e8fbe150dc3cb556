"""``CheckpointSaving``: the strategy's collective saves, synchronous or through the asynchronous writer.

Every rank takes part in a save: the RNG states (and weight fingerprints) of all ranks go to the writers (rank 0,
or every node's local rank 0), which write, or hand a snapshot to the background writer; all ranks agree on the
outcome (:func:`ddp_strategy.checkpoint.protocol.save`). Outside a run a save still is collective, through a control
plane built for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ._compat.lightning import CheckpointPath, pl, trainer_of
from .bucket_layout import BucketLayoutKeeper
from .checkpoint import protocol
from .checkpoint.async_writer import AsyncCheckpointWriter
from .checkpoint.keys import BUCKET_LAYOUT_KEY, NO_RNG_REASON_KEY, PACKAGE_KEY, package_state
from .checkpoint.overlap import deferrable_tensors, install_snapshot_gate
from .control import ControlPlane, RankFailure, also_failed, create_after_barrier, first_failure
from .errors import CheckpointWriteError
from .host import StrategyHost
from .lifecycle import RunLifecycle
from .options import StrategyOptions
from .positions import call_site
from .weight_checks import WeightChecks

__all__ = ["CheckpointSaving"]

log = logging.getLogger(__name__)

_NO_TRAINING_RANKS = (
    "by a process that was not one of the training ranks (the spawn launcher's main process after the run, "
    "or before any stage started): the ranks' RNG states were gone"
)


class CheckpointSaving:
    """Collective saves and removals of checkpoints, and rank 0's asynchronous writer (``async_save``).

    Args:
        strategy: the strategy saving (its checkpoint IO, ranks, model and Trainer are read when saving).
        options: the strategy's options (``async_save``, ``async_snapshot``, ``save_on``, ``barrier_timeout``).
        lifecycle: the stage's control plane, and whether the stage failed.
        weight_checks: the ranks' weights are compared before each save.
        bucket_layout: DDP's gradient-bucket layout, saved in every checkpoint.

    """

    def __init__(
        self,
        strategy: StrategyHost,
        options: StrategyOptions,
        lifecycle: RunLifecycle,
        weight_checks: WeightChecks,
        bucket_layout: BucketLayoutKeeper,
    ) -> None:
        self._strategy = strategy
        self._options = options
        self._lifecycle = lifecycle
        self._weight_checks = weight_checks
        self._bucket_layout = bucket_layout
        #: Rank 0's background writer when ``async_save``, from the first save on.
        self.writer: AsyncCheckpointWriter | None = None
        #: Asynchronous saves on this rank whose snapshot overlapped training (``async_snapshot="overlap"``).
        self.overlapped_saves = 0

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes checkpoints (global rank 0, or with ``save_on="node_zero"`` local rank 0)."""
        strategy = self._strategy
        return strategy.local_rank == 0 if self._options.save_on == "node_zero" else strategy.is_global_zero

    def setup(self, trainer: pl.Trainer) -> None:
        """At the strategy's ``setup``: with overlapped asynchronous saves, make hooks wait for a pending snapshot."""
        if self._options.async_save and self._options.overlap_snapshots:
            install_snapshot_gate(trainer, self.wait_for_snapshot)

    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: CheckpointPath,
        storage_options: Any | None,
        write_alone: Callable[[dict[str, Any], CheckpointPath, Any | None], None],
    ) -> None:
        """Save ``checkpoint`` collectively, in a stage or outside one; every rank learns the outcome.

        Args:
            checkpoint: the Trainer's checkpoint.
            filepath: where to write it.
            storage_options: passed to the checkpoint IO.
            write_alone: Lightning's save, for a process without a process group (rank 0 writes alone).

        Raises:
            CheckpointWriteError: on every rank when the write failed; the previous checkpoint is intact.
            RankDivergenceError: on every rank when the ranks' weights differ; nothing was written.

        """
        control = self._lifecycle.control
        if control is None:
            self._save_outside_a_run(checkpoint, filepath, storage_options, write_alone)
            return
        self._collective_save(control, checkpoint, filepath, storage_options, asynchronous=self._options.async_save)

    def remove(self, filepath: CheckpointPath) -> None:
        """Remove a checkpoint on each writer; with ``async_save``, only after the write in flight has succeeded."""
        if not self.is_writer:
            return
        if self.writer is not None:
            self.writer.remove_checkpoint(str(filepath))
        else:
            self._strategy.checkpoint_io.remove_checkpoint(filepath)

    def wait_for_snapshot(self) -> None:
        """Block until the overlapped snapshot of the last asynchronous save is copied (weights may change after)."""
        if self.writer is not None:
            self.writer.wait_for_snapshot()

    def closure_waiting_for_snapshot(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (the optimizer step's forward and backward), waiting after it for a pending snapshot.

        The wait is installed whenever a writer exists, also when nothing is pending yet: a save made inside
        ``training_step`` starts its copy during the closure. Without a writer, ``closure`` itself.
        """
        writer = self.writer
        if writer is None:
            return closure

        def closure_then_wait_for_snapshot() -> Any:
            result = closure()  # forward and backward ran beside the copy; the update after it must not
            writer.wait_for_snapshot()
            return result

        return closure_then_wait_for_snapshot

    def wait_before_reading(self) -> None:
        """Before a checkpoint is read: wait for the write in flight (never read a file still being written).

        Raises:
            CheckpointWriteError: the earlier asynchronous write failed.

        """
        if self.writer is not None:
            error = self.writer.wait()
            if error is not None:
                raise CheckpointWriteError(f"An earlier asynchronous checkpoint write failed: {error}", path="")

    def finish_async_writes(self) -> None:
        """Wait for the last asynchronous write of every writer and make every rank agree on its outcome.

        Raises:
            CheckpointWriteError: on every rank, when the last write of a writer failed (in a stage that did not
                fail already; otherwise the failure is logged).

        """
        if not self._options.async_save:
            return
        writer, self.writer = self.writer, None
        if writer is not None:
            self.overlapped_saves += writer.overlapped_submissions

        def last_write() -> None:
            error = writer.wait() if writer is not None else None
            if error is not None:
                raise CheckpointWriteError(error, path="")

        def last_write_error(failed: list[RankFailure]) -> BaseException:
            first = failed[0]
            return CheckpointWriteError(
                f"The last asynchronous checkpoint write of rank {first.rank} failed: {first.message}"
                f"{also_failed(failed)}",
                path="",
            )

        control = self._lifecycle.control
        if control is None or self._lifecycle.failed:
            try:
                last_write()
            except CheckpointWriteError as err:
                log.warning(
                    "ddp_strategy: the last asynchronous checkpoint write of rank %d failed: %s",
                    self._strategy.global_rank,
                    err,
                )
            return
        try:
            control.agree("checkpoint-async-final", last_write, first_failure(last_write_error))
        except CheckpointWriteError:
            self._lifecycle.failed = True
            raise

    def layout_entry(self) -> dict[str, Any]:
        """The checkpoint section's entry of DDP's gradient-bucket layout (empty before the layout is known)."""
        layout = self._bucket_layout.state()
        return {BUCKET_LAYOUT_KEY: layout} if layout is not None else {}

    def _save_outside_a_run(
        self,
        checkpoint: dict[str, Any],
        filepath: CheckpointPath,
        storage_options: Any | None,
        write_alone: Callable[[dict[str, Any], CheckpointPath, Any | None], None],
    ) -> None:
        """``trainer.save_checkpoint`` before a stage starts or after it returned (the control plane is closed).

        The default process group lives until the processes exit, so the save is still collective, through a
        control plane built for it: the file holds every rank's RNG state and resumes bit-exactly. Every rank must
        call ``trainer.save_checkpoint`` (as Lightning documents); a rank that does not is named after
        ``barrier_timeout``. Without a process group (the spawn launcher's main process after ``fit``) rank 0
        writes alone, and the file records why it holds no RNG states.
        """
        if dist.is_available() and dist.is_initialized():
            name = f"trainer.save_checkpoint('{os.path.basename(str(filepath))}') outside a run"
            timeout = self._options.barrier_timeout
            control = create_after_barrier(timeout=timeout, name=name, site=call_site())
            saved = False
            try:
                self._collective_save(control, checkpoint, filepath, storage_options, asynchronous=False)
                saved = True
            finally:
                control.close(graceful=saved)
            return
        section = {**package_state(checkpoint), **self.layout_entry(), NO_RNG_REASON_KEY: _NO_TRAINING_RANKS}
        write_alone({**checkpoint, PACKAGE_KEY: section}, filepath, storage_options)

    def _collective_save(
        self,
        control: ControlPlane,
        checkpoint: dict[str, Any],
        filepath: CheckpointPath,
        storage_options: Any | None,
        *,
        asynchronous: bool,
    ) -> None:
        strategy = self._strategy
        trainer: pl.Trainer | None = trainer_of(strategy.lightning_module)

        def write(final: dict[str, Any]) -> None:
            if not asynchronous:
                strategy.checkpoint_io.save_checkpoint(final, filepath, storage_options=storage_options)
                return
            if self.writer is None:
                self.writer = AsyncCheckpointWriter(strategy.checkpoint_io)
            overlap = self._options.overlap_snapshots
            deferred = deferrable_tensors(trainer) if trainer is not None and overlap else None
            previous = self.writer.submit(final, str(filepath), storage_options, deferred=deferred)
            if previous is not None:
                raise CheckpointWriteError(
                    f"An earlier asynchronous checkpoint write failed: {previous}", path=str(filepath)
                )

        step = trainer.global_step if trainer is not None else int(checkpoint.get("global_step", 0))
        weights = self._weight_checks.comparison(
            strategy.model, when=f"by step {step}", name=f"checkpoint-weights:{os.path.basename(str(filepath))}"
        )
        protocol.save(
            control=control,
            write=write,
            checkpoint=checkpoint,
            path=str(filepath),
            is_writer=self.is_writer,
            every_writer_needs_states=self._options.save_on == "node_zero",
            weights=weights,
            section={**package_state(checkpoint), **self.layout_entry()},  # with what callbacks added there
        )
        if weights is not None:
            self._weight_checks.agreed_at(step)  # the ranks agreed at this step: the epoch-end check need not repeat
