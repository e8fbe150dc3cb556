"""``ExactResume``: loading a checkpoint on every rank, and resuming training exactly where it was saved.

Every rank resumes from the checkpoint rank 0 chose; rank 0 verifies it (with the ``last`` fallback) and sends it to
ranks that cannot read it. On resume, the training dataloader gets the saved epoch's sampler epoch, skips the
batches a step checkpoint had consumed, and the RNG states are restored right before the uninterrupted run drew
from them (the first training iterator, or the first batch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._compat.lightning import (
    LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH,
    CheckpointPath,
    count_checkpointed_batch_as_completed,
    epochs_processed,
    pl,
    rank_zero_warn,
    reseed_as_fit_does,
    restore_before_second_train_iterator,
    restore_when_the_epoch_loop_starts,
    route_resume_path,
    set_sampler_epoch,
)
from .bucket_layout import BucketLayoutKeeper
from .checkpoint import protocol
from .checkpoint.keys import PACKAGE_KEY, RNG_AT_VALIDATION_START_KEY, package_state
from .control import ControlPlane, from_rank
from .errors import CheckpointMismatchError
from .host import StrategyHost
from .sampling import skip_consumed_batches

__all__ = ["ExactResume", "ResumeState"]

log = logging.getLogger(__name__)


def _persistent_workers(dataloader: object) -> bool:
    """A DataLoader whose worker processes (and iterator) live across epochs: it draws no new seed per epoch."""
    return bool(getattr(dataloader, "persistent_workers", False)) and getattr(dataloader, "num_workers", 0) > 0


@dataclass(frozen=True)
class ResumeState:
    """What the training loop still needs from the checkpoint being resumed, until its RNG states are restored."""

    #: The checkpoint's section of this package (RNG states, world size, ...).
    package: Any
    #: The checkpoint's ``global_step`` (reseeds every rank when the world size changed).
    global_step: int
    #: Batches of an unfinished epoch the checkpoint had consumed (0 at an epoch boundary).
    skip_batches: int
    #: Epochs the fit loop counts only after the dataloader was made (Lightning >= 2.5, saved after an epoch's last
    #: batch: it resumes with the next epoch).
    epochs_ahead: int
    #: Lightning 2.4, saved after an epoch's last batch: it re-enters that epoch and ends it without a batch; the RNG
    #: is restored when its epoch loop starts.
    restore_at_next_epoch: bool
    #: Saved before ``fit`` trained (the uninterrupted fit re-seeded at its set-up).
    before_training: bool
    #: Saved during a validation (a preemption stop): its RNG states are that validation's start's.
    rng_at_validation_start: bool = False

    @classmethod
    def of(cls, checkpoint: dict[str, Any]) -> ResumeState:
        """The resume state of a loaded checkpoint."""
        after_last_batch = protocol.saved_after_last_batch(checkpoint)
        return cls(
            package=checkpoint.get(PACKAGE_KEY),
            global_step=checkpoint.get("global_step", 0),
            skip_batches=protocol.batches_done_mid_epoch(
                checkpoint, last_batch_ends_epoch=LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH
            ),
            epochs_ahead=int(LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH and after_last_batch),
            restore_at_next_epoch=not LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH and after_last_batch,
            before_training=protocol.saved_before_training(checkpoint),
            rng_at_validation_start=bool(package_state(checkpoint).get(RNG_AT_VALIDATION_START_KEY, False)),
        )


class ExactResume:
    """The agreed resume path, the collective load, and the resume bookkeeping of the training loop.

    Args:
        strategy: the strategy loading (its checkpoint IO, device and ranks are read when loading).
        control: returns the strategy's control plane (``None`` outside a run: a plain local load).
        bucket_layout: DDP's gradient-bucket layout, taken from the checkpoint for the resumed wrapper.
        before_reading: waits for an asynchronous write in flight (a file still being written is never read).

    """

    def __init__(
        self,
        strategy: StrategyHost,
        control: Callable[[], ControlPlane | None],
        bucket_layout: BucketLayoutKeeper,
        before_reading: Callable[[], None],
    ) -> None:
        self._strategy = strategy
        self._control = control
        self._bucket_layout = bucket_layout
        self._before_reading = before_reading
        #: The checkpoint being resumed, until its RNG states are restored.
        self.state: ResumeState | None = None
        #: The file the ranks agreed to load (named in errors about its keys).
        self.loaded_path = "the checkpoint"

    def agree_on_path(self, trainer: pl.Trainer | None) -> None:
        """Make every rank resume from the checkpoint path rank 0 chose.

        Lightning resolves ``ckpt_path="last"`` on every rank separately, before any strategy code runs; a node that
        does not see rank 0's checkpoint directory resolves nothing and would silently start from scratch while the
        others resume. Lightning offers no hook between that resolution and the restore, so the seam routes the
        Trainer's restore through :meth:`path_of_rank_zero`.
        """
        if trainer is not None:
            route_resume_path(trainer, self.path_of_rank_zero, marker="__ddp_strategy__")

    def path_of_rank_zero(self, mine: str | None) -> str | None:
        """Rank 0's resolved checkpoint path, on every rank (a rank that resolved another one says so)."""
        control = self._control()
        if control is None:
            return mine
        agreed = control.agree("resume-path", mine, from_rank(0))
        if mine != agreed:
            log.warning(
                "ddp_strategy: rank %d resolved the checkpoint to resume as %r; using rank 0's %r so that every "
                "rank resumes from the same one.",
                self._strategy.global_rank,
                mine,
                agreed,
            )
        return agreed

    def load(self, checkpoint_path: CheckpointPath, weights_only: bool | None) -> dict[str, Any]:
        """Rank 0 verifies (and for ``last`` falls back), every rank loads the agreed file onto its own device.

        Raises:
            FileNotFoundError: the checkpoint does not exist.
            CheckpointIntegrityError: the checkpoint is damaged and no fallback applies.
            UnsafeCheckpointError: the checkpoint carries pickled objects and ``weights_only=False`` was not given.
            CheckpointWriteError: an earlier asynchronous write of it failed.

        """
        torch.cuda.empty_cache()
        self._before_reading()
        strategy = self._strategy

        def read(path: str) -> dict[str, Any]:
            return strategy.checkpoint_io.load_checkpoint(  # type: ignore[no-any-return]
                path, map_location=strategy.root_device, weights_only=weights_only
            )

        control = self._control()
        if control is None:
            checkpoint = read(str(checkpoint_path))
            self._bucket_layout.resume_from(checkpoint.get(PACKAGE_KEY))
            return checkpoint
        chosen, checkpoint = protocol.load(control=control, read=read, path=str(checkpoint_path))
        self._bucket_layout.resume_from(checkpoint.get(PACKAGE_KEY))
        protocol.check_resumable(checkpoint, chosen)
        self.loaded_path = chosen
        self.state = ResumeState.of(checkpoint)
        return checkpoint

    def explain_model_keys(self, error: RuntimeError, checkpoint: Mapping[str, Any], module: Any) -> None:
        """After torch's strict-loading error: raise one that lists the differing keys and says what to do.

        Returns (the caller re-raises ``error``) when ``error`` is no such error or the keys do not explain it.

        Raises:
            CheckpointMismatchError: the checkpoint's model keys differ from the module's.

        """
        if module is None or "Error(s) in loading state_dict" not in str(error):
            return
        try:
            protocol.check_model_keys(
                dict(checkpoint), list(module.state_dict()), self.loaded_path, type(module).__name__
            )
        except CheckpointMismatchError as mismatch:
            raise mismatch from error

    def training_dataloader(self, dataloader: object, trainer: pl.Trainer) -> object:
        """The training dataloader Lightning just made, set up to continue the saved run.

        Lightning creates the first training iterator of a run before ``on_train_epoch_start`` sets the sampler
        epoch, so a resumed run would shuffle (and, with workers, prefetch) with epoch 0's order. The epoch is set
        now, and the RNG state restored right before that iterator draws its seed, as the uninterrupted run did.
        Mid-epoch, the batches already trained on are skipped.
        """
        state = self.state
        epoch = epochs_processed(trainer)
        if state is not None:  # the fit loop's reset, after this, counts an epoch ended by the saved batch
            epoch += state.epochs_ahead
        set_sampler_epoch(dataloader, epoch)
        if state is None:
            return dataloader
        skip = state.skip_batches
        if skip:  # resumed mid-epoch: continue after the batches already trained on; RNG at the first batch
            count_checkpointed_batch_as_completed(trainer)
            resumed = skip_consumed_batches(dataloader, skip, epoch)
            if resumed is not None and state.restore_at_next_epoch:
                restore_when_the_epoch_loop_starts(trainer, self.restore_rng)
            if resumed is None:
                rank_zero_warn(
                    f"ddp_strategy: resuming in the middle of an epoch ({skip} batches done), but the training "
                    f"dataloader ({type(dataloader).__name__}) has no standard BatchSampler to skip them with, so "
                    "this epoch starts over from its first batch. Checkpoint at epoch ends for exact resumption."
                )
            return resumed if resumed is not None else dataloader
        # Persistent workers: the uninterrupted run drew no seed here (restore at the first batch), unless it was
        # saved before fit, whose first iterator the uninterrupted run created here too.
        fresh_iterator = state.before_training or not _persistent_workers(dataloader)
        if fresh_iterator and not restore_before_second_train_iterator(trainer, self.restore_rng):
            self.restore_rng()
        return dataloader

    def at_validation_start(self) -> None:
        """In ``fit``, as a validation starts (not the sanity check): restore the checkpoint's RNG states now.

        Only for a checkpoint saved during a validation: its RNG states are that validation's start's, and the
        resumed run repeats that validation first.
        """
        if self.state is not None and self.state.rng_at_validation_start:
            self.restore_rng()

    def restore_rng(self) -> None:
        """Restore this rank's RNG states from the checkpoint being resumed, once (nothing when none is pending)."""
        state = self.state
        if state is None:
            return
        strategy = self._strategy
        saved = {PACKAGE_KEY: state.package, "global_step": state.global_step}
        warning = protocol.restore_rng(saved, rank=strategy.global_rank, world_size=strategy.world_size)
        if state.before_training:  # saved before fit: the uninterrupted fit re-seeded at its set-up
            reseed_as_fit_does()
        self.state = None
        if warning is not None:
            rank_zero_warn(warning)
