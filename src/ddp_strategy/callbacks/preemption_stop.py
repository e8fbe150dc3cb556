"""``PreemptionStop``: the training-loop side of :mod:`ddp_strategy.preemption`, added by ``SafeDDPStrategy``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from .._compat.lightning import Callback, TrainerFn, add_callback, last_checkpoint_path, pl
from .._compat.signals import handle_signals_during_run
from ..control import ControlPlane, scaled_interval
from ..options import StrategyOptions
from ..preemption import KEYS as PREEMPTION_KEYS
from ..preemption import NoticeWatch, Preempted, PreemptionAgreement, stop_message

__all__ = ["PreemptionHandling", "PreemptionStop"]

log = logging.getLogger(__name__)


class PreemptionStop(Callback):
    """Stop every rank at the agreed step after a preemption signal, with one collective checkpoint.

    Added by :class:`~ddp_strategy.SafeDDPStrategy` for ``fit`` (see its ``preemption_signals``); not meant to be
    added by hand. At every training batch end at which ``global_step`` moved (an optimizer-step boundary) it
    advances the agreement; at the agreed step every rank saves through ``trainer.save_checkpoint`` (a collective
    save, with every rank's RNG state and the position in the epoch) and raises :class:`~ddp_strategy.Preempted`.
    A signal that came after the last step boundary is agreed on at ``on_train_end`` (one control-plane gather).

    Args:
        agreement: this rank's :class:`~ddp_strategy.preemption.PreemptionAgreement`.
        control: returns the strategy's control plane (``None`` outside a run).
        finish_writes: waits for an asynchronous checkpoint write in flight and agrees on its outcome.

    """

    def __init__(
        self,
        agreement: PreemptionAgreement,
        control: Callable[[], ControlPlane | None],
        finish_writes: Callable[[], None],
    ) -> None:
        self.agreement = agreement
        self._control = control
        self._finish_writes = finish_writes
        self._last_step: int | None = None
        #: ``(step, path)`` of the stop, once it happened.
        self.stopped: tuple[int, str | None] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        control = self._control()
        if control is not None:
            control.forget_at_close(*PREEMPTION_KEYS, shared=True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # no optimizer step in this batch (gradient accumulation): no boundary
            return
        self._last_step = step
        control = self._control()
        if control is None:
            return
        if self.agreement.at_step_boundary(control.store, step):
            self._stop(trainer, step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        control = self._control()
        if control is None or self.stopped is not None:
            return
        requested = control.all_gather_object(self.agreement.requested, name="preemption:train-end")
        if any(requested):  # a signal after the last step boundary (or during the last validation)
            self.agreement.learn(control.store)
            self._stop(trainer, trainer.global_step)
        self._end_watch(control, wake_all=trainer.is_global_zero)  # every rank is past its last step boundary

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

    def _stop(self, trainer: pl.Trainer, step: int) -> None:
        path, found_by_last = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self._finish_writes()
        self.stopped = (step, path)
        message = stop_message(
            self.agreement, step=step, path=path, resume='"last"' if found_by_last else repr(path),
            world_size=trainer.world_size,
        )  # fmt: skip
        log.warning(message)
        raise Preempted(
            message, signal_name=self.agreement.signal_name(), code=self.agreement.exit_code(), step=step, path=path
        )


class PreemptionHandling:
    """The strategy's side of preemption: for each ``fit``, a :class:`PreemptionStop` and the signals routed to it.

    Args:
        options: the strategy's options (``preemption_signals``: none leaves signals to Lightning;
            ``heartbeat_interval``: the agreement looks at the store as often).
        control: returns the strategy's control plane (``None`` outside a run).
        finish_writes: waits for an asynchronous checkpoint write in flight and agrees on its outcome.

    """

    def __init__(
        self,
        options: StrategyOptions,
        control: Callable[[], ControlPlane | None],
        finish_writes: Callable[[], None],
    ) -> None:
        self.signals = options.preemption_signals
        self._heartbeat_interval = options.heartbeat_interval
        self._control = control
        self._finish_writes = finish_writes
        self._rank = 0
        #: The stop callback of the current ``fit``; ``None`` in other stages or without preemption signals.
        self.stop: PreemptionStop | None = None

    def setup(self, trainer: pl.Trainer, *, rank: int, world_size: int) -> None:
        """At the strategy's ``setup``: for ``fit``, take the signals from Lightning's handlers and add the stop."""
        self.stop = None
        self._rank = rank
        if not self.signals or trainer.state.fn != TrainerFn.FITTING:
            return
        poll = scaled_interval(self._heartbeat_interval or 1.0, world_size)  # flat store load at any size
        control = self._control()
        # one blocked store wait per rank learns of a signal on any rank (no polling; see preemption.NoticeWatch)
        watch = None
        if control is not None and world_size > 1:
            watch = NoticeWatch(control.connect(), rank=rank, waker=control.store)
        agreement = PreemptionAgreement(rank=rank, world_size=world_size, poll_interval=poll, watch=watch)
        self.stop = PreemptionStop(agreement, self._control, self._finish_writes)
        add_callback(trainer, self.stop, replace=PreemptionStop)
        handle_signals_during_run(trainer, self.signals, agreement.request, self.deliver_unused_signal)

    def deliver_unused_signal(self) -> None:
        """After the run's handlers were restored: a signal that led to no stop is delivered again, as if unhandled.

        That is a signal that came after the ranks' last agreement (between ``on_train_end`` and the end of
        ``fit``) or on a rank that failed for another reason: the process's own handling applies (by default it
        ends the process).
        """
        stop = self.stop
        if stop is None or stop.stopped is not None or stop.agreement.received is None:
            return
        received = stop.agreement.received
        log.warning(
            "ddp_strategy: rank %d received %s after the ranks' last chance to agree on a stop; delivering it again "
            "now that fit has ended.",
            self._rank,
            received.name,
        )
        os.kill(os.getpid(), received)
