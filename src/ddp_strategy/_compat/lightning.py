"""Every Lightning name ``ddp_strategy`` uses, bound to one Lightning namespace, with the version shims.

This module is loaded twice when both packages are installed: as ``ddp_strategy._compat.lightning`` it binds to
``lightning.pytorch`` / ``lightning.fabric``; as ``ddp_strategy.pytorch_lightning._compat.lightning`` (see
:mod:`ddp_strategy.pytorch_lightning`) to the standalone ``pytorch_lightning`` / ``lightning_fabric``. The two
packages are copies of one source with separate class hierarchies, so a ``pytorch_lightning.Trainer`` accepts only
strategies and callbacks built on ``pytorch_lightning``'s classes.

Public names are re-exported as they are. Private ones are reached only through the functions below, whose names
say what they do; a Lightning release that changes one of them is a change here (or in the seam's modules that
import this one: :mod:`~ddp_strategy._compat.launchers`, :mod:`~ddp_strategy._compat.loops`) only. Supported
releases: :data:`ddp_strategy._compat.SUPPORTED_LIGHTNING`.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from importlib import import_module, metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import SUPPORTED_LIGHTNING, supports_lightning
from .torch import ddp_comm_hooks, detach_ddp_reducer, reset_per_bucket_hook_state

__all__ = [
    "FIT_TAKES_WEIGHTS_ONLY",
    "LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH",
    "NAMESPACE",
    "VERSION",
    "Callback",
    "CheckpointIO",
    "CheckpointPath",
    "DDPStrategy",
    "IndexBatchSamplerWrapper",
    "RunningStage",
    "StrategyRegistry",
    "TrainerFn",
    "UnrepeatedDistributedSampler",
    "add_callback",
    "collect_rng_states",
    "count_checkpointed_batch_as_completed",
    "current_hook_name",
    "dataloader_init_args",
    "ddp_settings",
    "destroy_default_process_group",
    "epochs_processed",
    "fabric",
    "find_callback",
    "global_step_reader",
    "has_callback",
    "init_default_process_group",
    "last_checkpoint_path",
    "logged_metric_of_caller",
    "move_data_to_device",
    "pl",
    "rank_zero_info",
    "rank_zero_warn",
    "rebuild_ddp_wrapper",
    "reinstantiate_dataloader",
    "remove_callbacks",
    "reseed_as_fit_does",
    "restore_before_second_train_iterator",
    "restore_when_the_epoch_loop_starts",
    "route_resume_path",
    "set_rng_states",
    "set_sampler_epoch",
    "trainer_of",
    "training_dataloaders",
    "training_progress",
    "unwrap_index_batch_sampler",
    "update_dataloader",
    "uses_distributed_sampler",
    "wrap_evaluation_dataloader_preparation",
]

#: Which Lightning package this copy of ``ddp_strategy`` is bound to: ``"lightning"`` or ``"pytorch_lightning"``.
NAMESPACE = "pytorch_lightning" if __name__.startswith("ddp_strategy.pytorch_lightning.") else "lightning"
_PL, _FABRIC = (
    ("pytorch_lightning", "lightning_fabric")
    if NAMESPACE == "pytorch_lightning"
    else ("lightning.pytorch", "lightning.fabric")
)

if TYPE_CHECKING:
    import lightning.fabric as fabric
    import lightning.pytorch as pl
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper as IndexBatchSamplerWrapper
else:
    for _sub in (
        "strategies.registry",
        "utilities.apply_func",
        "utilities.data",
        "utilities.distributed",
        "utilities.seed",
    ):
        import_module(f"{_FABRIC}.{_sub}")
    for _sub in ("trainer.states", "utilities.data", "callbacks", "strategies", "strategies.launchers.multiprocessing"):
        import_module(f"{_PL}.{_sub}")
    fabric = import_module(_FABRIC)
    pl = import_module(_PL)
    _overrides = import_module(f"{_PL}.overrides.distributed")
    #: Lightning's wrapper that records batch indices for ``trainer.predict``.
    IndexBatchSamplerWrapper = _overrides._IndexBatchSamplerWrapper
    #: Lightning's unpadded ``DistributedSampler``: the ``batch_sampler.sampler`` stock ``trainer.predict`` gives each
    #: rank (a subclass of it, ``UnrepeatedDistributedSamplerWrapper``). Same module in Lightning 2.4 to 2.6.
    UnrepeatedDistributedSampler = _overrides.UnrepeatedDistributedSampler

#: The bound package's version, e.g. ``"2.6.6"``.
VERSION: str = metadata.version(NAMESPACE.replace("_", "-"))


if not supports_lightning(VERSION):
    raise ImportError(
        f"ddp_strategy supports {NAMESPACE}{','.join(SUPPORTED_LIGHTNING)}, but {NAMESPACE} {VERSION} is installed. "
        f"Install a supported release: pip install '{NAMESPACE.replace('_', '-')}{','.join(SUPPORTED_LIGHTNING)}'."
    )

# ---------------------------------------------------------------------------------------------- public names
Callback = pl.callbacks.Callback
DDPStrategy = pl.strategies.DDPStrategy
StrategyRegistry = pl.strategies.StrategyRegistry
RunningStage = pl.trainer.states.RunningStage
TrainerFn = pl.trainer.states.TrainerFn
CheckpointIO = fabric.plugins.CheckpointIO
rank_zero_warn = pl.utilities.rank_zero_warn
rank_zero_info = pl.utilities.rank_zero_info
move_data_to_device = fabric.utilities.apply_func.move_data_to_device
#: Whether ``Trainer.fit``/``validate``/``test``/``predict`` take ``weights_only`` (Lightning >= 2.6).
FIT_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(pl.Trainer.fit).parameters
#: Whether a checkpoint saved in ``on_train_batch_end`` of an epoch's last batch resumes with the next epoch
#: (Lightning >= 2.5.0: ``FitLoop.reset`` counts the saved epoch as processed); before, the run re-entered the saved
#: epoch with no batch left of it.
LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH = hasattr(
    import_module(f"{_PL}.loops.training_epoch_loop")._TrainingEpochLoop, "restarted_on_train_batch_end"
)
#: What Lightning accepts as a checkpoint path.
CheckpointPath = str | Path
#: The type of the registry passed to ``Strategy.register_strategies``.
StrategyRegistryType = fabric.strategies.registry._StrategyRegistry

# ---------------------------------------------------------------------------------------------- private: RNG, data
collect_rng_states: Callable[..., dict[str, Any]] = fabric.utilities.seed._collect_rng_states
set_rng_states: Callable[[dict[str, Any]], None] = fabric.utilities.seed._set_rng_states
set_sampler_epoch: Callable[[object, int], None] = fabric.utilities.data._set_sampler_epoch


def unwrap_index_batch_sampler(batch_sampler: object) -> object:
    """The batch sampler inside Lightning's predict index wrapper (``batch_sampler`` itself when not wrapped)."""
    if isinstance(batch_sampler, IndexBatchSamplerWrapper):
        return batch_sampler._batch_sampler
    return batch_sampler


