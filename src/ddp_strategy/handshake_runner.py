"""``Handshakes``: when the strategy runs the checks of :mod:`ddp_strategy.handshake`, and what it does with them.

The early device check (at ``setup_environment``), the start-up handshake of each stage (rank facts gathered on the
control plane and compared), the ranks' training batch counts (again after every reload of the training
dataloader) and what uneven counts lead to (``uneven_inputs``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from typing_extensions import override

from ._compat.callback_hooks import skip_inherited_batch_hooks
from ._compat.lightning import (
    Callback,
    TrainerFn,
    add_callback,
    find_callback,
    pl,
    rank_zero_info,
    rank_zero_warn,
    remove_callbacks,
    trainer_of,
)
from .control import ControlPlane
from .errors import UnevenInputsError
from .handshake import (
    RankFacts,
    check_devices,
    check_facts,
    check_setup,
    check_training_batches,
    collect_facts,
    compare_training_batches,
    seed_report,
    seed_summary,
    train_sampler_seeds,
)
from .host import StrategyHost
from .options import StrategyOptions
from .positions import call_site

__all__ = ["Handshakes"]


class _ReloadedTrainingBatchesCheck(Callback):
    """Calls ``check(trainer)`` at every training epoch start, before the other callbacks' and the module's hooks.

    Added by :class:`Handshakes` in ``fit`` once the training dataloader is reloaded after the training handshake
    (a fit without reloads never has it: no per-batch turn in Lightning's hook loop); ``check`` returns at once
    unless the training dataloader was reloaded since the last comparison of the ranks' batch counts.
    """

    def __init__(self, check: Callable[[pl.Trainer], None]) -> None:
        self._check = check
        skip_inherited_batch_hooks(self)  # Lightning passes over its per-batch hooks (it has none)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer)


class Handshakes:
    """The strategy's start-up checks across ranks: devices, the handshake of each stage, training batch counts.

    Args:
        control: returns the strategy's control plane (``None`` outside a run: nothing is checked).
        options: the strategy's options (``handshake``, ``uneven_inputs``).

    """

    def __init__(self, control: Callable[[], ControlPlane | None], options: StrategyOptions) -> None:
        self._control = control
        #: Whether the handshakes run (the ``handshake`` option).
        self.enabled = options.handshake
        #: What uneven training batch counts lead to: ``"raise"``, ``"warn"`` or ``None`` (not compared).
        self.uneven_inputs = options.uneven_inputs
        #: Seconds the last start-up handshake took on this rank (``None`` before the first one).
        self.last_seconds: float | None = None
        #: Whether a handshake ran in the current stage (the evaluation stages run one only then).
        self.done = False
        #: The training dataloader was (re)loaded since the ranks' batch counts were last compared.
        self.train_loader_reloaded = False
        self._fitting = False  # a fit of several ranks: a reload after the training handshake is compared
        self._train_compared = False  # the training handshake compared this fit's batch counts

    def check_devices(self, strategy: StrategyHost) -> None:
        """Early device and set-up check, before any data-plane collective can touch a shared GPU.

        Raises:
            DuplicateDeviceError: two ranks use one device.
            SetupMismatchError: versions, world size or the strategy options differ (the rendezvous compared the
                options already unless the process group existed before this stage).

        """
        control = self._control()
        if self.enabled and control is not None:
            gathered = control.all_gather_object(self._rank_facts(strategy, False), name="device-check")
            check_devices(gathered)
            check_setup(gathered)

    def setup(self, trainer: pl.Trainer, world_size: int) -> None:
        """At the strategy's ``setup``: no handshake yet; for ``fit``, compare batch counts after each reload."""
        self.done = False
        self.train_loader_reloaded = False
        self._fitting = trainer.state.fn == TrainerFn.FITTING and world_size > 1
        self._train_compared = False
        remove_callbacks(trainer, _ReloadedTrainingBatchesCheck)  # a previous fit's

    def training_loader_loaded(self, trainer: pl.Trainer) -> None:
        """The strategy prepared a training dataloader: its batch counts are compared at the next epoch start.

        The first load of a fit is compared by the training handshake. A reload after it (every rank reloads in the
        same epoch, on the Trainer's schedule) adds the callback that compares the counts as that epoch starts,
        before any other hook; it stays for the rest of the fit.
        """
        self.train_loader_reloaded = True
        compared = self._fitting and self._train_compared
        if compared and find_callback(trainer, _ReloadedTrainingBatchesCheck) is None:
            add_callback(trainer, _ReloadedTrainingBatchesCheck(self.check_reloaded_training_batches), first=True)

    def run(self, stage: str, strategy: StrategyHost) -> None:
        """The handshake of ``stage`` (``"train"``, ``"validate"``, ``"test"`` or ``"predict"``), on every rank.

        The training handshake compares the training batch counts too (a reload before it needs no other check).

        Raises:
            DDPStrategyError: a subclass naming what differs between the ranks (setup, weights, devices), or
                :class:`~ddp_strategy.errors.UnevenInputsError` for differing training batch counts.

        """
        if stage == "train":
            self.train_loader_reloaded = False  # its batch counts are compared now
            self._train_compared = True
        control = self._control()
        if not self.enabled or control is None:
            return
        start = time.perf_counter()
        facts = self._rank_facts(strategy, True, training=stage == "train")
        gathered = control.all_gather_object(facts, name=f"handshake:{stage}", site=call_site(skip=2))
        check_facts(gathered)
        self.check_training_batches(gathered)
        self.last_seconds = time.perf_counter() - start
        self.done = True
        warning = seed_report(gathered)
        if warning is not None:
            rank_zero_warn(warning)
        summary = seed_summary(gathered)
        if summary is not None:
            rank_zero_info(summary)
        rank_zero_info(
            f"ddp_strategy: {stage} handshake passed on {strategy.world_size} rank(s) "
            f"({len(facts.tensors)} tensors compared) in {self.last_seconds * 1000:.1f} ms"
        )

    def run_once(self, stage: str, strategy: StrategyHost) -> None:
        """:meth:`run`, unless a handshake ran in this stage already (the sanity check's, before training's)."""
        if not self.done:
            self.run(stage, strategy)

    def check_training_batches(self, gathered: list[RankFacts]) -> None:
        """Act on the ranks' training batch counts as ``uneven_inputs`` says (see :meth:`run`)."""
        message = check_training_batches(gathered) if self.uneven_inputs is not None else None
        self._act_on_uneven_inputs(message, [f.training_batches or 0.0 for f in gathered])

    def check_reloaded_training_batches(self, trainer: pl.Trainer) -> None:
        """At an epoch start after the training dataloader was reloaded: compare the ranks' new batch counts.

        Every rank reloads in the same epoch (the Trainer's ``reload_dataloaders_every_n_epochs``), so every rank
        decides alike whether to gather; without a reload this costs one attribute read.

        Raises:
            UnevenInputsError: the counts differ and ``uneven_inputs="raise"``.

        """
        if not self.train_loader_reloaded:
            return
        self.train_loader_reloaded = False
        control = self._control()
        if self.uneven_inputs is None or not self.enabled or control is None:
            return
        epoch = trainer.current_epoch
        counts = control.all_gather_object(float(trainer.num_training_batches), name=f"training-batches:epoch-{epoch}")
        self._act_on_uneven_inputs(compare_training_batches(counts, epoch=epoch), counts)

    def _act_on_uneven_inputs(self, message: str | None, counts: Sequence[float]) -> None:
        if message is None:
            return
        if self.uneven_inputs == "warn":
            rank_zero_warn(f"ddp_strategy: {message}")
            return
        raise UnevenInputsError(message, batches=counts)

    @staticmethod
    def _rank_facts(strategy: StrategyHost, with_tensors: bool, training: bool = False) -> RankFacts:
        trainer = trainer_of(strategy.lightning_module)
        return collect_facts(
            rank=strategy.global_rank,
            local_rank=strategy.local_rank,
            node_rank=strategy.node_rank,
            world_size=strategy.world_size,
            device=strategy.root_device,
            module=strategy.model if with_tensors else None,
            sampler_seeds=train_sampler_seeds(trainer) if with_tensors else None,
            training_batches=trainer.num_training_batches if training and trainer is not None else None,
            options=strategy.agreed_options,
        )
