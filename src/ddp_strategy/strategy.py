"""``SafeDDPStrategy``: Lightning's DDP strategy, with every cross-rank mistake turned into a named error."""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ._compat.lightning import (
    LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH,
    Callback,
    CheckpointPath,
    DDPStrategy,
    StrategyRegistryType,
    TrainerFn,
    add_callback,
    configure_launcher,
    count_checkpointed_batch_as_completed,
    destroy_default_process_group,
    epochs_processed,
    handle_signals_during_run,
    has_callback,
    init_default_process_group,
    logged_metric_of_caller,
    pl,
    rank_zero_info,
    rank_zero_warn,
    rebuild_ddp_wrapper,
    reseed_as_fit_does,
    restore_before_second_train_iterator,
    restore_when_the_epoch_loop_starts,
    route_resume_path,
    set_sampler_epoch,
    trainer_of,
    training_dataloaders,
    training_progress,
)
from ._compat.torch import collective_status, enable_collective_trace
from .bucket_layout import BucketLayoutKeeper
from .callbacks.preemption_stop import PreemptionStop
from .callbacks.sharding_check import ensure_sharding_check
from .callbacks.weight_sync import WeightSyncCheck
from .checkpoint import protocol
from .checkpoint.async_writer import AsyncCheckpointWriter
from .checkpoint.io import SafeCheckpointIO
from .checkpoint.keys import BUCKET_LAYOUT_KEY, NO_RNG_REASON_KEY, PACKAGE_KEY, package_state
from .checkpoint.overlap import deferrable_tensors, install_snapshot_gate
from .control import (
    ControlPlane,
    RankFailure,
    also_failed,
    first_failure,
    from_rank,
    scaled_interval,
    to_timedelta,
)
from .desync import (
    TRACE_ENTRIES,
    CallLedger,
    CallNotes,
    DesyncMonitor,
    LogSites,
    check_gather_shapes,
    first_published_difference,
)
from .errors import (
    CheckpointMismatchError,
    CheckpointWriteError,
    CollectiveMismatchError,
    DDPStrategyError,
    UnevenInputsError,
)
from .evaluation.coordinator import ExactEvaluation, sync_buffers_before_evaluation
from .fork_safety import fork_hazard, pin_collective_threads
from .handshake import (
    RankFacts,
    check_devices,
    check_facts,
    check_training_batches,
    collect_facts,
    compare_training_batches,
    seed_report,
    seed_summary,
    train_sampler_seeds,
)
from .peers import diagnose_failed_peers
from .positions import call_site
from .preemption import DEFAULT_PREEMPTION_SIGNALS, Preempted, PreemptionAgreement, exit_code, parse_signals
from .sampling import skip_consumed_batches
from .trainable import TrainableSetWatcher, agree_on_trainable_set, describe_change

__all__ = ["DEFAULT_BARRIER_TIMEOUT", "SafeDDPStrategy"]

log = logging.getLogger(__name__)

_SAVE_ON = frozenset({"global_zero", "node_zero"})
_ASYNC_SNAPSHOT = frozenset({"overlap", "blocking"})
_SHARDING_CHECK = frozenset({"raise", "warn"})
_WEIGHT_CHECK = frozenset({"epoch", "save"})
_UNEVEN_INPUTS = frozenset({"raise", "warn"})

#: How long a named barrier waits for the other ranks before raising ``CollectiveMismatchError``.
DEFAULT_BARRIER_TIMEOUT = timedelta(minutes=10)


def _persistent_workers(dataloader: object) -> bool:
    """A DataLoader whose worker processes (and iterator) live across epochs: it draws no new seed per epoch."""
    return bool(getattr(dataloader, "persistent_workers", False)) and getattr(dataloader, "num_workers", 0) > 0


class _ReloadedTrainingBatchesCheck(Callback):
    """Calls ``check(trainer)`` at every training epoch start, before the other callbacks' and the module's hooks.

    Added by :class:`SafeDDPStrategy` for ``fit``; ``check`` returns at once unless the training dataloader was
    reloaded since the last comparison of the ranks' batch counts.
    """

    def __init__(self, check: Callable[[pl.Trainer], None]) -> None:
        self._check = check

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer)


