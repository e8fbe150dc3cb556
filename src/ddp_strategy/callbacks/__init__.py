"""Callbacks that check rank consistency during training."""

from ddp_strategy.callbacks.weight_sync import WeightSyncCheck

__all__ = ["WeightSyncCheck"]
