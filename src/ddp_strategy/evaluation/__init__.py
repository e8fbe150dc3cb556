"""Exact distributed evaluation: every sample evaluated once, metrics equal to the single-device result."""

from .coordinator import PREDICTIONS_ON, ExactEvaluation, interleave_batches
from .sharding import (
    BatchShardSampler,
    RankShareSampler,
    RankStridedIterable,
    SeededPermutationSampler,
    shard_evaluation_dataloader,
)

__all__ = [
    "PREDICTIONS_ON",
    "BatchShardSampler",
    "ExactEvaluation",
    "RankShareSampler",
    "RankStridedIterable",
    "SeededPermutationSampler",
    "interleave_batches",
    "shard_evaluation_dataloader",
]
