"""``SafeDDPStrategy``: Lightning's DDP strategy, with every cross-rank mistake turned into a named error.

Each Lightning hook hands off to the object owning its feature (docs/architecture.md: the strategy's feature objects).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from torch import Tensor
from typing_extensions import override

from ._compat.launchers import configure_launcher
from ._compat.lightning import (
    CheckpointPath,
    DDPStrategy,
    StrategyRegistryType,
    ddp_settings,
    global_step_reader,
    pl,
    trainer_of,
)
from .bucket_layout import BucketLayoutKeeper
from .callbacks.sharding_check import ensure_sharding_check
from .checkpoint.async_writer import AsyncCheckpointWriter
from .checkpoint.io import SafeCheckpointIO
from .collective_calls import all_reduce_value, mean_in_floating_point
from .control import ControlPlane
from .evaluation.coordinator import ExactEvaluation
from .features import build_features
from .host import Delegated
from .options import DEFAULT_BARRIER_TIMEOUT, StrategyOptions, options_to_agree
from .positions import call_site
from .preemption import DEFAULT_PREEMPTION_SIGNALS, exit_code

__all__ = ["DEFAULT_BARRIER_TIMEOUT", "SafeDDPStrategy"]

#: The strategy's ``reduce`` in an ``UnevenEvaluationError``.
_REDUCE_CALL = "`reduce` (from `self.log(..., on_step=True, sync_dist=True)`)"


def _no_step() -> int:
    """The step outside a fit's training (no Trainer to read it from)."""
    return 0


