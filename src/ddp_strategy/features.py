"""``StrategyFeatures``: the feature objects of :class:`~ddp_strategy.SafeDDPStrategy`, built and wired together.

One object per feature, each owning its state (docs/architecture.md: the strategy's feature objects). This module
says who needs whom: every object that talks to the other ranks reaches the control plane through
:meth:`RunLifecycle.control_plane_or_none`, a bound method, so the strategy holding them still pickles for the spawn
launcher.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bucket_layout import BucketLayoutKeeper
from .callbacks.preemption_stop import PreemptionHandling
from .collective_calls import CollectiveCalls
from .evaluation.steps import EvaluationSteps
from .handshake_runner import Handshakes
from .host import StrategyHost
from .lifecycle import RunLifecycle
from .options import StrategyOptions
from .resume import ExactResume
from .saving import CheckpointSaving
from .unused_parameters import UnusedParameterCheck
from .weight_checks import WeightChecks

__all__ = ["StrategyFeatures", "build_features"]


@dataclass(frozen=True)
class StrategyFeatures:
    """The strategy's feature objects (each field: the object, named after its feature)."""

    calls: CollectiveCalls
    lifecycle: RunLifecycle
    handshakes: Handshakes
    evaluation: EvaluationSteps
    weights: WeightChecks
    saving: CheckpointSaving
    resume: ExactResume
    preemption: PreemptionHandling
    unused: UnusedParameterCheck


def build_features(
    strategy: StrategyHost, options: StrategyOptions, bucket_layout: BucketLayoutKeeper
) -> StrategyFeatures:
    """Build the feature objects of ``strategy`` from its validated options.

    Args:
        strategy: the strategy they serve (read when needed: ranks, devices and the model are set up later).
        options: the strategy's options.
        bucket_layout: the strategy's keeper of DDP's gradient-bucket layout, saved and resumed with checkpoints.

    Returns:
        The objects, wired together: the saves compare the weights; a checkpoint is read only once the write in
        flight is done; a preemption stop finishes the asynchronous writes, and a validation in ``fit`` restores the
        RNG states of a resumed checkpoint that was saved during one.

    """
    calls = CollectiveCalls()
    lifecycle = RunLifecycle(calls, options)
    control = lifecycle.control_plane_or_none
    handshakes = Handshakes(control, options)
    evaluation = EvaluationSteps(control, options)
    weights = WeightChecks(options)
    saving = CheckpointSaving(strategy, options, lifecycle, weights, bucket_layout)
    resume = ExactResume(strategy, control, bucket_layout, saving.wait_before_reading)
    preemption = PreemptionHandling(options, control, saving.finish_async_writes, resume.at_validation_start)
    unused = UnusedParameterCheck(control)
    return StrategyFeatures(calls, lifecycle, handshakes, evaluation, weights, saving, resume, preemption, unused)
