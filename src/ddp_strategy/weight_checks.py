"""``WeightChecks``: the strategy's comparisons of the ranks' weights, and its following of the trainable set.

One :class:`~ddp_strategy.callbacks.WeightSyncCheck` serves the check before every checkpoint save, the one at
epoch ends (or every ``N`` steps) and the one when the set of trainable parameters changes: they share one
comparison and its record of the last step compared.
"""

from __future__ import annotations

import time
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ._compat.lightning import TrainerFn, add_callback, has_callback, pl, rank_zero_info, rebuild_ddp_wrapper
from .callbacks.weight_sync import WeightSyncCheck
from .consistency import Comparison
from .control import ControlPlane
from .errors import DDPStrategyError
from .host import StrategyHost
from .options import StrategyOptions
from .trainable import TrainableSetWatcher, agree_on_trainable_set, describe_change

__all__ = ["WeightChecks"]


class WeightChecks:
    """When the ranks compare their weights, and how the strategy follows a change of the trainable set.

    Args:
        options: the strategy's options (``weight_check``, ``weight_check_exclude``, ``track_trainable_set``).

    """

    def __init__(self, options: StrategyOptions) -> None:
        #: The comparison shared by saves, epoch ends and trainable-set changes; ``None`` with ``weight_check=None``.
        self.check: WeightSyncCheck | None = (
            None
            if options.weight_check is None
            else WeightSyncCheck(
                options.weight_check_every_n_steps,
                at_epoch_end=options.weight_check != "save",
                exclude=options.weight_check_exclude,
                norm_statistics=False,
            )
        )
        if self.check is not None:
            self.check.skip_idle_hooks()  # the strategy's own: nothing else calls its hooks
        self.track_trainable_set = options.track_trainable_set
        self._trainable: TrainableSetWatcher | None = None
        #: Training batches started in this fit (the same count on every rank).
        self.train_batches = 0
        #: How many times the set of trainable parameters changed, and DDP's wrapper was rebuilt, in the last fit.
        self.trainable_set_changes = 0

    def setup(self, trainer: pl.Trainer, model: Any, world_size: int) -> None:
        """Remember the trainable set DDP was built with, and add the epoch-end (or every-N-steps) weight check."""
        self.train_batches = 0
        self.trainable_set_changes = 0
        fitting = trainer.state.fn == TrainerFn.FITTING
        wrapped = isinstance(model, DistributedDataParallel)
        self._trainable = TrainableSetWatcher() if self.track_trainable_set and fitting and wrapped else None
        if self._trainable is not None and isinstance(model, DistributedDataParallel):
            self._trainable.track(model)
        check = self.check
        if check is not None:
            check.reset()  # added after the callbacks' setup hooks ran: forget a previous fit's steps here
        periodic = check is not None and (check.at_epoch_end or check.every_n_steps is not None)
        if check is not None and periodic and world_size > 1 and not has_callback(trainer, check):
            add_callback(trainer, check)

    def on_train_batch_start(self, strategy: StrategyHost, step: int, control: ControlPlane | None) -> int:
        """Count the batch; when the trainable set changed, agree on it and rebuild ``strategy``'s DDP wrapper.

        The test reads every tracked parameter's ``requires_grad`` (see :meth:`TrainableSetWatcher.changed`), no I/O.

        Args:
            strategy: the strategy; its ``model`` is the DDP wrapper, rebuilt with the same options on a change.
            step: the Trainer's ``global_step``.
            control: the control plane the ranks agree on.

        Returns:
            The number of training batches started in this fit, this one included.

        Raises:
            RankDivergenceError: the set changed differently, or on some ranks only, or the weights differ.
            DDPStrategyError: DDP's ``mixed_precision`` option is set (a rebuilt wrapper cannot take it over).

        """
        self.train_batches += 1
        if self._trainable is not None and self._trainable.changed():
            self._follow_trainable_set(strategy, step, control)
        return self.train_batches

    def comparison(self, model: Any, *, when: str, name: str) -> Comparison | None:
        """This rank's side of a weight comparison named ``name`` (``None`` when weights are not compared)."""
        if self.check is None or model is None:
            return None
        return self.check.agreement.comparison(model, when=when, name=name)

    def agreed_at(self, step: int) -> None:
        """The ranks' weights agreed at ``step`` (before a save): the epoch-end check need not repeat it."""
        if self.check is not None:
            self.check.agreement.last_step = step

    def _follow_trainable_set(self, strategy: StrategyHost, step: int, control: ControlPlane | None) -> None:
        """Agree with the other ranks on the new trainable set (and on the weights), then rebuild DDP's wrapper."""
        watcher, model = self._trainable, strategy.model
        if watcher is None or control is None or not isinstance(model, DistributedDataParallel):
            return
        start = time.perf_counter()
        change = watcher.current()
        weights = self.comparison(
            model, when=f"by step {step}", name=f"trainable-set-weights:batch-{self.train_batches}"
        )
        agree_on_trainable_set(control, change, batch=self.train_batches, step=step, weights=weights)
        if getattr(model, "mixed_precision", None) is not None:  # its hooks sit on the module, bound to the old
            raise DDPStrategyError(
                "The set of trainable parameters changed after DDP was built "
                f"({describe_change(change)}), but DDP's prototype `mixed_precision` option registers hooks on the "
                "module that a rebuilt wrapper cannot take over. Change `requires_grad` before fit, use Lightning's "
                "`precision=` instead of DDP's `mixed_precision`, or pass SafeDDPStrategy(track_trainable_set=False)."
            )
        watcher.track(rebuild_ddp_wrapper(strategy))
        self.trainable_set_changes += 1
        took = (time.perf_counter() - start) * 1000
        rank_zero_info(
            f"ddp_strategy: the set of trainable parameters changed before training step {step} "
            f"({describe_change(change)}; {change.trainable} parameters require a gradient now). DDP's wrapper was "
            f"rebuilt with the same options, so exactly these are all-reduced ({took:.1f} ms)."
        )