def dataloader_init_args(dataloader: Any, sampler: Any, mode: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments that rebuild ``dataloader`` around ``sampler`` (Lightning's own re-instantiation logic)."""
    args, kwargs = pl.utilities.data._get_dataloader_init_args_and_kwargs(dataloader, sampler, mode)
    return tuple(args), dict(kwargs)


def reinstantiate_dataloader(dataloader: Any, *args: Any, **kwargs: Any) -> Any:
    """A new instance of ``dataloader``'s class (subclasses included) from :func:`dataloader_init_args`' output."""
    return fabric.utilities.data._reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def update_dataloader(dataloader: Any, sampler: Any, mode: Any) -> Any:
    """A copy of ``dataloader`` that draws from ``sampler`` (Lightning's sampler replacement)."""
    return pl.utilities.data._update_dataloader(dataloader, sampler, mode=mode)


# ---------------------------------------------------------------------------------------------- private: trainer
def trainer_of(module: Any) -> Any | None:
    """The Trainer a LightningModule is attached to, or ``None`` (``module.trainer`` raises when detached)."""
    return module._trainer if module is not None else None


def uses_distributed_sampler(trainer: Any) -> bool | None:
    """The Trainer's ``use_distributed_sampler`` flag (``None`` when the Trainer does not say)."""
    connector = getattr(trainer, "_accelerator_connector", None)
    return getattr(connector, "use_distributed_sampler", None)


def training_dataloaders(trainer: Any) -> list[object]:
    """The training dataloaders as the fit loop iterates them (after samplers were replaced); ``[]`` before."""
    fit_loop = getattr(trainer, "fit_loop", None)
    combined = getattr(fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def epochs_processed(trainer: Any) -> int:
    """The fit loop's count of processed epochs: the epoch Lightning sets on the samplers when an epoch starts.

    While a resumed run sets up its data, before the fit loop's ``reset``, it is the count the checkpoint holds.
    """
    return int(trainer.fit_loop.epoch_progress.current.processed)


def find_callback(trainer: Any, kind: type) -> Any | None:
    """The first of the Trainer's callbacks that is a ``kind``, or ``None``."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, kind)), None)


def has_callback(trainer: Any, callback: Any) -> bool:
    """Whether this very ``callback`` object is among the Trainer's callbacks."""
    return any(other is callback for other in trainer.callbacks)


def add_callback(trainer: Any, callback: Any, *, first: bool = False, replace: type | None = None) -> None:
    """Add ``callback`` to the Trainer's callback list (first, so it runs before the others, when asked).

    Lightning has no public way to add a callback after the Trainer was built; its ``callbacks`` list is edited in
    place, as Lightning's own connectors do.

    Args:
        trainer: the Trainer.
        callback: the callback to add.
        first: insert it at the front of the list instead of the end.
        replace: remove callbacks that are instances of this class first (a previous run's instance).

    """
    callbacks: list[Any] = trainer.callbacks
    if replace is not None:
        callbacks[:] = [c for c in callbacks if not isinstance(c, replace)]
    if first:
        callbacks.insert(0, callback)
    else:
        callbacks.append(callback)


def remove_callbacks(trainer: Any, kind: type) -> None:
    """Remove the Trainer's callbacks of type ``kind`` (the list edited in place, as by ``add_callback``)."""
    callbacks: list[Any] = trainer.callbacks
    callbacks[:] = [c for c in callbacks if not isinstance(c, kind)]


def wrap_evaluation_dataloader_preparation(trainer: Any, prepare: Callable[..., object], marker: str) -> bool:
    """Route the Trainer's dataloader preparation (sampler injection) through ``prepare(original, dl, shuffle, mode)``.

    Lightning has no hook between the user's ``*_dataloader()`` and its distributed-sampler injection; this wraps
    the data connector's ``_prepare_dataloader`` once per Trainer (``marker`` tells an earlier wrap).

    Returns:
        ``False`` when it was already wrapped with this ``marker``.

    """
    connector = trainer._data_connector
    original = connector._prepare_dataloader
    if getattr(original, marker, False):
        return False

    def prepare_dataloader(dataloader: object, shuffle: bool, mode: Any) -> object:
        return prepare(original, dataloader, shuffle, mode)

    setattr(prepare_dataloader, marker, True)
    connector._prepare_dataloader = prepare_dataloader
    return True


def route_resume_path(trainer: Any, choose: Callable[[str | None], str | None], marker: str) -> None:
    """Make ``trainer`` resume from ``choose(path)`` instead of the path it resolved itself.

    Lightning resolves ``ckpt_path`` on each rank before any strategy hook and offers no hook before the restore,
    so this wraps the checkpoint connector's ``resume_start`` (once per Trainer; ``marker`` tells an earlier wrap).
    ``resume_start`` gained a ``weights_only`` argument in Lightning 2.6; both signatures are passed through.
    """
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or getattr(connector.resume_start, marker, False):
        return
    original = connector.resume_start
    accepts_weights_only = "weights_only" in inspect.signature(original).parameters

    def resume_start(checkpoint_path: CheckpointPath | None = None, *args: Any, **kwargs: Any) -> None:
        chosen = choose(str(checkpoint_path) if checkpoint_path else None)
        if not accepts_weights_only:
            kwargs.pop("weights_only", None)
        original(chosen, *args, **kwargs)

    setattr(resume_start, marker, True)
    connector.resume_start = resume_start


def count_checkpointed_batch_as_completed(trainer: Any) -> None:
    """Lightning < 2.5.0: count the batch a step checkpoint was saved after (in ``on_train_batch_end``) as completed.

    Lightning 2.5.0 added that step (``_TrainingEpochLoop`` restart stage ``RESTARTED_ON_TRAIN_BATCH_END``); 2.4
    resets ``ready`` to ``completed``, one batch short, so ``batch_idx`` restarts one low and the epoch-end validation
    (``(batch_idx + 1) % val_check_batch``) is skipped. Call before the epoch loop's ``reset``.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(type(epoch_loop), "restarted_on_train_batch_end"):
        return
    progress = epoch_loop.batch_progress
    total = progress.total
    if total.ready == total.started == total.processed and total.completed == total.processed - 1:
        progress.increment_completed()
        epoch_loop._batches_that_stepped += 1  # as 2.5's reset does (the logging step of the next batch)


def restore_before_second_train_iterator(trainer: Any, restore: Callable[[], None]) -> bool:
    """Lightning < 2.5.3: call ``restore`` right before the epoch loop creates the training iterator again.

    Resuming at an epoch boundary, ``FitLoop.setup_data`` creates the training iterator and then, before 2.5.3
    (``_Loop.is_resuming``), ``_TrainingEpochLoop.on_run_start`` creates another one: each draws a seed from the
    global RNG. Returns whether ``restore`` was deferred (else the caller restores now).
    """
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if hasattr(type(fit_loop), "is_resuming") or trainer.current_epoch == 0 or epoch_loop.restarting:
        return False

    def on_run_start(*args: Any, **kwargs: Any) -> Any:
        del epoch_loop.on_run_start  # once: the class's method again
        restore()
        return epoch_loop.on_run_start(*args, **kwargs)

    epoch_loop.on_run_start = on_run_start
    return True


def restore_when_the_epoch_loop_starts(trainer: Any, restore: Callable[[], None]) -> None:
    """Lightning < 2.5: call ``restore`` when the epoch loop starts (``_TrainingEpochLoop.on_run_start``), once.

    Such a Lightning re-enters the epoch of a checkpoint saved after its last batch and ends it without a batch,
    with the epoch-end validation the uninterrupted run had made after that batch; the next epoch's training
    iterator follows. Both draw from the global RNG, as they did in the uninterrupted run after the saved state.
    """
    epoch_loop = trainer.fit_loop.epoch_loop

    def on_run_start(*args: Any, **kwargs: Any) -> Any:
        del epoch_loop.on_run_start  # once: the class's method again
        restore()
        return epoch_loop.on_run_start(*args, **kwargs)

    epoch_loop.on_run_start = on_run_start


def reseed_as_fit_does() -> None:
    """Re-seed as Lightning does when a stage sets up its process group: from ``seed_everything``'s seed, if any."""
    fabric.utilities.seed.reset_seed()


# ---------------------------------------------------------------------------------------------- private: processes
def init_default_process_group(strategy: Any, store: Callable[[int, timedelta | None], Any]) -> bool:
    """``DDPStrategy.setup_distributed`` without NCCL's eager ``device_id`` initialisation.

    Two ranks on one GPU then reach the strategy's device check on the control plane instead of failing inside
    NCCL's own init.

    Args:
        strategy: the DDP strategy being set up.
        store: called with ``(world_size, timeout)`` when this call creates the process group; returns a store to
            rendezvous through, or ``None`` for the default ``env://`` rendezvous.

    Returns:
        Whether this call created the default process group (else it existed already).

    """
    fabric.utilities.seed.reset_seed()
    strategy.set_world_ranks()
    backend = strategy._get_process_group_backend()
    strategy._process_group_backend = backend
    timeout = strategy._timeout
    created = not dist.is_initialized()
    chosen = store(strategy.world_size, timeout) if created else None
    extra = {"store": chosen} if chosen is not None else {}
    fabric.utilities.distributed._init_dist_connection(strategy.cluster_environment, backend, timeout=timeout, **extra)
    return created


def destroy_default_process_group() -> None:
    """Lightning's clean destruction of the default process group (a no-op when there is none)."""
    fabric.utilities.distributed._destroy_dist_connection()


# ---------------------------------------------------------------------------------------------- private: DDP wrapper
def ddp_settings(strategy: Any) -> dict[str, Any]:
    """What ``DDPStrategy`` gives DDP: its keyword arguments, and the communication hook settings that are set."""
    hooks = {
        "ddp_comm_hook": strategy._ddp_comm_hook,
        "ddp_comm_wrapper": strategy._ddp_comm_wrapper,
        "model_averaging_period": strategy._model_averaging_period,
    }
    return {**strategy._ddp_kwargs, **{name: value for name, value in hooks.items() if value is not None}}


def rebuild_ddp_wrapper(strategy: Any) -> Any:
    """Wrap the strategy's module in a new ``DistributedDataParallel``, built as Lightning built the current one.

    DDP decides once, when it is constructed, which parameters it reduces (those requiring a gradient then). To
    follow a change of ``requires_grad``, this calls the strategy's own ``_setup_model`` again (Lightning's: the
    strategy's DDP keyword arguments such as ``static_graph``, ``find_unused_parameters``,
    ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``broadcast_buffers``; the device ids; the CUDA side stream; or a
    subclass's override) on the same module, so parameters, and the optimizers' references to them, stay the same
    objects. The new wrapper gets the old one's communication hooks (Lightning's ``ddp_comm_hook`` and any registered
    by the user; per-bucket state such as PowerSGD's is reset), its gradient-sync flags (so a rebuild inside
    ``no_sync`` stays inside it) and its training flag. The old wrapper's reducer is detached from the parameters,
    and Lightning's "first static-graph iteration done" flag (manual optimization) is reset for the new wrapper.

    Like DDP's constructor, this runs collectives on the default process group (with ``init_sync``, the default:
    a shape check and a broadcast of rank 0's parameters and buffers): every rank must call it.

    Returns:
        The new wrapper, now ``strategy.model``.

    """
    old = strategy.model
    new = strategy._setup_model(old.module)
    for hook, state in ddp_comm_hooks(old):
        reset_per_bucket_hook_state(state)
        new.register_comm_hook(state, hook)
    new.require_backward_grad_sync = old.require_backward_grad_sync
    new.require_forward_param_sync = old.require_forward_param_sync
    new.training = old.training  # not .train(): that would also switch every submodule's mode
    detach_ddp_reducer(old)
    strategy.model = new
    if hasattr(strategy, "_pl_static_graph_delay_done"):  # Lightning >= 2.6
        strategy._pl_static_graph_delay_done = False
    return new


def last_checkpoint_path(trainer: Any) -> tuple[str, bool]:
    """Where a checkpoint is found by ``fit(ckpt_path="last")``; ``(path, True)`` when there is such a place.

    With a ``ModelCheckpoint`` (its directory resolved at setup): its ``last`` file name, recorded as its
    ``last_model_path`` so that the resumed run's rotation treats the file as its own last checkpoint. Without one,
    ``<default_root_dir>/checkpoints/last.ckpt`` (``False``: ``"last"`` does not look there, pass the path).
    """
    callback = trainer.checkpoint_callback
    checkpoint_cls = pl.callbacks.ModelCheckpoint
    if isinstance(callback, checkpoint_cls) and callback.dirpath is not None:
        monitor_candidates = getattr(callback, "_monitor_candidates", None)
        metrics = monitor_candidates(trainer) if callable(monitor_candidates) else {}
        path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
        callback.last_model_path = path
        return str(path), True
    return os.path.join(str(trainer.default_root_dir), "checkpoints", "last.ckpt"), False


def training_progress(trainer: Any) -> tuple[int, int] | None:
    """``(epoch, batches fetched in it)`` while ``fit`` trains, read from the loops' counters (any thread may ask).

    The epoch is the one being trained (``current_epoch`` counts completed epochs); the fetched batches include
    one whose step has not started yet. ``None`` outside training.
    """
    if trainer is None or not trainer.training:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return int(trainer.current_epoch), int(progress.ready)


def global_step_reader(trainer: pl.Trainer) -> Callable[[], int]:
    """A reader of ``trainer.global_step`` for the fit running now: the same counters, by attribute reads only.

    Lightning's property goes through five more properties on every read (the module, its
    ``automatic_optimization``, the loop's and the progress tracker's); a hook that runs every step reads the two
    counters it chooses from directly: the automatic loop's optimizer steps, or the manual loop's. Made once the
    trainer has its module (``on_train_start``).
    """
    loop, module = trainer.fit_loop.epoch_loop, trainer.lightning_module

    def read() -> int:
        if module is None or module._automatic_optimization:
            return int(loop.automatic_optimization.optim_progress.optimizer.step.total.completed)
        return int(loop.manual_optimization.optim_step_progress.total.completed)

    return read


def current_hook_name(module: Any) -> str:
    """The LightningModule hook running now (``"training_step"``, ``"on_train_epoch_end"``); ``""`` outside one."""
    return str(getattr(module, "_current_fx_name", None) or "")


def logged_metric_of_caller(depth: int = 8) -> tuple[str, str] | None:
    """``(hook, name)`` of the ``self.log`` value Lightning is syncing, when the strategy's caller syncs one.

    Lightning syncs a logged value in ``_ResultMetric`` (``forward`` for ``on_step``, ``compute`` at the epoch's end)
    through ``strategy.reduce``; its ``meta`` says which ``self.log`` call the value came from.
    """
    frame: Any = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        # only `_ResultMetric.update`/`compute` in Lightning's result.py: reading other frames' locals costs
        if code.co_name in ("update", "compute") and code.co_filename.endswith("result.py"):
            owner: Any = frame.f_locals.get("self")
            if type(owner).__name__ == "_ResultMetric":
                return str(owner.meta.fx), str(owner.meta.name)
        frame = frame.f_back
    return None
