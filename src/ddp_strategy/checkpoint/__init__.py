"""Crash-safe checkpoint files, the integrity record, and per-rank RNG state."""

from .format import IntegrityRecord, verify
from .io import SafeCheckpointIO

__all__ = ["IntegrityRecord", "SafeCheckpointIO", "verify"]
