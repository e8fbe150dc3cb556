"""``EvaluationSteps``: how the strategy runs validation, test and predict steps, exactly or as Lightning does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._compat.lightning import pl
from ..control import ControlPlane
from ..host import StrategyHost
from ..options import StrategyOptions
from .coordinator import ExactEvaluation, sync_buffers_before_evaluation

__all__ = ["EvaluationSteps"]

#: The precision plugin's context manager for each evaluation step hook.
_STEP_CONTEXTS = {
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class EvaluationSteps:
    """Exact evaluation (every sample on exactly one rank) while it is in effect: on, and several ranks.

    Args:
        control: returns the strategy's control plane (``None`` outside a run).
        options: the strategy's options (``exact_evaluation``; ``predictions_on``: where ``trainer.predict`` returns
            all predictions).

    """

    def __init__(self, control: Callable[[], ControlPlane | None], options: StrategyOptions) -> None:
        #: Whether exact evaluation is on; switched off when a Trainer's loops could not be replaced.
        self.enabled = options.exact_evaluation
        self._exact = ExactEvaluation(control, predictions_on=options.predictions_on)
        #: ``check_collective(what)``, before a strategy collective named ``what``: raises ``UnevenEvaluationError``
        #: inside an evaluation step run by :meth:`run` while the ranks take different numbers of steps, instead of
        #: hanging. The coordinator's own method (one attribute test outside such steps; it runs for every
        #: ``sync_dist`` value, so one call, not two).
        self.check_collective: Callable[[str], None] = self._exact.check_collective

    def coordinator(self, world_size: int) -> ExactEvaluation | None:
        """The exact-evaluation coordinator while it is in effect, else ``None``."""
        return self._exact if self.enabled and world_size > 1 else None

    def setup(self, trainer: pl.Trainer, world_size: int) -> None:
        """At the strategy's ``setup``: install the exact loops and sharding (or switch exact evaluation off)."""
        if self.coordinator(world_size) is not None and not self._exact.install(trainer):
            self.enabled = False

    def before_loop(self, model: Any, world_size: int) -> None:
        """When an evaluation loop starts: sync DDP's buffers once, on every rank (the steps bypass DDP's forward)."""
        if self.coordinator(world_size) is not None:
            sync_buffers_before_evaluation(model)

    def run(
        self,
        hook: str,
        default: Callable[..., Any],
        strategy: StrategyHost,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run the evaluation step ``hook`` (``"validation_step"``, ``"test_step"`` or ``"predict_step"``).

        With exact evaluation the ranks take different numbers of steps, so the step must not go through the DDP
        wrapper's forward (its first call broadcasts buffers: a hidden collective): the module's hook runs directly,
        inside the precision plugin's step context. Otherwise ``default(*args, **kwargs)`` (Lightning's step) runs.

        Args:
            hook: the step's name.
            default: Lightning's implementation of the step.
            strategy: the strategy (its ``world_size``, ``lightning_module`` and ``precision_plugin``).
            args: the step's positional arguments.
            kwargs: the step's keyword arguments.

        """
        coordinator = self.coordinator(strategy.world_size)
        module = strategy.lightning_module
        if coordinator is None or module is None:
            return default(*args, **kwargs)
        context = getattr(strategy.precision_plugin, _STEP_CONTEXTS[hook])
        with context(), coordinator.step(hook):
            return getattr(module, hook)(*args, **kwargs)
