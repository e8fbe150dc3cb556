"""Crash-safe checkpoint files, the integrity record, and per-rank RNG state."""

from ddp_strategy.checkpoint.format import IntegrityRecord, verify
from ddp_strategy.checkpoint.io import SafeCheckpointIO

__all__ = ["IntegrityRecord", "SafeCheckpointIO", "verify"]
