"""Callbacks that check rank consistency during training."""

from ddp_strategy.callbacks.global_loss import GlobalTrainingLoss
from ddp_strategy.callbacks.hang_watchdog import HangWatchdog
from ddp_strategy.callbacks.sharding_check import ShardingCheck, ensure_sharding_check
from ddp_strategy.callbacks.straggler import StragglerMonitor
from ddp_strategy.callbacks.weight_sync import WeightSyncCheck

__all__ = [
    "GlobalTrainingLoss",
    "HangWatchdog",
    "ShardingCheck",
    "StragglerMonitor",
    "WeightSyncCheck",
    "ensure_sharding_check",
]
