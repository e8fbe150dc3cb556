"""``WeightSyncCheck``: verify during training that every rank still holds the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from torch import Tensor
from typing_extensions import override

from .._compat.callback_hooks import restore_hooks, skip_hooks, skip_inherited_batch_hooks
from .._compat.lightning import Callback, pl, rank_zero_warn
from ..consistency import WeightAgreement

__all__ = ["WeightSyncCheck"]

#: the hooks of the periodic check (``every_n_steps``)
_PERIODIC = ("on_train_batch_end",)


class WeightSyncCheck(Callback):
    """Every ``every_n_steps`` optimizer steps, compare a fingerprint of every parameter and buffer across ranks.

    DDP keeps replicas equal only if nothing changes them rank-locally; a rank-local edit, a rank-local checkpoint
    load or a buffer updated differently silently splits the model. The check exchanges two integers per tensor
    (one small gather on the control plane of :class:`~ddp_strategy.SafeDDPStrategy`); only when they differ does
    it fetch the differing tensors to report the largest difference.

    It is the "every N steps" setting of the comparison :class:`~ddp_strategy.SafeDDPStrategy` runs by default
    before every checkpoint save and at the end of every training epoch (:mod:`ddp_strategy.consistency`;
    ``SafeDDPStrategy(weight_check=N)`` adds it with the strategy's settings).

    Args:
        every_n_steps: check after every this many optimizer steps (``trainer.global_step``); ``None``: never
            during an epoch (with ``at_epoch_end``).
        on_mismatch: ``"raise"`` a :class:`~ddp_strategy.errors.RankDivergenceError` on every rank, or ``"warn"``.
        exclude: ``fnmatch`` patterns of tensor names to skip, e.g. ``("*.running_mean", "*.running_var")`` for
            BatchNorm statistics with ``broadcast_buffers=False``. With DDP's default ``broadcast_buffers=True``,
            buffers are never compared: each rank updates them with its own batch and DDP overwrites them with
            rank 0's at the next forward, so they differ at every step's end by design.
        include_optimizer_state: also compare the optimizers' state tensors (e.g. Adam moments).
        at_epoch_end: also check at the end of every training epoch (unless a check, e.g. before a checkpoint
            save, already ran at that step).
        norm_statistics: with buffers compared (``broadcast_buffers=False``), also compare the running statistics
            of BatchNorm/InstanceNorm layers (which each rank updates from its own batch unless they are
            ``SyncBatchNorm``).

    Raises:
        ValueError: ``every_n_steps`` is not a positive integer or ``None``, or ``on_mismatch`` is unknown.

    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        *,
        on_mismatch: Literal["raise", "warn"] = "raise",
        exclude: Sequence[str] = (),
        include_optimizer_state: bool = False,
        at_epoch_end: bool = False,
        norm_statistics: bool = True,
    ) -> None:
        if every_n_steps is not None and (
            not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1
        ):
            raise ValueError(f"`every_n_steps` must be a positive integer or None, got {every_n_steps!r}.")
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"`on_mismatch` must be 'raise' or 'warn', got {on_mismatch!r}.")
        self._skip_idle = False
        self.every_n_steps = every_n_steps
        self.on_mismatch = on_mismatch
        self.at_epoch_end = at_epoch_end
        #: The comparison itself (its ``last_step`` is the step of the last check that found the ranks equal).
        self.agreement = WeightAgreement(
            exclude=exclude, include_optimizer_state=include_optimizer_state, norm_statistics=norm_statistics
        )
        self._last_checked = -1

    @property
    def every_n_steps(self) -> int | None:
        """Check after every this many optimizer steps; ``None``: never during an epoch."""
        return self._every_n_steps

    @every_n_steps.setter
    def every_n_steps(self, every_n_steps: int | None) -> None:
        self._every_n_steps = every_n_steps
        if self._skip_idle and every_n_steps is None:  # nothing to do at a batch end
            skip_hooks(self, _PERIODIC, unless_overridden_below=WeightSyncCheck)
        elif self._skip_idle:
            restore_hooks(self, _PERIODIC)

    def skip_idle_hooks(self) -> None:
        """Let Lightning pass over the per-batch hooks while they have nothing to do: for the strategy's own check.

        Those hooks are then ``None`` on this instance: the inherited ones always, ``on_train_batch_end`` while
        :attr:`every_n_steps` is ``None``. Lightning skips a hook that is not callable, which saves its dispatch
        (about 1 us per hook and step); the strategy does this for the check it adds itself, which nothing else
        calls.
        """
        self._skip_idle = True
        skip_inherited_batch_hooks(self)
        self.every_n_steps = self._every_n_steps

    @property
    def exclude(self) -> tuple[str, ...]:
        """The ``fnmatch`` patterns of tensor names that are not compared."""
        return self.agreement.exclude

    @property
    def include_optimizer_state(self) -> bool:
        """Whether the optimizers' state tensors are compared too."""
        return self.agreement.include_optimizer_state

    def reset(self) -> None:
        """Forget which steps were already checked (a new fit may count its steps from 0 again)."""
        self._last_checked = -1
        self.agreement.last_step = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.reset()

    def _tensors(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, str, Tensor]]:
        model = getattr(getattr(trainer, "strategy", None), "model", None)
        return self.agreement.tensors(model, module=pl_module, optimizers=trainer.optimizers)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self._every_n_steps
        if every is None:
            return
        step = trainer.global_step
        if step == 0 or step % every or step == self._last_checked:
            return
        self._last_checked = step
        self.check(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if not self.at_epoch_end or step == self._last_checked or step == self.agreement.last_step:
            return  # already compared at this step (a periodic check, or the strategy's check before a save)
        self._last_checked = step
        self._check(trainer, pl_module, f" (end of training epoch {trainer.current_epoch})")

    def check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run the comparison now (every rank must call it)."""
        self._check(trainer, pl_module, "")

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, moment: str) -> None:
        control = getattr(trainer.strategy, "control_plane", None)
        if control is None:
            if trainer.world_size > 1:
                rank_zero_warn("WeightSyncCheck needs SafeDDPStrategy (its control plane); the check is skipped.")
            return
        error = self.agreement.check(
            control,
            getattr(trainer.strategy, "model", None),
            step=trainer.global_step,
            name=f"weight-sync:step-{trainer.global_step}",
            module=pl_module,
            optimizers=trainer.optimizers,
            moment=moment,
        )
        if error is None:
            return
        if self.on_mismatch == "raise":
            raise error
        rank_zero_warn(str(error))
