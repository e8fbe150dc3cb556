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
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: Modules without Lightning in them: one copy, shared with ``ddp_strategy`` (``tests/test_seam.py`` checks that
#: none of them reaches Lightning and that each is a plain module, not a package).
SHARED_MODULES = frozenset(
    {
        "_compat.torch",
        "checkpoint.atomic",
        "checkpoint.format",
        "checkpoint.hashing",
        "checkpoint.keys",
        "consistency",
        "fork_safety",
        "control",
        "control_agreement",
        "agreement",
        "barrier_wait",
        "heartbeat",
        "object_collectives",
        "errors",
        "exit_safety",
        "fingerprint",
        "peers",
        "positions",
        "preemption",
        "store",
        "store_barrier",
        "trainable",
        "unused_parameters",
        "version",
    }
)

if __name__ != "ddp_strategy.pytorch_lightning":  # the mirror's own subdirectory, seen through the mirror
    raise ImportError(f"{__name__} is not a module; import ddp_strategy.pytorch_lightning")


class _SharedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``ddp_strategy.pytorch_lightning.<shared>`` to the module object ``ddp_strategy.<shared>``."""

    prefix = f"{__name__}."

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(self.prefix) and fullname[len(self.prefix) :] in SHARED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"ddp_strategy.{spec.name[len(self.prefix) :]}")

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the shared module was executed once, as ``ddp_strategy.<name>``."""


__path__ = [str(Path(__file__).resolve().parent.parent)]  # the submodules are ddp_strategy's own source files
if not any(isinstance(finder, _SharedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SharedModuleFinder())

from ..version import __version__  # noqa: E402
from ._compat.lightning import StrategyRegistry  # noqa: E402
from .errors import *  # noqa: E402, F403
from .errors import __all__ as _errors  # noqa: E402
from .preemption import Preempted  # noqa: E402
from .strategy import DEFAULT_BARRIER_TIMEOUT, SafeDDPStrategy  # noqa: E402

__all__ = ["DEFAULT_BARRIER_TIMEOUT", "Preempted", "SafeDDPStrategy", "__version__", *_errors]

SafeDDPStrategy.register_strategies(StrategyRegistry)