class SafeDDPStrategy(DDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` with cross-rank safety checks.

    It accepts every argument ``DDPStrategy`` accepts (extra keyword arguments go to
    :class:`torch.nn.parallel.DistributedDataParallel`), plus the ones below. On top of DDP it

    * builds a *control plane* (a gloo group and the rendezvous store) for its own messages, so its checks work
      the same when the data plane is NCCL;
    * runs a start-up *handshake* before the first training, validation, test or predict step: duplicate
      devices, differing versions/world size/model structure, and differing weights raise named errors;
    * makes :meth:`barrier` a *monitored, named* barrier that raises
      :class:`~ddp_strategy.errors.CollectiveMismatchError` after ``barrier_timeout`` instead of hanging;
    * follows changes of the set of trainable parameters after DDP was built (``BackboneFinetuning``, freezing or
      unfreezing mid-run): the ranks agree on the new set and DDP's wrapper is rebuilt with the same options, so
      the newly trainable parameters are all-reduced;
    * compares the ranks' weights before every checkpoint save and at the end of every training epoch: ranks that
      disagree raise :class:`~ddp_strategy.errors.RankDivergenceError` and the checkpoint is not written.

    Use it as ``Trainer(strategy=SafeDDPStrategy(...))`` or, after ``import ddp_strategy``,
    ``Trainer(strategy="safe_ddp")`` (``"safe_ddp_spawn"`` for the spawn launcher).

    Args:
        *args: passed to ``DDPStrategy``.
        barrier_timeout: how long a barrier (and each control-plane collective) waits for all ranks, as seconds
            or a ``timedelta``. Default: 10 minutes. Raise it if rank 0 legitimately takes longer alone (a long
            ``prepare_data`` download, a huge checkpoint write).
        handshake: run the start-up handshake. Default: ``True``.
        heartbeat_interval: seconds between the publications of each rank's position to the rendezvous store,
            used to say where a missing rank was. ``0`` disables the background heartbeat thread.
        async_save: write checkpoints in a background thread on rank 0 after a snapshot to CPU memory; training
            goes on during the write. At most one write is in flight; its outcome is agreed by all ranks at the
            next save or at teardown (which waits for it), and old checkpoints are removed only after it succeeded.
        async_snapshot: with ``async_save``, how a checkpoint saved during training is copied to CPU memory.
            ``"overlap"`` (default): parameters and optimizer state are copied while the next batch's forward and
            backward run, and the optimizer waits for the copy before it changes them (see
            :mod:`ddp_strategy.checkpoint.overlap`); an in-place change by other code in between fails that write
            loudly. ``"blocking"``: everything is copied before the save returns.
        save_on: ``"global_zero"`` (default): global rank 0 writes the one checkpoint; ranks that cannot see it at
            load time (a disk other nodes do not share) receive it from rank 0. ``"node_zero"``: local rank 0 of
            every node writes its own copy, for nodes without a shared filesystem.
        exact_evaluation: give every validation/test/predict sample to exactly one rank (no padded duplicates),
            let ranks with an empty shard take part in the epoch-end metric sync, and return predictions in
            dataset order. Default: ``True``. ``False`` keeps Lightning's padded ``DistributedSampler``.
        predictions_on: with exact evaluation, where ``trainer.predict`` returns all predictions in dataset order:
            ``"global_zero"`` (default; other ranks get their own share) or ``"all"``.
        sharding_check: compare the first training batches across ranks (a
            :class:`~ddp_strategy.callbacks.ShardingCheck` is added unless the Trainer has one): ``"warn"``
            (default) or ``"raise"`` when two ranks receive identical batches, ``None`` to skip.
        uneven_inputs: what to do when the ranks' training batch counts per epoch are known (map-style data,
            sized loaders) and differ, which would hang DDP's gradient all-reduce: ``"raise"`` (default) an
            :class:`~ddp_strategy.errors.UnevenInputsError` on every rank before the first step, ``"warn"``, or
            ``None`` to skip the comparison. Compared by the training handshake (at ``on_train_start``), and again
            at the start of every epoch whose training dataloader was reloaded since
            (``Trainer(reload_dataloaders_every_n_epochs=N)``), before that epoch's first step: one small gather on
            the control plane per reload, nothing in epochs without one. Needs ``handshake=True``.
        weight_check: when every rank's weights are compared (a fingerprint per parameter, and per buffer that DDP
            does not re-broadcast, compared on the control plane; see :mod:`ddp_strategy.consistency`):
            ``"epoch"`` (default): before every checkpoint save and at the end of every training epoch; ``"save"``:
            before saves only; an integer ``N``: also every ``N`` optimizer steps (what
            :class:`~ddp_strategy.callbacks.WeightSyncCheck` does); ``None``: never. On a mismatch every rank
            raises :class:`~ddp_strategy.errors.RankDivergenceError` naming the tensors, the ranks and the largest
            difference, and the checkpoint being saved is not written.
        weight_check_exclude: ``fnmatch`` patterns of tensor names the weight check skips (tensors that may
            legitimately differ between ranks). The running statistics of BatchNorm/InstanceNorm layers are never
            compared by this check (each rank updates them from its own batch).
        track_trainable_set: before each training step, test whether the parameters' ``requires_grad`` flags still
            match those DDP was built with; when they changed on every rank, agree on the new set and rebuild the DDP
            wrapper with the same options, so newly trainable parameters are all-reduced (and frozen ones no longer
            awaited). A set that changed differently, or on some ranks only, raises
            :class:`~ddp_strategy.errors.RankDivergenceError`. Default: ``True``.
        desync_detection: watch every collective of every rank (the strategy's, Lightning's ``self.log(...,
            sync_dist=True)``, torchmetrics', the user's ``torch.distributed`` calls and DDP's gradient all-reduce,
            through torch's Flight Recorder) and raise :class:`~ddp_strategy.errors.CollectiveMismatchError` on every
            rank, within seconds, when the ranks' calls differ or every rank waits in a collective another never
            enters (:class:`~ddp_strategy.errors.UnevenInputsError` for uneven training inputs). Default: ``True``;
            needs the heartbeat (``heartbeat_interval > 0``). See :mod:`ddp_strategy.desync`.
        preemption_signals: the signals that stop ``fit`` as a preemption (names or numbers; default
            ``("SIGTERM",)``, add ``"SIGUSR1"`` for SLURM's ``--signal``; ``None`` leaves signals to Lightning).
            When any subset of ranks receives one, the ranks agree on a stop step over the control plane (no
            collective in the handler, none per step), save one checkpoint there with the normal collective save
            (to ``ModelCheckpoint``'s ``last`` file, where ``fit(ckpt_path="last")`` finds it), and every rank raises
            :class:`~ddp_strategy.Preempted`, exiting with ``128 + signal`` (143 for SIGTERM). See
            :mod:`ddp_strategy.preemption` and docs/checkpoints.md.
        **kwargs: passed to ``DDPStrategy`` (and from there to ``DistributedDataParallel``).

    Raises:
        ValueError: ``barrier_timeout`` or ``heartbeat_interval`` is not a positive number, or ``weight_check`` is
            not one of its values.

    """

    strategy_name = "safe_ddp"

    def __init__(
        self,
        *args: Any,
        barrier_timeout: float | timedelta = DEFAULT_BARRIER_TIMEOUT,
        handshake: bool = True,
        heartbeat_interval: float = 1.0,
        async_save: bool = False,
        async_snapshot: str = "overlap",
        save_on: str = "global_zero",
        exact_evaluation: bool = True,
        predictions_on: str = "global_zero",
        sharding_check: str | None = "warn",
        uneven_inputs: str | None = "raise",
        weight_check: str | int | None = "epoch",
        weight_check_exclude: Sequence[str] = (),
        track_trainable_set: bool = True,
        preemption_signals: Sequence[str | int] | None = DEFAULT_PREEMPTION_SIGNALS,
        desync_detection: bool = True,
        **kwargs: Any,
    ) -> None:
        if "checkpoint_io" not in kwargs and len(args) < 4:  # DDPStrategy's 4th positional is checkpoint_io
            kwargs["checkpoint_io"] = SafeCheckpointIO()
        super().__init__(*args, **kwargs)
        self.barrier_timeout = to_timedelta(barrier_timeout, name="barrier_timeout")
        if not isinstance(heartbeat_interval, (int, float)) or heartbeat_interval < 0:
            raise ValueError(f"`heartbeat_interval` must be a number of seconds >= 0, got {heartbeat_interval!r}.")
        self.heartbeat_interval = float(heartbeat_interval)
        self.handshake_enabled = handshake
        #: Seconds the last start-up handshake took on this rank (``None`` before the first one).
        self.last_handshake_seconds: float | None = None
        self._control: ControlPlane | None = None
        #: Whether the gloo worker threads of the process groups keep a Python thread state (see fork_safety).
        self.collective_threads_pinned = False
        self._default_group_pinned = False
        self._handshake_done = False
        self._failed = False
        self._resumed: dict[str, Any] | None = None  # RNG section of the checkpoint being resumed
        #: DDP's gradient-bucket layout, saved in checkpoints and restored on resume (bit-exact at 3+ ranks).
        self.bucket_layout = BucketLayoutKeeper()
        self.async_save = async_save
        if async_snapshot not in _ASYNC_SNAPSHOT:
            raise ValueError(f"`async_snapshot` must be one of {sorted(_ASYNC_SNAPSHOT)}, got {async_snapshot!r}.")
        self.async_snapshot = async_snapshot
        if save_on not in _SAVE_ON:
            raise ValueError(f"`save_on` must be one of {sorted(_SAVE_ON)}, got {save_on!r}.")
        self.save_on = save_on
        self._writer: AsyncCheckpointWriter | None = None  # rank 0's background writer when async_save
        #: Asynchronous saves on this rank whose snapshot overlapped training (``async_snapshot="overlap"``).
        self.overlapped_saves = 0
        self.exact_evaluation = exact_evaluation
        self._exact = ExactEvaluation(self._control_plane_or_none, predictions_on=predictions_on)
        if sharding_check is not None and sharding_check not in _SHARDING_CHECK:
            choices = sorted(_SHARDING_CHECK)
            raise ValueError(f"`sharding_check` must be one of {choices} or None, got {sharding_check!r}.")
        self.sharding_check = sharding_check
        if uneven_inputs is not None and uneven_inputs not in _UNEVEN_INPUTS:
            choices = sorted(_UNEVEN_INPUTS)
            raise ValueError(f"`uneven_inputs` must be one of {choices} or None, got {uneven_inputs!r}.")
        self.uneven_inputs = uneven_inputs
        # the training dataloader was (re)loaded since the ranks' batch counts were last compared
        self._train_loader_reloaded = False
        periodic = isinstance(weight_check, int) and not isinstance(weight_check, bool)
        if not (weight_check is None or weight_check in _WEIGHT_CHECK or (periodic and int(weight_check) >= 1)):
            raise ValueError(
                f"`weight_check` must be one of {sorted(_WEIGHT_CHECK)}, a positive number of steps, or None, got "
                f"{weight_check!r}."
            )
        self.weight_check = weight_check
        # The check before saves and the one at epoch ends share one comparison (and its record of the last step).
        self._weight_check: WeightSyncCheck | None = (
            None
            if weight_check is None
            else WeightSyncCheck(
                int(weight_check) if periodic else None,
                at_epoch_end=weight_check != "save",
                exclude=weight_check_exclude,
                norm_statistics=False,
            )
        )
        self.track_trainable_set = track_trainable_set
        self._trainable: TrainableSetWatcher | None = None
        self._train_batches = 0  # training batches started in this fit (the same count on every rank)
        #: How many times the set of trainable parameters changed, and DDP's wrapper was rebuilt, in the last fit.
        self.trainable_set_changes = 0
        self.preemption_signals = parse_signals(preemption_signals)
        self._preemption: PreemptionStop | None = None
        self.desync_detection = bool(desync_detection)
        self._desync: DesyncMonitor | None = None
        self._call_notes = CallNotes()
        self._call_ledger = CallLedger()
        self._log_sites = LogSites()

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register ``"safe_ddp"`` (subprocess launcher) and ``"safe_ddp_spawn"`` (spawn launcher)."""
        for name, start_method in (("safe_ddp", "popen"), ("safe_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"SafeDDPStrategy (checked DDP) with start_method '{start_method}'",
                override=True,
                start_method=start_method,
            )

    # ------------------------------------------------------------------ life cycle
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # the spawn launcher's main process exits with the ranks' preemption code; in every rank, a backend error
        # caused by diverged collectives is replaced by the error the ranks agreed on
        signals = self.preemption_signals or ()
        codes = frozenset(exit_code(sig) for sig in signals)
        configure_launcher(self, codes, tuple(int(sig) for sig in signals), self._agreed_error_instead)

    def _raise_agreed_desync(self) -> None:
        """Raise the desync every rank agreed on, at this rank's next strategy hook (its ranks run on otherwise)."""
        if self._control is not None and self._control.desync_error is not None:
            raise self._control.desync_error

    def _training_progress(self) -> tuple[int, int] | None:
        return training_progress(self._trainer_or_none())

    def _agreed_error_instead(self, error: BaseException) -> BaseException | None:
        """The desync error the ranks agreed on, to raise instead of the backend error it caused; else ``None``."""
        monitor = self._desync
        if monitor is None or isinstance(error, DDPStrategyError):
            return None
        if monitor.control.desync_error is not None:
            return monitor.control.desync_error
        text = str(error)
        if not isinstance(error, RuntimeError) or not any(m in text for m in ("gloo", "Gloo", "NCCL", "c10d")):
            return None
        if any(m in text for m in ("Connection closed", "Connection reset", "Broken pipe")):
            return None  # a peer process is gone: the failure diagnosis names it (peers.py)
        return monitor.inquire()  # the backend refused a call: ask every rank whether their collectives diverged

    def _control_plane_or_none(self) -> ControlPlane | None:  # a bound method, so the strategy still pickles
        return self._control

    @property
    def control_plane(self) -> ControlPlane | None:
        """The control plane, available between ``setup_environment`` and ``teardown``."""
        return self._control

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._control is None:
            self._control = ControlPlane.create(
                timeout=self.barrier_timeout, heartbeat_interval=self.heartbeat_interval
            )
            self._desync = None
            watch = self.desync_detection and self.world_size > 1 and self.heartbeat_interval > 0
            if watch and collective_status():  # torch's Flight Recorder is on (see setup_distributed)
                self._call_ledger = CallLedger()
                self._desync = DesyncMonitor(
                    self._control, self._call_notes, progress=self._training_progress, ledger=self._call_ledger
                )
            if self.world_size > 1:  # before any DataLoader forks a worker (see fork_safety)
                groups = (
                    [self._control.group] if self._default_group_pinned else [dist.group.WORLD, self._control.group]
                )
                self.collective_threads_pinned = pin_collective_threads(groups)
                self._default_group_pinned = True
        self._failed = False
        self._agree_on_resume_path()
        if self.handshake_enabled:
            self._check_devices()

    def _agree_on_resume_path(self) -> None:
        """Make every rank resume from the checkpoint path rank 0 chose.

        Lightning resolves ``ckpt_path="last"`` on every rank separately, before any strategy code runs; a node that
        does not see rank 0's checkpoint directory resolves nothing and would silently start from scratch while the
        others resume. Lightning offers no hook between that resolution and the restore, so the seam routes the
        Trainer's restore through :meth:`_resume_path_of_rank_zero`.
        """
        trainer = self._trainer_or_none()
        if trainer is not None:
            route_resume_path(trainer, self._resume_path_of_rank_zero, marker="__ddp_strategy__")

    def _resume_path_of_rank_zero(self, mine: str | None) -> str | None:
        control = self._control
        if control is None:
            return mine
        agreed = control.agree("resume-path", mine, from_rank(0))
        if mine != agreed:
            log.warning(
                "ddp_strategy: rank %d resolved the checkpoint to resume as %r; using rank 0's %r so that every "
                "rank resumes from the same one.",
                self.global_rank,
                mine,
                agreed,
            )
        return agreed

    @override
    def setup_distributed(self) -> None:
        # As DDPStrategy.setup_distributed, except that NCCL is initialised lazily (no `device_id`): two ranks on
        # one GPU then reach the device check on the control plane instead of failing inside NCCL's own init.
        if self.desync_detection:  # before the first process group: torch's recorder reads its size then
            enable_collective_trace(TRACE_ENTRIES)
        created = init_default_process_group(self, store=_elastic_attempt_store)
        if created and self.process_group_backend != "nccl":  # Lightning registers this for NCCL itself
            # The default group outlives teardown (fit, then validate/test, reuse it, as in stock Lightning) and
            # is destroyed when the process exits.
            atexit.register(destroy_default_process_group)

    @property
    def exact_evaluation_coordinator(self) -> ExactEvaluation | None:
        """The exact-evaluation coordinator while it is in effect (``exact_evaluation`` and several ranks)."""
        return self._exact if self.exact_evaluation and self.world_size > 1 else None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._handshake_done = False
        if self.exact_evaluation and self.world_size > 1 and not self._exact.install(trainer):
            self.exact_evaluation = False
        if self.sharding_check is not None and self.world_size > 1:
            ensure_sharding_check(trainer, "raise" if self.sharding_check == "raise" else "warn")
        if self.async_save and self._overlap_snapshots:
            install_snapshot_gate(trainer, self._wait_for_snapshot)
        self._setup_weight_checks(trainer)
        self._setup_preemption(trainer)
        self._train_loader_reloaded = False
        if trainer.state.fn == TrainerFn.FITTING and self.world_size > 1:
            check = _ReloadedTrainingBatchesCheck(self._check_reloaded_training_batches)
            add_callback(trainer, check, first=True, replace=_ReloadedTrainingBatchesCheck)
        if self.desync_detection and self.lightning_module is not None:
            self._log_sites.install(self.lightning_module)

    @override
    def configure_ddp(self) -> None:
        # a resumed run starts with the saved run's gradient buckets (see bucket_layout)
        self.bucket_layout.world_size = self.world_size
        with self.bucket_layout.constructing(self.lightning_module):  # type: ignore[arg-type]
            super().configure_ddp()

    def _setup_preemption(self, trainer: pl.Trainer) -> None:
        """For ``fit``: take the preemption signals from Lightning's handlers and add the stop at step boundaries."""
        self._preemption = None
        if not self.preemption_signals or trainer.state.fn != TrainerFn.FITTING:
            return
        poll = scaled_interval(self.heartbeat_interval or 1.0, self.world_size)  # flat store load at any size
        agreement = PreemptionAgreement(rank=self.global_rank, world_size=self.world_size, poll_interval=poll)
        self._preemption = PreemptionStop(agreement, self._control_plane_or_none, self._finish_async_writes)
        add_callback(trainer, self._preemption, replace=PreemptionStop)
        handle_signals_during_run(trainer, self.preemption_signals, agreement.request, self._deliver_unused_signal)

    def _deliver_unused_signal(self) -> None:
        """After the run's handlers were restored: a signal that led to no stop is delivered again, as if unhandled.

        That is a signal that came after the ranks' last agreement (between ``on_train_end`` and the end of
        ``fit``) or on a rank that failed for another reason: the process's own handling applies (by default it
        ends the process).
        """
        stop = self._preemption
        if stop is None or stop.stopped is not None or stop.agreement.received is None:
            return
        received = stop.agreement.received
        log.warning(
            "ddp_strategy: rank %d received %s after the ranks' last chance to agree on a stop; delivering it again "
            "now that fit has ended.",
            self.global_rank,
            received.name,
        )
        os.kill(os.getpid(), received)

    def _setup_weight_checks(self, trainer: pl.Trainer) -> None:
        """Remember the trainable set DDP was built with, and add the epoch-end (or every-N-steps) weight check."""
        self._train_batches = 0
        self.trainable_set_changes = 0
        fitting = trainer.state.fn == TrainerFn.FITTING
        wrapped = isinstance(self.model, DistributedDataParallel)
        self._trainable = TrainableSetWatcher() if self.track_trainable_set and fitting and wrapped else None
        if self._trainable is not None and isinstance(self.model, DistributedDataParallel):
            self._trainable.track(self.model)
        check = self._weight_check
        if check is not None:
            check.reset()  # added after the callbacks' setup hooks ran: forget a previous fit's steps here
        periodic = check is not None and (check.at_epoch_end or check.every_n_steps is not None)
        if check is not None and periodic and self.world_size > 1 and not has_callback(trainer, check):
            add_callback(trainer, check)

    @override
    def on_train_start(self) -> None:
        # Always checked here, even after the sanity-check validation ran the handshake: user hooks such as
        # on_train_start run in between and may change weights on one rank.
        self._train_loader_reloaded = False  # its batch counts are compared now
        self._run_handshake("train")
        self._warn_about_fork_hazard()
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        if not self._handshake_done:
            self._run_handshake("validate")
        self._sync_buffers_before_evaluation()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        if not self._handshake_done:
            self._run_handshake("test")
        self._sync_buffers_before_evaluation()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        if not self._handshake_done:
            self._run_handshake("predict")
        self._sync_buffers_before_evaluation()
        super().on_predict_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Runs after the callbacks' and the module's on_train_batch_start (and on_train_epoch_start, where
        # BackboneFinetuning unfreezes) and before the forward: a change of requires_grad made there is followed now.
        self._raise_agreed_desync()
        self._train_batches += 1
        trainer = self._trainer_or_none()
        step = trainer.global_step if trainer is not None else 0
        if self._trainable is not None and self._trainable.changed():  # one attribute read per parameter, no I/O
            self._follow_trainable_set(step)
        if self._control is not None:  # after the test: "training step" at this batch count means "went past it"
            epoch = trainer.current_epoch if trainer is not None else None
            self._control.note_step(step, batch=self._train_batches, epoch=epoch, epoch_batch=batch_idx + 1)
        if self._resumed is not None:  # resumed mid-epoch: continue the saved RNG stream from this batch on
            self._restore_rng()
        super().on_train_batch_start(batch, batch_idx)

    def _follow_trainable_set(self, step: int) -> None:
        """Agree with the other ranks on the new trainable set (and on the weights), then rebuild DDP's wrapper."""
        watcher, control = self._trainable, self._control
        if watcher is None or control is None or not isinstance(self.model, DistributedDataParallel):
            return
        start = time.perf_counter()
        change = watcher.current()
        check = self._weight_check
        weights = (
            check.agreement.comparison(
                self.model, when=f"by step {step}", name=f"trainable-set-weights:batch-{self._train_batches}"
            )
            if check is not None
            else None
        )
        agree_on_trainable_set(control, change, batch=self._train_batches, step=step, weights=weights)
        if getattr(self.model, "mixed_precision", None) is not None:  # its hooks sit on the module, bound to the old
            raise DDPStrategyError(
                "The set of trainable parameters changed after DDP was built "
                f"({describe_change(change)}), but DDP's prototype `mixed_precision` option registers hooks on the "
                "module that a rebuilt wrapper cannot take over. Change `requires_grad` before fit, use Lightning's "
                "`precision=` instead of DDP's `mixed_precision`, or pass SafeDDPStrategy(track_trainable_set=False)."
            )
        watcher.track(rebuild_ddp_wrapper(self))
        self.trainable_set_changes += 1
        took = (time.perf_counter() - start) * 1000
        rank_zero_info(
            f"ddp_strategy: the set of trainable parameters changed before training step {step} "
            f"({describe_change(change)}; {change.trainable} parameters require a gradient now). DDP's wrapper was "
            f"rebuilt with the same options, so exactly these are all-reduced ({took:.1f} ms)."
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, Preempted):  # every rank stopped at the agreed step: no failure to name
            super().on_exception(exception)
            return
        self._failed = True
        if self._control is not None and exception is self._control.desync_error:
            # every rank reached this verdict itself: nothing to publish or diagnose; rank 0 shows it first
            if self._desync is not None:
                if self.global_rank == 0:
                    self._desync.rank0_stopping()
                else:
                    self._desync.await_rank0()
            super().on_exception(exception)
            return
        if self._control is not None:
            self._control.note_failure(exception)
            diagnose_failed_peers(self._control, exception)  # logs it, unless a HangWatchdog's on_exception did
            if self.global_rank == 0:  # the store's host: let every peer read the failure before it goes away
                self._control.await_failure_seen()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._log_sites.uninstall()
        self._finish_async_writes()
        diverged: CollectiveMismatchError | None = None
        if self._control is not None:
            try:
                self._compare_strategy_calls()
            except CollectiveMismatchError as err:
                diverged, self._failed = err, True
                if self._desync is not None:  # as on_exception, which runs after the control plane is gone here
                    if self.global_rank == 0:  # every rank has the error from the gather: no verdict to wait for
                        self._desync.rank0_stopping(await_verdicts=False)
                    else:  # rank 0 may be blocked in a backend collective: let it show the error before we exit
                        self._desync.await_rank0()
            # After a failure other ranks may never reach a closing barrier: only close collectively on success.
            try:
                self._control.close(graceful=not self._failed)
            finally:
                self._control = None
                self._desync = None
        super().teardown()
        if diverged is not None:
            raise diverged

    def _compare_strategy_calls(self) -> None:
        """At the end of a stage: every rank made the same strategy collectives, or all raise the same error.

        The heartbeat compares them during the run; a short run may end before it looks. One small gather.
        """
        control, monitor = self._control, self._desync
        if control is None or monitor is None or self._failed:
            return
        gathered = control.all_gather_object((self._call_ledger.state, monitor.update_audit()), name="strategy-calls")
        states = [state for state, _ in gathered]
        difference = first_published_difference([publication for _, publication in gathered])
        if len(set(states)) == 1 and difference is None:
            return
        error = monitor.inquire()
        if error is None and difference is not None:
            group, seq = difference
            error = CollectiveMismatchError(
                f"The ranks made different collective calls: call #{seq} of process group {group} differs between "
                "ranks (its op, tensor shapes or dtypes, or the line of code that made it), too long ago to describe. "
                "Look for a collective in a rank-dependent branch.",
                name=f"collective #{seq}",
                missing_ranks=[],
                reason="desync",
            )
        if error is None:
            counts = ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(states))
            error = CollectiveMismatchError(
                f"The ranks made different collectives through the strategy in this run ({counts} calls; the lists "
                "differ), too long ago to name the first one. Look for `self.log(..., sync_dist=True)`, "
                "`self.all_gather` or `strategy.broadcast` in a rank-dependent branch, or metric names that differ "
                "between ranks.",
                name="strategy-calls",
                missing_ranks=[],
                reason="desync",
            )
        raise error

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Wait for every rank, at most ``barrier_timeout``; see :meth:`ControlPlane.barrier`.

        Args:
            name: the barrier's name, shown in errors and compared across ranks.
            *args: ignored, for signature compatibility with ``DDPStrategy.barrier``.
            **kwargs: ignored, for signature compatibility with ``DDPStrategy.barrier``.

        Raises:
            CollectiveMismatchError: not every rank arrived in time, or ranks arrived at differently named
                barriers.

        """
        if self._control is None or not dist.is_initialized():
            super().barrier(name)
            return
        self._control.barrier(name, site=call_site(skip=2))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce ``tensor`` over ranks, as ``DDPStrategy.reduce``, with two differences.

        A mean of an integer tensor is returned in floating point: Lightning truncates it, in place, so that a
        ``self.log(..., sync_dist=True)`` mean over uneven batch counts (say 5 and 4 samples) was wrong. And inside
        an evaluation step whose ranks take different numbers of steps it raises
        :class:`~ddp_strategy.errors.UnevenEvaluationError` instead of hanging.
        """
        if isinstance(tensor, Tensor):
            if self.exact_evaluation_coordinator is not None:
                self._exact.check_collective("`reduce` (from `self.log(..., on_step=True, sync_dist=True)`)")
            if str(reduce_op).lower() in ("mean", "avg") and not torch.is_floating_point(tensor):
                tensor = tensor.double()
        if self._desync is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        self._raise_agreed_desync()
        logged = logged_metric_of_caller()
        shape = f"{tensor.dtype}{list(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
        self._call_ledger.add(f"reduce {'.'.join(logged) if logged else ''} {shape} {reduce_op}")
        note = self._call_notes.begin(self._log_sites.describe(*logged) if logged else "strategy.reduce")
        try:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        finally:
            self._call_notes.end(note)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self.exact_evaluation_coordinator is not None:
            self._exact.check_collective("`all_gather` (e.g. `self.all_gather`)")
        if self._desync is None:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        self._raise_agreed_desync()
        self._call_ledger.add(
            f"all_gather {tensor.dtype}{list(tensor.shape)}" if isinstance(tensor, Tensor) else "all_gather"
        )
        if isinstance(tensor, Tensor):
            check_gather_shapes(tensor, group=group, device=self.root_device, site=call_site(skip=2))
        note = self._call_notes.begin("self.all_gather / strategy.all_gather")
        try:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        finally:
            self._call_notes.end(note)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._desync is None:
            return super().broadcast(obj, src)
        self._raise_agreed_desync()
        self._call_ledger.add(f"broadcast {src}")
        note = self._call_notes.begin(f"strategy.broadcast(obj, src={src})")
        try:
            return super().broadcast(obj, src)
        finally:
            self._call_notes.end(note)

    # ------------------------------------------------------------------ exact evaluation
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _evaluation_step(
        self, hook: str, context: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # With exact evaluation the ranks take different numbers of steps, so the step must not go through the
        # DDP wrapper's forward (its first call broadcasts buffers: a hidden collective). The buffers are synced
        # once, by every rank, when the loop starts (see `_sync_buffers_before_evaluation`).
        self._raise_agreed_desync()
        if self.exact_evaluation_coordinator is None:
            return getattr(super(), hook)(*args, **kwargs)
        assert self.lightning_module is not None
        with context(), self._exact.step(hook):
            return getattr(self.lightning_module, hook)(*args, **kwargs)

    def _sync_buffers_before_evaluation(self) -> None:
        if self.exact_evaluation_coordinator is not None:
            sync_buffers_before_evaluation(self.model)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        """Collective save: every rank's RNG state goes into the file rank 0 writes; all ranks learn the outcome.

        With ``weight_check`` on (the default), the ranks' weight fingerprints travel with the RNG states, and the
        checkpoint is written only when every rank holds the same weights.

        Raises:
            CheckpointWriteError: on every rank when the write failed; the previous checkpoint is intact.
            RankDivergenceError: on every rank when the ranks' weights differ; nothing was written.

        """
        if self._control is None:
            self._save_outside_a_run(checkpoint, filepath, storage_options)
            return
        self._collective_save(self._control, checkpoint, filepath, storage_options, asynchronous=self.async_save)

    def _save_outside_a_run(
        self, checkpoint: dict[str, Any], filepath: CheckpointPath, storage_options: Any | None
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
            control = ControlPlane.create_after_barrier(timeout=self.barrier_timeout, name=name, site=call_site())
            saved = False
            try:
                self._collective_save(control, checkpoint, filepath, storage_options, asynchronous=False)
                saved = True
            finally:
                control.close(graceful=saved)
            return
        reason = (
            "by a process that was not one of the training ranks (the spawn launcher's main process after the run, "
            "or before any stage started): the ranks' RNG states were gone"
        )
        section = {**package_state(checkpoint), **self._layout_entry(), NO_RNG_REASON_KEY: reason}
        super().save_checkpoint({**checkpoint, PACKAGE_KEY: section}, filepath, storage_options=storage_options)

    def _collective_save(
        self,
        control: ControlPlane,
        checkpoint: dict[str, Any],
        filepath: CheckpointPath,
        storage_options: Any | None,
        *,
        asynchronous: bool,
    ) -> None:
        def write(final: dict[str, Any]) -> None:
            if not asynchronous:
                self.checkpoint_io.save_checkpoint(final, filepath, storage_options=storage_options)
                return
            if self._writer is None:
                self._writer = AsyncCheckpointWriter(self.checkpoint_io)
            trainer = self._trainer_or_none()
            deferred = deferrable_tensors(trainer) if trainer is not None and self._overlap_snapshots else None
            previous = self._writer.submit(final, str(filepath), storage_options, deferred=deferred)
            if previous is not None:
                raise CheckpointWriteError(
                    f"An earlier asynchronous checkpoint write failed: {previous}", path=str(filepath)
                )

        trainer = self._trainer_or_none()
        step = trainer.global_step if trainer is not None else int(checkpoint.get("global_step", 0))
        check = self._weight_check
        weights = (
            check.agreement.comparison(
                self.model, when=f"by step {step}", name=f"checkpoint-weights:{os.path.basename(str(filepath))}"
            )
            if check is not None and self.model is not None
            else None
        )
        protocol.save(
            control=control,
            write=write,
            checkpoint=checkpoint,
            path=str(filepath),
            is_writer=self._is_writer,
            every_writer_needs_states=self.save_on == "node_zero",
            weights=weights,
            section=self._layout_entry(),
        )
        if check is not None and weights is not None:
            check.agreement.last_step = step  # the ranks agreed at this step: the epoch-end check need not repeat it

    def _layout_entry(self) -> dict[str, Any]:
        layout = self.bucket_layout.state()
        return {BUCKET_LAYOUT_KEY: layout} if layout is not None else {}

    @property
    def _is_writer(self) -> bool:
        return self.local_rank == 0 if self.save_on == "node_zero" else self.is_global_zero

    @override
    def remove_checkpoint(self, filepath: CheckpointPath) -> None:
        """Remove a checkpoint on each writer; with ``async_save``, only after the write in flight has succeeded."""
        if not self._is_writer:
            return
        if self._writer is not None:
            self._writer.remove_checkpoint(str(filepath))
        else:
            self.checkpoint_io.remove_checkpoint(filepath)

    @property
    def _overlap_snapshots(self) -> bool:
        """Whether asynchronous saves during training copy parameters and optimizer state beside the next step."""
        return self.async_snapshot == "overlap"

    @property
    def async_writer(self) -> AsyncCheckpointWriter | None:
        """This rank's ``async_save`` writer, from its first asynchronous write until the teardown; else ``None``."""
        return self._writer

    def _wait_for_snapshot(self) -> None:
        """Block until the overlapped snapshot of the last asynchronous save is copied (weights may change after)."""
        if self._writer is not None:
            self._writer.wait_for_snapshot()

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step; with an asynchronous writer, the closure waits for a pending snapshot.

        The wait is after the closure (forward and backward, which run beside the copy) and before the update. It
        is installed whenever a writer exists, also when nothing is pending yet: a save made inside
        ``training_step`` starts its copy during the closure. After the step, DDP's pending bucket rebuild runs (see
        :mod:`ddp_strategy.bucket_layout`).
        """
        writer = self._writer
        if writer is None:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:

            def closure_then_wait_for_snapshot() -> Any:
                result = closure()  # forward and backward ran beside the copy; the update below must not
                writer.wait_for_snapshot()
                return result

            output = super().optimizer_step(optimizer, closure_then_wait_for_snapshot, model, **kwargs)
        self.bucket_layout.after_optimizer_step(self.model)  # a checkpoint from now on holds the next step's layout
        return output

    def _finish_async_writes(self) -> None:
        """Wait for the last asynchronous write of every writer and make every rank agree on its outcome."""
        if not self.async_save:
            return
        writer, self._writer = self._writer, None
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

        if self._control is None or self._failed:
            try:
                last_write()
            except CheckpointWriteError as err:
                log.warning(
                    "ddp_strategy: the last asynchronous checkpoint write of rank %d failed: %s", self.global_rank, err
                )
            return
        try:
            self._control.agree("checkpoint-async-final", last_write, first_failure(last_write_error))
        except CheckpointWriteError:
            self._failed = True
            raise

    @override
    def load_checkpoint(self, checkpoint_path: CheckpointPath, weights_only: bool | None = None) -> dict[str, Any]:
        """Rank 0 verifies (and for ``last`` falls back), every rank loads the agreed file onto its own device.

        Raises:
            FileNotFoundError: the checkpoint does not exist.
            CheckpointIntegrityError: the checkpoint is damaged and no fallback applies.
            UnsafeCheckpointError: the checkpoint carries pickled objects and ``weights_only=False`` was not given.

        """
        torch.cuda.empty_cache()
        if self._writer is not None:  # never read a file that is still being written
            error = self._writer.wait()
            if error is not None:
                raise CheckpointWriteError(f"An earlier asynchronous checkpoint write failed: {error}", path="")

        def read(path: str) -> dict[str, Any]:
            return self.checkpoint_io.load_checkpoint(path, map_location=self.root_device, weights_only=weights_only)

        if self._control is None:
            checkpoint = read(str(checkpoint_path))
            self.bucket_layout.resume_from(checkpoint.get(PACKAGE_KEY))
            return checkpoint
        chosen, checkpoint = protocol.load(control=self._control, read=read, path=str(checkpoint_path))
        self.bucket_layout.resume_from(checkpoint.get(PACKAGE_KEY))
        protocol.check_resumable(checkpoint, chosen)
        self._loaded_path = chosen
        after_last_batch = protocol.saved_after_last_batch(checkpoint)
        self._resumed = {
            PACKAGE_KEY: checkpoint.get(PACKAGE_KEY),
            "global_step": checkpoint.get("global_step", 0),
            "skip_batches": protocol.batches_done_mid_epoch(
                checkpoint, last_batch_ends_epoch=LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH
            ),
            # saved after an epoch's last batch: Lightning >= 2.5 resumes with the next epoch, but counts it only
            # later; Lightning 2.4 re-enters the saved epoch and ends it without a batch
            "epochs_ahead": int(LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH and after_last_batch),
            "restore_at_next_epoch": not LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH and after_last_batch,
            "before_training": protocol.saved_before_training(checkpoint),
        }
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        try:
            super().load_model_state_dict(checkpoint, strict=strict)
        except RuntimeError as err:  # torch's strict-loading error: list the keys and say what to do
            module = self.lightning_module
            if not strict or module is None or "Error(s) in loading state_dict" not in str(err):
                raise
            path = getattr(self, "_loaded_path", "the checkpoint")
            try:
                protocol.check_model_keys(dict(checkpoint), list(module.state_dict()), path, type(module).__name__)
            except CheckpointMismatchError as mismatch:
                raise mismatch from err
            raise

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Lightning creates the first training iterator of a run before `on_train_epoch_start` sets the sampler
        # epoch, so a resumed run would shuffle (and, with workers, prefetch) with epoch 0's order. Set the epoch
        # now, and restore the RNG state right before that iterator draws its seed, as the uninterrupted run did.
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        self._train_loader_reloaded = True  # on every rank in the same epoch: the Trainer's reload schedule
        epoch = epochs_processed(trainer)
        if self._resumed is not None:  # the fit loop's reset, after this, counts an epoch ended by the saved batch
            epoch += int(self._resumed["epochs_ahead"])
        set_sampler_epoch(dataloader, epoch)
        if self._resumed is None:
            return dataloader
        skip = int(self._resumed["skip_batches"])
        if skip:  # resumed mid-epoch: continue after the batches already trained on; RNG at the first batch
            count_checkpointed_batch_as_completed(trainer)
            resumed = skip_consumed_batches(dataloader, skip, epoch)
            if resumed is not None and self._resumed["restore_at_next_epoch"]:
                restore_when_the_epoch_loop_starts(trainer, self._restore_rng)
            if resumed is None:
                rank_zero_warn(
                    f"ddp_strategy: resuming in the middle of an epoch ({skip} batches done), but the training "
                    f"dataloader ({type(dataloader).__name__}) has no standard BatchSampler to skip them with, so "
                    "this epoch starts over from its first batch. Checkpoint at epoch ends for exact resumption."
                )
            return resumed if resumed is not None else dataloader
        # Persistent workers: the uninterrupted run drew no seed here (restore at the first batch), unless it was
        # saved before fit, whose first iterator the uninterrupted run created here too.
        fresh_iterator = self._resumed["before_training"] or not _persistent_workers(dataloader)
        if fresh_iterator and not restore_before_second_train_iterator(trainer, self._restore_rng):
            self._restore_rng()
        return dataloader

    def _restore_rng(self) -> None:
        if self._resumed is None:
            return
        warning = protocol.restore_rng(self._resumed, rank=self.global_rank, world_size=self.world_size)
        if self._resumed["before_training"]:  # saved before fit: the uninterrupted fit re-seeded at its set-up
            reseed_as_fit_does()
        self._resumed = None
        if warning is not None:
            rank_zero_warn(warning)

    # ------------------------------------------------------------------ handshake
    def _rank_facts(self, with_tensors: bool, training: bool = False) -> RankFacts:
        trainer = self._trainer_or_none()
        return collect_facts(
            rank=self.global_rank,
            local_rank=self.local_rank,
            node_rank=self.node_rank,
            world_size=self.world_size,
            device=self.root_device,
            module=self.model if with_tensors else None,
            sampler_seeds=train_sampler_seeds(trainer) if with_tensors else None,
            training_batches=trainer.num_training_batches if training and trainer is not None else None,
        )

    def _trainer_or_none(self) -> pl.Trainer | None:
        return trainer_of(self.lightning_module)

    def _check_devices(self) -> None:
        """Early device check, before any data-plane collective can touch a shared GPU."""
        assert self._control is not None
        check_devices(self._control.all_gather_object(self._rank_facts(False), name="device-check"))

    def _run_handshake(self, stage: str) -> None:
        if not self.handshake_enabled or self._control is None:
            return
        assert self.model is not None  # set by connect() before any stage starts
        start = time.perf_counter()
        facts = self._rank_facts(True, training=stage == "train")
        gathered = self._control.all_gather_object(facts, name=f"handshake:{stage}", site=call_site(skip=2))
        check_facts(gathered)
        self._check_training_batches(gathered)
        self.last_handshake_seconds = time.perf_counter() - start
        self._handshake_done = True
        warning = seed_report(gathered)
        if warning is not None:
            rank_zero_warn(warning)
        summary = seed_summary(gathered)
        if summary is not None:
            rank_zero_info(summary)
        rank_zero_info(
            f"ddp_strategy: {stage} handshake passed on {self.world_size} rank(s) "
            f"({len(facts.tensors)} tensors compared) in {self.last_handshake_seconds * 1000:.1f} ms"
        )

    def _warn_about_fork_hazard(self) -> None:
        trainer = self._trainer_or_none()
        if trainer is None or not self.is_global_zero or self.collective_threads_pinned:
            return
        val = trainer.val_dataloaders
        loaders = [("training", loader) for loader in training_dataloaders(trainer)]
        loaders += [("validation", loader) for loader in (val if isinstance(val, list | tuple) else [val])]
        warning = fork_hazard(loaders, world_size=self.world_size)
        if warning is not None:
            rank_zero_warn(warning)

    def _check_training_batches(self, gathered: list[RankFacts]) -> None:
        message = check_training_batches(gathered) if self.uneven_inputs is not None else None
        self._act_on_uneven_inputs(message, [f.training_batches or 0.0 for f in gathered])

    def _check_reloaded_training_batches(self, trainer: pl.Trainer) -> None:
        """At an epoch start after the training dataloader was reloaded: compare the ranks' new batch counts.

        Every rank reloads in the same epoch (the Trainer's ``reload_dataloaders_every_n_epochs``), so every rank
        decides alike whether to gather; without a reload this costs one attribute read.
        """
        if not self._train_loader_reloaded:
            return
        self._train_loader_reloaded = False
        if self.uneven_inputs is None or not self.handshake_enabled or self._control is None:
            return
        epoch = trainer.current_epoch
        counts = self._control.all_gather_object(
            float(trainer.num_training_batches), name=f"training-batches:epoch-{epoch}"
        )
        self._act_on_uneven_inputs(compare_training_batches(counts, epoch=epoch), counts)

    def _act_on_uneven_inputs(self, message: str | None, counts: Sequence[float]) -> None:
        if message is None:
            return
        if self.uneven_inputs == "warn":
            rank_zero_warn(f"ddp_strategy: {message}")
            return
        raise UnevenInputsError(message, batches=counts)


def _elastic_attempt_store(world_size: int, timeout: timedelta | None) -> Any:
    """Under a restarted torchrun job, the agent's store seen through a namespace of this attempt; else ``None``.

    torchrun (c10d rendezvous) shares its agent's TCPStore with the workers and keeps it across restarts, but
    ``init_process_group(init_method="env://")`` no longer namespaces its keys by attempt, so the restarted workers
    read the previous attempt's gloo/NCCL addresses and fail with "Connection refused" (pytorch/pytorch#135712).
    Prefixing with ``TORCHELASTIC_RESTART_COUNT``, as torch itself did before, keeps every attempt apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return None
    client = dist.TCPStore(  # type: ignore[attr-defined]
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,
        timeout=timeout if timeout is not None else timedelta(minutes=30),
    )
    return dist.PrefixStore(f"/worker/attempt_{attempt}", client)  # type: ignore[attr-defined]
