"""``ddp_strategy`` for the standalone ``pytorch_lightning`` package.

Use it exactly like ``ddp_strategy``, with ``pytorch_lightning``'s Trainer::

    import pytorch_lightning as pl
    from ddp_strategy.pytorch_lightning import SafeDDPStrategy
    from ddp_strategy.pytorch_lightning.callbacks import HangWatchdog

    trainer = pl.Trainer(strategy=SafeDDPStrategy(), callbacks=[HangWatchdog()], devices=2, accelerator="cpu")
    # or, once ddp_strategy is imported: pl.Trainer(strategy="safe_ddp", ...)

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of one source with separate class hierarchies: each
Trainer accepts only strategies and callbacks derived from its own package's classes. This package's submodules are
the very source files of ``ddp_strategy``, loaded a second time under this name, so their relative imports reach
``ddp_strategy.pytorch_lightning._compat.lightning``, which binds to ``pytorch_lightning``. The modules that hold no
Lightning (:data:`SHARED_MODULES`: errors, the control plane, the checkpoint format, ...) are not loaded twice: they
are the same module objects, so ``except ddp_strategy.CollectiveMismatchError`` catches errors of both namespaces.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

#: Modules without Lightning in them: one copy, shared with ``ddp_strategy`` (``tests/test_seam.py`` checks that
#: none of them reaches Lightning).
SHARED_MODULES = (
    "_compat",
    "_compat.torch",
    "checkpoint.atomic",
    "checkpoint.format",
    "checkpoint.keys",
    "control",
    "errors",
    "fingerprint",
    "peers",
    "positions",
)

if __name__ != "ddp_strategy.pytorch_lightning":  # the mirror's own subdirectory, seen through the mirror
    raise ImportError(f"{__name__} is not a module; import ddp_strategy.pytorch_lightning")

__path__ = [str(Path(__file__).resolve().parent.parent)]  # the submodules are ddp_strategy's own source files
for _name in SHARED_MODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"ddp_strategy.{_name}")

from .. import __version__  # noqa: E402
from ._compat.lightning import StrategyRegistry  # noqa: E402
from .errors import *  # noqa: E402, F403
from .errors import __all__ as _errors  # noqa: E402
from .strategy import DEFAULT_BARRIER_TIMEOUT, SafeDDPStrategy  # noqa: E402

__all__ = ["DEFAULT_BARRIER_TIMEOUT", "SafeDDPStrategy", "__version__", *_errors]

SafeDDPStrategy.register_strategies(StrategyRegistry)
