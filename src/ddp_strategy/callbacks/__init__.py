"""Callbacks that check rank consistency during training."""

from .global_loss import GlobalTrainingLoss
from .hang_watchdog import HangWatchdog
from .sharding_check import ShardingCheck, ensure_sharding_check
from .straggler import StragglerMonitor
from .weight_sync import WeightSyncCheck

__all__ = [
    "GlobalTrainingLoss",
    "HangWatchdog",
    "ShardingCheck",
    "StragglerMonitor",
    "WeightSyncCheck",
    "ensure_sharding_check",
]