class SafeDDPStrategy(DDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` with cross-rank safety checks.

    It accepts every argument ``DDPStrategy`` accepts (extra keyword arguments go to
    :class:`torch.nn.parallel.DistributedDataParallel`), plus its own options, documented and validated by
    :class:`~ddp_strategy.options.StrategyOptions` (and readable as attributes, e.g. ``strategy.barrier_timeout``).
    On top of DDP: a control plane of its own (a gloo group and the rendezvous store), a start-up handshake before
    each stage, monitored named barriers (:class:`~ddp_strategy.errors.CollectiveMismatchError` instead of a hang),
    desync detection, the trainable set followed (DDP rebuilt when ``requires_grad`` changes), weight agreement
    before saves and at epoch ends (:class:`~ddp_strategy.errors.RankDivergenceError`), crash-safe checkpoints and
    bit-exact resume, exact evaluation, and an agreed stop on preemption signals (docs/architecture.md).

    Use it as ``Trainer(strategy=SafeDDPStrategy(...))`` or, after ``import ddp_strategy``,
    ``Trainer(strategy="safe_ddp")`` (``"safe_ddp_spawn"`` for the spawn launcher).

    Raises:
        ValueError: an option is not one of its values (see :meth:`StrategyOptions.from_arguments`).

    """

    strategy_name = "safe_ddp"

    barrier_timeout = Delegated[timedelta]("options")
    heartbeat_interval = Delegated[float]("options")
    async_save = Delegated[bool]("options")
    async_snapshot = Delegated[str]("options")
    save_on = Delegated[str]("options")
    sharding_check = Delegated[str | None]("options")
    uneven_inputs = Delegated[str | None]("options")
    weight_check = Delegated[str | int | None]("options")
    track_trainable_set = Delegated[bool]("options")
    preemption_signals = Delegated[tuple[signal.Signals, ...]]("options")
    desync_detection = Delegated[bool]("options")

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
        rendezvous_report_interval: float = 30.0,
        rendezvous_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if "checkpoint_io" not in kwargs and len(args) < 4:  # DDPStrategy's 4th positional is checkpoint_io
            kwargs["checkpoint_io"] = SafeCheckpointIO()
        super().__init__(*args, **kwargs)
        #: The user's line that made this strategy (named when ranks were given different options).
        self.made_at = call_site(skip=2)
        #: This strategy's own options, validated (see :class:`~ddp_strategy.options.StrategyOptions`).
        self.options = options = StrategyOptions.from_arguments(
            barrier_timeout=barrier_timeout, handshake=handshake, heartbeat_interval=heartbeat_interval,
            async_save=async_save, async_snapshot=async_snapshot, save_on=save_on, exact_evaluation=exact_evaluation,
            predictions_on=predictions_on, sharding_check=sharding_check, uneven_inputs=uneven_inputs,
            weight_check=weight_check, weight_check_exclude=weight_check_exclude,
            track_trainable_set=track_trainable_set, preemption_signals=preemption_signals,
            desync_detection=desync_detection, rendezvous_report_interval=rendezvous_report_interval,
            rendezvous_timeout=rendezvous_timeout,
        )  # fmt: skip
        #: DDP's gradient-bucket layout, saved in checkpoints and restored on resume (bit-exact at 3+ ranks).
        self.bucket_layout = BucketLayoutKeeper()
        # One object per feature, wired together in features.py (the strategy still pickles: spawn launcher).
        f = build_features(self, options, self.bucket_layout)
        self._calls, self._lifecycle, self._handshakes = f.calls, f.lifecycle, f.handshakes
        self._evaluation, self._weights, self._saving = f.evaluation, f.weights, f.saving
        self._resume, self._preemption, self._unused = f.resume, f.preemption, f.unused
        self._fit_trainer: pl.Trainer | None = None  # from on_train_start to teardown: read at every batch's start
        self._global_step: Callable[[], int] = _no_step  # its global_step, read so (_compat.global_step_reader)

    # ------------------------------------------------------------------ attributes
    #: The control plane, available between ``setup_environment`` and ``teardown``.
    control_plane = Delegated[ControlPlane | None]("_lifecycle", "control")
    #: Whether the start-up handshake runs (the ``handshake`` option).
    handshake_enabled = Delegated[bool]("_handshakes", "enabled")
    #: Whether exact evaluation is on (the option; off once a Trainer's loops could not be replaced).
    exact_evaluation = Delegated[bool]("_evaluation", "enabled")
    #: Seconds the last start-up handshake took on this rank (``None`` before the first one).
    last_handshake_seconds = Delegated[float | None]("_handshakes", "last_seconds")
    #: Whether the gloo worker threads of the process groups keep a Python thread state (see fork_safety).
    collective_threads_pinned = Delegated[bool]("_lifecycle")
    #: Asynchronous saves on this rank whose snapshot overlapped training (``async_snapshot="overlap"``).
    overlapped_saves = Delegated[int]("_saving")
    #: How many times the set of trainable parameters changed, and DDP's wrapper was rebuilt, in the last fit.
    trainable_set_changes = Delegated[int]("_weights")
    #: Rank 0's background checkpoint writer while an ``async_save`` write may be in flight, else ``None``.
    async_writer = Delegated[AsyncCheckpointWriter | None]("_saving", "writer")

    @property
    def agreed_options(self) -> dict[str, str]:
        """The options every rank must be given alike, as text (:func:`~ddp_strategy.options.options_to_agree`).

        The rendezvous and the handshakes compare them: ranks given different ones raise ``SetupMismatchError``.
        """
        return options_to_agree(self.options, backend=self.process_group_backend, ddp_settings=ddp_settings(self))

    @property
    def exact_evaluation_coordinator(self) -> ExactEvaluation | None:
        """The exact-evaluation coordinator while it is in effect (``exact_evaluation`` and several ranks)."""
        return self._evaluation.coordinator(self.world_size)

    # ------------------------------------------------------------------ registration and life cycle
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register ``"safe_ddp"`` (subprocess launcher) and ``"safe_ddp_spawn"`` (spawn launcher)."""
        for name, start_method in (("safe_ddp", "popen"), ("safe_ddp_spawn", "spawn")):
            description = f"SafeDDPStrategy (checked DDP) with start_method '{start_method}'"
            strategy_registry.register(name, cls, description, override=True, start_method=start_method)

    @override
    def _configure_launcher(self) -> None:
        # A private Lightning hook, but the only place a strategy sets its launcher (the seam does the private part):
        # the spawn launcher's main process exits with the ranks' preemption code; a backend error that diverged
        # collectives caused is replaced by the error the ranks agreed on.
        super()._configure_launcher()
        signals = self.options.preemption_signals
        codes = frozenset(exit_code(sig) for sig in signals)
        configure_launcher(self, codes, tuple(int(sig) for sig in signals), self._error_instead)

    def _error_instead(self, error: BaseException) -> BaseException | None:
        # DDP's error for a parameter without a gradient, named; or the desync error every rank agreed on
        named = self._unused.error_instead(self.model, error, self._trainer_or_none())
        return named if named is not None else self._lifecycle.agreed_error_instead(error)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._lifecycle.start(self)
        self._resume.agree_on_path(self._trainer_or_none())
        self._handshakes.check_devices(self)

    @override
    def setup_distributed(self) -> None:
        # As DDPStrategy's, but NCCL starts lazily, so two ranks on one GPU reach the device check (see lifecycle)
        self._lifecycle.create_process_group(self)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._evaluation.setup(trainer, self.world_size)
        if self.sharding_check is not None and self.world_size > 1:
            ensure_sharding_check(trainer, "raise" if self.sharding_check == "raise" else "warn")
        self._saving.setup(trainer)
        self._weights.setup(trainer, self.model, self.world_size)
        self._preemption.setup(trainer, rank=self.global_rank, world_size=self.world_size)
        self._handshakes.setup(trainer, self.world_size)
        if self.desync_detection and self.lightning_module is not None:
            self._calls.log_sites.install(self.lightning_module)

    @override
    def configure_ddp(self) -> None:
        # a resumed run starts with the saved run's gradient buckets (see bucket_layout)
        self.bucket_layout.world_size = self.world_size
        with self.bucket_layout.constructing(self.lightning_module):  # type: ignore[arg-type]
            super().configure_ddp()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._lifecycle.on_exception(exception, self.global_rank)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._fit_trainer, self._global_step = None, _no_step
        self._calls.log_sites.uninstall()
        self._saving.finish_async_writes()
        diverged = self._lifecycle.close(self.global_rank)
        super().teardown()
        if diverged is not None:
            raise diverged

    # ------------------------------------------------------------------ stages and steps
    @override
    def on_train_start(self) -> None:
        # Always checked here, even after the sanity-check validation ran the handshake: user hooks such as
        # on_train_start run in between and may change weights on one rank.
        self._handshakes.run("train", self)
        self._lifecycle.warn_about_fork_hazard(self)
        self._fit_trainer = trainer = self._trainer_or_none()
        self._global_step = global_step_reader(trainer) if trainer is not None else _no_step
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        self._before_evaluation("validate")
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._before_evaluation("test")
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._before_evaluation("predict")
        super().on_predict_start()

    def _before_evaluation(self, stage: str) -> None:
        self._handshakes.run_once(stage, self)
        self._evaluation.before_loop(self.model, self.world_size)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Runs after the callbacks' and the module's on_train_batch_start (and on_train_epoch_start, where
        # BackboneFinetuning unfreezes) and before the forward: a change of requires_grad made there is followed now.
        # Every step: attribute tests where there is nothing to do (bench/call_count.py counts the calls).
        self._lifecycle.raise_agreed_desync()
        trainer = self._fit_trainer
        step = self._global_step()
        batches = self._weights.on_train_batch_start(self, step, self._lifecycle.control)
        self._lifecycle.note_step(trainer, step, batches, batch_idx)  # after the test: "went past" this batch count
        if self._resume.state is not None:  # resumed mid-epoch: continue the saved RNG stream from this batch on
            self._resume.restore_rng()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", super().predict_step, args, kwargs)

    def _evaluation_step(
        self, hook: str, default: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self._lifecycle.raise_agreed_desync()
        return self._evaluation.run(hook, default, self, args, kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self.model is not self._unused.checked:  # the first backward of each DDP wrapper; else nothing to do
            self._unused.after_backward(self.model, self.lightning_module, self._trainer_or_none())

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's step; the update waits for a pending snapshot, then DDP's bucket rebuild runs (bucket_layout)."""
        # Every step: attribute tests where there is nothing to do (no asynchronous writer; the rebuild has run)
        if self._saving.writer is not None:
            closure = self._saving.closure_waiting_for_snapshot(closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        wrapper = self.model
        if wrapper is not self.bucket_layout.settled:  # a checkpoint from now on holds the next step's layout
            self.bucket_layout.after_optimizer_step(wrapper)
        return output

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """A monitored barrier ``name`` (:meth:`ControlPlane.barrier`): ``CollectiveMismatchError``, never a hang."""
        self._lifecycle.barrier(name, super().barrier)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """``DDPStrategy.reduce`` by one collective, no barrier (:func:`all_reduce_value`); exact int means.

        Raises ``UnevenEvaluationError`` in an uneven evaluation step.
        """
        if isinstance(tensor, Tensor):
            self._evaluation.check_collective(_REDUCE_CALL)
            if not tensor.is_floating_point():  # one method call for the usual float value
                tensor = mean_in_floating_point(tensor, reduce_op)
        return self._calls.reduce(all_reduce_value, tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self._evaluation.check_collective("`all_gather` (e.g. `self.all_gather`)")
        return self._calls.all_gather(super().all_gather, tensor, group, sync_grads, self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._calls.broadcast(super().broadcast, obj, src)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        """Collective save (:meth:`CheckpointSaving.save`); on failure every rank raises, the old file intact."""
        self._saving.save(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: CheckpointPath) -> None:
        """Remove a checkpoint on each writer; with ``async_save``, only after the write in flight has succeeded."""
        self._saving.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: CheckpointPath, weights_only: bool | None = None) -> dict[str, Any]:
        """Rank 0 verifies (``last`` falls back), every rank loads the agreed file; see :meth:`ExactResume.load`."""
        return self._resume.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        try:
            super().load_model_state_dict(checkpoint, strict=strict)
        except RuntimeError as err:  # torch's strict-loading error: list the keys and say what to do
            self._resume.explain_model_keys(err, checkpoint, self.lightning_module if strict else None)
            raise

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        self._handshakes.training_loader_loaded(trainer)  # on every rank in the same epoch: the Trainer's schedule
        return self._resume.training_dataloader(dataloader, trainer)

    # ------------------------------------------------------------------ helpers
    def _trainer_or_none(self) -> pl.Trainer | None:
        return trainer_of(self.lightning_module)
