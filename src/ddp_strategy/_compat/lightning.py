"""Every Lightning name ``ddp_strategy`` uses, bound to one Lightning namespace, with the version shims.

This module is loaded twice when both packages are installed: as ``ddp_strategy._compat.lightning`` it binds to
``lightning.pytorch`` / ``lightning.fabric``; as ``ddp_strategy.pytorch_lightning._compat.lightning`` (see
:mod:`ddp_strategy.pytorch_lightning`) to the standalone ``pytorch_lightning`` / ``lightning_fabric``. The two
packages are copies of one source with separate class hierarchies, so a ``pytorch_lightning.Trainer`` accepts only
strategies and callbacks built on ``pytorch_lightning``'s classes.

Public names are re-exported as they are. Private ones are reached only through the functions below, whose names
say what they do; a Lightning release that changes one of them is a change here only. Supported releases:
:data:`ddp_strategy._compat.SUPPORTED_LIGHTNING`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from importlib import import_module, metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import SUPPORTED_LIGHTNING, supports_lightning

__all__ = [
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
    "add_callback",
    "collect_rng_states",
    "dataloader_init_args",
    "destroy_default_process_group",
    "fabric",
    "find_callback",
    "init_default_process_group",
    "move_data_to_device",
    "pl",
    "rank_zero_info",
    "rank_zero_warn",
    "reinstantiate_dataloader",
    "route_resume_path",
    "set_rng_states",
    "set_sampler_epoch",
    "trainer_of",
    "training_dataloaders",
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
    for _sub in ("trainer.states", "utilities.data", "callbacks", "strategies"):
        import_module(f"{_PL}.{_sub}")
    fabric = import_module(_FABRIC)
    pl = import_module(_PL)
    #: Lightning's wrapper that records batch indices for ``trainer.predict``.
    IndexBatchSamplerWrapper = import_module(f"{_PL}.overrides.distributed")._IndexBatchSamplerWrapper

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


def find_callback(trainer: Any, kind: type) -> Any | None:
    """The first of the Trainer's callbacks that is a ``kind``, or ``None``."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, kind)), None)


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
