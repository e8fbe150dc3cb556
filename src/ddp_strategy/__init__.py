"""ddp_strategy: a Lightning DDP strategy that turns silent distributed-training mistakes into named errors.

Importing the package registers ``"safe_ddp"`` and ``"safe_ddp_spawn"`` in Lightning's strategy registry, so
``Trainer(strategy="safe_ddp")`` works; when the standalone ``pytorch_lightning`` package is installed too (in a
supported release), in its registry as well, with the classes of :mod:`ddp_strategy.pytorch_lightning`.
"""

from importlib import metadata

from ._compat import supports_lightning
from ._compat.lightning import StrategyRegistry
from .errors import (
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointWriteError,
    CollectiveMismatchError,
    DDPStrategyError,
    DuplicateDeviceError,
    RankDivergenceError,
    RendezvousError,
    SetupMismatchError,
    ShardingError,
    UnevenEvaluationError,
    UnevenInputsError,
    UnsafeCheckpointError,
    UnusedParametersError,
)
from .preemption import Preempted
from .strategy import DEFAULT_BARRIER_TIMEOUT, SafeDDPStrategy
from .version import __version__

__all__ = [
    "DEFAULT_BARRIER_TIMEOUT",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CollectiveMismatchError",
    "DDPStrategyError",
    "DuplicateDeviceError",
    "Preempted",
    "RankDivergenceError",
    "RendezvousError",
    "SafeDDPStrategy",
    "SetupMismatchError",
    "ShardingError",
    "UnevenEvaluationError",
    "UnevenInputsError",
    "UnsafeCheckpointError",
    "UnusedParametersError",
    "__version__",
]


SafeDDPStrategy.register_strategies(StrategyRegistry)


def _standalone_pytorch_lightning_supported() -> bool:
    try:
        return supports_lightning(metadata.version("pytorch-lightning"))
    except metadata.PackageNotFoundError:
        return False


if _standalone_pytorch_lightning_supported():  # register "safe_ddp" for pytorch_lightning.Trainer too
    from . import pytorch_lightning  # noqa: F401
