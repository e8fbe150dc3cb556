"""ddp_strategy: a Lightning DDP strategy that turns silent distributed-training mistakes into named errors.

Importing the package registers ``"safe_ddp"`` and ``"safe_ddp_spawn"`` in Lightning's strategy registry, so
``Trainer(strategy="safe_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from ddp_strategy.errors import (
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointWriteError,
    CollectiveMismatchError,
    DDPStrategyError,
    DuplicateDeviceError,
    RankDivergenceError,
    SetupMismatchError,
    ShardingError,
    UnevenEvaluationError,
    UnsafeCheckpointError,
)
from ddp_strategy.strategy import DEFAULT_BARRIER_TIMEOUT, SafeDDPStrategy

__all__ = [
    "DEFAULT_BARRIER_TIMEOUT",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CollectiveMismatchError",
    "DDPStrategyError",
    "DuplicateDeviceError",
    "RankDivergenceError",
    "SafeDDPStrategy",
    "SetupMismatchError",
    "ShardingError",
    "UnevenEvaluationError",
    "UnsafeCheckpointError",
    "__version__",
]

__version__ = "0.1.0"

SafeDDPStrategy.register_strategies(StrategyRegistry)
