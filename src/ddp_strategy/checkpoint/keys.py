"""Names of the entries ``SafeDDPStrategy`` adds to a Lightning checkpoint dict."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BUCKET_LAYOUT_KEY",
    "NO_RNG_REASON_KEY",
    "PACKAGE_KEY",
    "RNG_AT_VALIDATION_START_KEY",
    "RNG_STATES_KEY",
    "WORLD_SIZE_KEY",
    "package_state",
]

#: ``checkpoint[PACKAGE_KEY]`` holds everything this package adds; the rest is Lightning's own layout.
PACKAGE_KEY = "ddp_strategy"
#: The world size of the run that wrote the checkpoint.
WORLD_SIZE_KEY = "world_size"
#: One RNG-state dict per rank, indexed by global rank (see :mod:`ddp_strategy.checkpoint.rng`).
RNG_STATES_KEY = "rng_states"
#: DDP's gradient-bucket layout that the saving run's next step reduces with (see :mod:`ddp_strategy.bucket_layout`).
BUCKET_LAYOUT_KEY = "ddp_bucket_layout"
#: ``True`` in a checkpoint written during a validation inside ``fit`` (a preemption stop): its RNG states are those
#: of that validation's start, restored when the resumed run repeats it.
RNG_AT_VALIDATION_START_KEY = "rng_at_validation_start"
#: Why a checkpoint written by ``SafeDDPStrategy`` holds no RNG states (it was saved where no rank was reachable).
NO_RNG_REASON_KEY = "no_rng_states_because"


def package_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The ``ddp_strategy`` section of a checkpoint dict (empty when absent or malformed)."""
    section = checkpoint.get(PACKAGE_KEY)
    return section if isinstance(section, dict) else {}
