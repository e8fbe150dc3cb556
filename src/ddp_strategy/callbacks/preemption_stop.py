"""``PreemptionStop``: the loops' side of :mod:`ddp_strategy.preemption`, added by ``SafeDDPStrategy``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from typing_extensions import override

from .._compat.callback_hooks import restore_hooks, skip_hooks, skip_inherited_batch_hooks
from .._compat.lightning import (
    Callback,
    TrainerFn,
    add_callback,
    collect_rng_states,
    last_checkpoint_path,
    pl,
    set_rng_states,
)
from .._compat.loops import (
    repeat_validation_on_resume,
    validation_progress_state,
    validation_runs_after_this_batch,
)
from .._compat.signals import exit_with_code_on, handle_signals_during_run
from ..checkpoint.keys import PACKAGE_KEY, RNG_AT_VALIDATION_START_KEY
from ..control import ControlPlane
from ..options import StrategyOptions
from ..preemption import KEYS as PREEMPTION_KEYS
from ..preemption import (
    NoticeWatch,
    Position,
    Preempted,
    PreemptionAgreement,
    evaluation_position,
    stop_message,
    train_position,
    validation_position,
)
from ..store import Store

__all__ = ["PreemptionHandling", "PreemptionStop"]

log = logging.getLogger(__name__)

#: the batch index of the boundary every rank passes once its batches of a loop are done (after all batches)
_LOOP_END = 2**31 - 1
#: skipped while no rank knows of a signal: Lightning's turn of the hook costs more than its check (see on_train_start)
_TRAIN_BOUNDARY_HOOKS = ("on_train_batch_end",)
_STAGE_NAMES = {TrainerFn.VALIDATING: "validate", TrainerFn.TESTING: "test", TrainerFn.PREDICTING: "predict"}


class PreemptionStop(Callback):
    """Stop every rank at the agreed boundary after a preemption signal: with a checkpoint in ``fit``.

    Added by :class:`~ddp_strategy.SafeDDPStrategy` for each stage (see its ``preemption_signals``); not meant to be
    added by hand. Boundaries: in ``fit``, every training batch end at which ``global_step`` moved (an optimizer
    step's end) and every validation batch end (the sanity check's too); in ``validate``, ``test`` and ``predict``,
    every batch end; in every evaluation loop, the point where this rank's batches are done (ranks may hold
    different numbers of batches with exact evaluation). At the agreed boundary every rank raises
    :class:`~ddp_strategy.Preempted`, after, in ``fit``, one collective save through ``trainer.save_checkpoint``:

    * at a training step's end: the position after that step (every rank's RNG state, the place in the epoch);
    * during a validation: the training position this validation started at, with the RNG states of that moment
      and the validation marked as not done, so that the resumed run repeats it before training on;
    * in the sanity check: nothing (nothing was trained in this run).

    A signal that came after the last boundary is agreed on at the end of the stage (one control-plane gather).

    Args:
        agreement: this rank's :class:`~ddp_strategy.preemption.PreemptionAgreement`.
        control: returns the strategy's control plane (``None`` outside a run).
        finish_writes: waits for an asynchronous checkpoint write in flight and agrees on its outcome.
        stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
        at_validation_start: called as a validation inside ``fit`` starts (not the sanity check): resuming a
            checkpoint saved during a validation, it restores its RNG states there, where they were taken (the
            resumed run repeats that validation first).

    """

    def __init__(
        self,
        agreement: PreemptionAgreement,
        control: Callable[[], ControlPlane | None],
        finish_writes: Callable[[], None],
        stage: str = "fit",
        at_validation_start: Callable[[], None] | None = None,
    ) -> None:
        self.agreement = agreement
        self.stage = stage
        self._control = control
        self._finish_writes = finish_writes
        self._at_validation_start = at_validation_start
        self._last_step: int | None = None
        self._train_store: Store | None = None  # the control plane's, for the boundaries of a fit
        self._validation_start: tuple[dict[str, Any], dict[str, Any]] | None = None
        # whether the checkpoint being written holds the RNG states of a validation's start
        self._rng_of_validation_start = False
        #: ``(where, path)`` of the stop, once it happened (``path``: the checkpoint, or ``None``).
        self.stopped: tuple[str, str | None] | None = None
        skip_inherited_batch_hooks(self)  # Lightning passes over the per-batch hooks it has nothing to do in

    # ------------------------------------------------------------------ stage start and end
    def _forget_keys_at_close(self) -> None:
        control = self._control()
        if control is not None:
            control.forget_at_close(*PREEMPTION_KEYS, shared=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        control = self._control()
        self._train_store = control.store if control is not None else None  # read at every step's end
        self._forget_keys_at_close()
        # Before any signal, a training step's end has nothing to check, and Lightning's turn of the hook would cost
        # more than the check (16k of 26k instructions): it is skipped until this rank receives a signal or learns of
        # one, and the watch reads the boundary passed from global_step instead (train_position: the end of the step
        # that made it; at most one ahead of the last end passed, which the agreement allows).
        self.agreement.follow(lambda: train_position(trainer.global_step))
        skip_hooks(self, _TRAIN_BOUNDARY_HOOKS, unless_overridden_below=PreemptionStop)
        self.agreement.when_requested(self._check_train_boundaries)

    def _check_train_boundaries(self) -> None:
        """Run at every training step's end from now on (called in the signal handler or the watch thread)."""
        restore_hooks(self, _TRAIN_BOUNDARY_HOOKS)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._rng_of_validation_start:  # the resumed run restores them as the repeated validation starts
            checkpoint.setdefault(PACKAGE_KEY, {})[RNG_AT_VALIDATION_START_KEY] = True

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage != "fit":
            self._forget_keys_at_close()
        elif not trainer.sanity_checking:  # what a stop inside this validation saves
            if self._at_validation_start is not None:
                self._at_validation_start()
            self._validation_start = (validation_progress_state(trainer), collect_rng_states())

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget_keys_at_close()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget_keys_at_close()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_stage_end(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = None
        if self.stage == "validate":
            self._at_stage_end(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_stage_end(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_stage_end(trainer)

    def _at_stage_end(self, trainer: pl.Trainer) -> None:
        """Every rank is past its last boundary: stop all if any rank knows of a signal, then end the watches."""
        control = self._control()
        if control is None or self.stopped is not None:
            return
        requested = control.all_gather_object(self.agreement.requested, name=f"preemption:{self.stage}-end")
        if any(requested):  # a signal after the last boundary
            self.agreement.learn(control.store)
            if self.stage == "fit":
                self._save_and_raise(trainer, f"after step {trainer.global_step}")
            else:
                self._stop_evaluation(trainer, "after the last batch")
        self._end_watch(control, wake_all=trainer.is_global_zero)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The run ends for every rank; no watch stays blocked in a store wait until the process exits (a thread
        # woken inside torch during the interpreter's finalization can abort the process)
        self._end_watch(self._control(), wake_all=True)

    def _end_watch(self, control: ControlPlane | None, *, wake_all: bool) -> None:
        watch = self.agreement.watch
        if watch is None:
            return
        watch.close()
        if wake_all and control is not None:
            try:
                NoticeWatch.close_for_all(control.store)
            except Exception as err:  # the store's host is gone: its connection ends the watches
                log.debug("ddp_strategy: could not wake the preemption watches: %s", err)

    # ------------------------------------------------------------------ boundaries
    def _at(self, position: Position, where: str) -> bool:
        control = self._control()
        return control is not None and self.agreement.at_boundary(control.store, position, where)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # no optimizer step in this batch (gradient accumulation): no boundary
            return
        # After the hook was skipped (on_train_start), _last_step may be older than the last step end passed: this
        # end then passes that boundary again, which the agreement takes as nothing new (the watch acked at least it).
        self._last_step = step
        store = self._train_store
        if store is not None and self.agreement.at_boundary(store, train_position(step), f"step {step}"):
            if validation_runs_after_this_batch(trainer):
                # every rank stops at the validation's first boundary instead: that checkpoint makes the resumed run
                # run this validation, as the uninterrupted run does (Lightning >= 2.5 would skip it otherwise)
                return
            self._save_and_raise(trainer, f"after step {step}")

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._at_evaluation_batch(trainer, dataloader_idx, batch_idx)

    # the same boundary in every evaluation loop (Lightning's hooks share this signature)
    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end

    def on_loop_batches_done(self, trainer: pl.Trainer) -> None:
        """Called by the exact evaluation loops (``_compat.loops``) once this rank's batches of a loop are done."""
        self._at_evaluation_batch(trainer, _LOOP_END, 0)

    def _at_evaluation_batch(self, trainer: pl.Trainer, dataloader_idx: int, batch_idx: int) -> None:
        done = dataloader_idx == _LOOP_END
        of = f" of dataloader {dataloader_idx}" if dataloader_idx and not done else ""
        if self.stage == "fit":
            step, sanity = trainer.global_step, bool(trainer.sanity_checking)
            loop = "sanity-check" if sanity else "validation"
            where = f"the end of its {loop} batches" if done else f"{loop} batch {batch_idx}{of}"
            if self._at(validation_position(step, dataloader_idx, batch_idx, sanity=sanity), f"{where} at step {step}"):
                self._stop_in_validation(trainer, where, sanity=sanity)
        else:
            where = f"the end of its {self.stage} batches" if done else f"{self.stage} batch {batch_idx}{of}"
            if self._at(evaluation_position(dataloader_idx, batch_idx), where):
                self._stop_evaluation(trainer, f"at {where}")

    # ------------------------------------------------------------------ stops
    def _stop_in_validation(self, trainer: pl.Trainer, where: str, *, sanity: bool) -> NoReturn:
        step = trainer.global_step
        if sanity or self._validation_start is None:
            self._raise(
                trainer, f"at {where} (before training)",
                "wrote no checkpoint: nothing was trained in this run; run it again as it was started",
            )  # fmt: skip
        progress, rng = self._validation_start
        repeat_validation_on_resume(trainer, progress)
        set_rng_states(rng)  # the checkpoint holds each rank's RNG state as the validation started
        self._rng_of_validation_start = True  # marked in the checkpoint (on_save_checkpoint)
        self._save_and_raise(
            trainer, f"at {where} at step {step}",
            note=f" (the training position of step {step}; the resumed run repeats this validation)",
        )  # fmt: skip

    def _stop_evaluation(self, trainer: pl.Trainer, where: str) -> NoReturn:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        writers = [type(c).__name__ for c in callbacks if isinstance(c, pl.callbacks.BasePredictionWriter)]
        written = f" ({', '.join(writers)} wrote the batches before)" if writers and self.stage == "predict" else ""
        self._raise(trainer, where, f"saved nothing{written}: trainer.{self.stage} did not finish; run it again")

    def _save_and_raise(self, trainer: pl.Trainer, stopped: str, note: str = "") -> NoReturn:
        path, found_by_last = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self._finish_writes()
        resume = '"last"' if found_by_last else repr(path)
        self._raise(trainer, stopped, f"saved {path}{note}; resume with trainer.fit(..., ckpt_path={resume})", path)

    def _raise(self, trainer: pl.Trainer, stopped: str, outcome: str, path: str | None = None) -> NoReturn:
        self.stopped = (stopped, path)
        message = stop_message(self.agreement, stopped=stopped, outcome=outcome, world_size=trainer.world_size)
        log.warning(message)
        agreement, step = self.agreement, trainer.global_step if self.stage == "fit" else None
        raise Preempted(message, signal_name=agreement.signal_name(), code=agreement.exit_code(), step=step, path=path)


class PreemptionHandling:
    """The strategy's side of preemption: for each stage, a :class:`PreemptionStop` and the signals routed to it.

    Args:
        options: the strategy's options (``preemption_signals``: none leaves signals to Lightning;
            ``barrier_timeout``: how long a rank waits for the others' acknowledgements).
        control: returns the strategy's control plane (``None`` outside a run).
        finish_writes: waits for an asynchronous checkpoint write in flight and agrees on its outcome.
        at_validation_start: called as a validation inside ``fit`` starts (see :class:`PreemptionStop`).

    """

    def __init__(
        self,
        options: StrategyOptions,
        control: Callable[[], ControlPlane | None],
        finish_writes: Callable[[], None],
        at_validation_start: Callable[[], None] | None = None,
    ) -> None:
        self.signals = options.preemption_signals
        self._at_validation_start = at_validation_start
        self._timeout: timedelta = options.barrier_timeout
        self._control = control
        self._finish_writes = finish_writes
        self._rank = 0
        #: The stop callback of the current stage; ``None`` without preemption signals.
        self.stop: PreemptionStop | None = None

    def setup(self, trainer: pl.Trainer, *, rank: int, world_size: int) -> None:
        """At the strategy's ``setup``: take the signals from Lightning's handlers and add the stop callback."""
        self.stop = None
        self._rank = rank
        fn = trainer.state.fn
        stage = "fit" if fn == TrainerFn.FITTING else _STAGE_NAMES.get(fn) if fn is not None else None
        if not self.signals or stage is None:
            return
        control = self._control()
        if control is None:  # no control plane (outside a run): nothing to agree over, Lightning's handling applies
            return
        # one blocked store wait per rank learns of a signal on any rank (no polling; see preemption.NoticeWatch)
        watch = NoticeWatch(control.connect(), rank=rank, waker=control.store) if world_size > 1 else None
        start = train_position(0) if stage == "fit" else evaluation_position(0, -1)
        agreement = PreemptionAgreement(
            rank=rank, world_size=world_size, start=start, watch=watch, timeout=self._timeout.total_seconds()
        )
        self.stop = PreemptionStop(agreement, self._control, self._finish_writes, stage, self._at_validation_start)
        add_callback(trainer, self.stop, replace=PreemptionStop)
        handle_signals_during_run(trainer, self.signals, agreement.request, self.after_run)

    def after_run(self) -> None:
        """After the run's handlers were restored: a stopped rank exits with its code, an unused signal comes again.

        Without a stop, this is :meth:`deliver_unused_signal`.

        A stopped rank is on its way out with :class:`~ddp_strategy.Preempted`. Under ``torchrun`` the agent sends
        SIGTERM to the workers still running as soon as one exits; a rank still tearing down would then be reported
        as killed by the signal (exit -15) instead of stopped (143). So from here until the process ends, the
        stop's signals end it at once with the stop's own exit code (:func:`exit_with_code_on`).
        """
        stop = self.stop
        if stop is not None and stop.stopped is not None:
            exit_with_code_on(self.signals, stop.agreement.exit_code())
            return
        self.deliver_unused_signal()

    def deliver_unused_signal(self) -> None:
        """After the run's handlers were restored: a signal that led to no stop is delivered again, as if unhandled.

        That is a signal that came after the ranks' last agreement (between the end of the stage and the end of the
        run) or on a rank that failed for another reason: the process's own handling applies (by default it ends
        the process).
        """
        stop = self.stop
        if stop is None or stop.stopped is not None or stop.agreement.received is None:
            return
        received = stop.agreement.received
        log.warning(
            "ddp_strategy: rank %d received %s after the ranks' last chance to agree on a stop; delivering it again "
            "now that the run has ended.",
            self._rank,
            received.name,
        )
        os.kill(os.getpid(), received)
