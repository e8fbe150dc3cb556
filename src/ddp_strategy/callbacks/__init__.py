"""Callbacks that check rank consistency during training."""

from ddp_strategy.callbacks.hang_watchdog import HangWatchdog
from ddp_strategy.callbacks.straggler import StragglerMonitor
from ddp_strategy.callbacks.weight_sync import WeightSyncCheck

__all__ = ["HangWatchdog", "StragglerMonitor", "WeightSyncCheck"]
