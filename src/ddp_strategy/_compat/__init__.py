"""The seam: the only modules of ``ddp_strategy`` that touch private Lightning, torchmetrics or torch internals.

* :mod:`ddp_strategy._compat.lightning`: every Lightning name the package uses (public and private), bound to
  ``lightning.pytorch`` or, under :mod:`ddp_strategy.pytorch_lightning`, to the standalone ``pytorch_lightning``
  package, with the version shims between the releases we support.
* :mod:`ddp_strategy._compat.loops`: the exact evaluation and prediction loops (subclasses of Lightning's private
  loop classes) and the logged-result entries they create.
* :mod:`ddp_strategy._compat.torch`: private ``torch.distributed`` and tensor internals.

Everything else calls these by names that say what they do; ``tests/test_seam.py`` fails when another module
touches an internal. A Lightning or torch release that moves an internal is a change here only.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_LIGHTNING", "supports_lightning"]

#: The Lightning releases supported, in either namespace (``pyproject.toml``'s range; CI runs both ends).
SUPPORTED_LIGHTNING = (">=2.4", "<2.7")


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def supports_lightning(version: str) -> bool:
    """Whether a ``lightning`` or ``pytorch_lightning`` release is in :data:`SUPPORTED_LIGHTNING`.

    >>> supports_lightning("2.4.0"), supports_lightning("2.6.6"), supports_lightning("2.7.0")
    (True, True, False)
    """
    low, high = (_release(bound.lstrip("<>=")) for bound in SUPPORTED_LIGHTNING)
    return low <= _release(version) < high
