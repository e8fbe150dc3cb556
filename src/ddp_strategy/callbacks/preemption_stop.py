"""``PreemptionStop``: the training-loop side of :mod:`ddp_strategy.preemption`, added by ``SafeDDPStrategy``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from .._compat.lightning import Callback, last_checkpoint_path, pl
from ..control import ControlPlane
from ..preemption import KEYS as PREEMPTION_KEYS
from ..preemption import Preempted, PreemptionAgreement, stop_message

__all__ = ["PreemptionStop"]

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
