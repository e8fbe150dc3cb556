"""Name the DataLoaders whose worker start can deadlock on this Python (CPython gh-112275).

A DataLoader with ``num_workers > 0`` and ``persistent_workers=False`` forks its workers from the training process
at every epoch. Under DDP the training process has background threads (gloo's workers) that take the GIL from time
to time; on CPython before 3.11.10 a fork at the instant such a thread creates its Python thread state leaves the
new worker deadlocked in ``PyOS_AfterFork_Child`` (https://github.com/python/cpython/issues/112275), and its rank
waits for a batch forever. Rare per fork, but every rank forks at every epoch. The strategy's own collectives no
longer trigger it (:mod:`~ddp_strategy.object_collectives`); torch's and Lightning's still can.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterable, Sequence

__all__ = ["FIXED_IN", "fork_hazard"]

#: The first CPython 3.11 release with the fix of gh-112275 (3.12 and later have it too).
FIXED_IN = (3, 11, 10)


def _start_method(loader: object) -> str:
    context = getattr(loader, "multiprocessing_context", None)
    if context is None:
        return multiprocessing.get_start_method(allow_none=False)
    if isinstance(context, str):
        return context
    get = getattr(context, "get_start_method", None)
    return str(get()) if callable(get) else "fork"


def _forks_every_epoch(loader: object) -> bool:
    workers = getattr(loader, "num_workers", 0)
    if not isinstance(workers, int) or workers <= 0 or getattr(loader, "persistent_workers", False):
        return False
    return _start_method(loader) == "fork"


def fork_hazard(
    loaders: Iterable[tuple[str, object]], *, python: Sequence[int] | None = None, world_size: int = 2
) -> str | None:
    """The warning for DataLoaders that fork workers at every epoch on an affected Python, or ``None``.

    Args:
        loaders: ``(description, dataloader)`` pairs, e.g. ``("training", loader)``.
        python: the interpreter version to judge (default: this one).
        world_size: the number of ranks (one rank has no collective threads: no hazard).

    """
    version = tuple(python if python is not None else sys.version_info[:3])
    if world_size < 2 or version >= FIXED_IN:
        return None
    risky = [(what, loader) for what, loader in loaders if _forks_every_epoch(loader)]
    if not risky:
        return None
    names = ", ".join(
        f"the {what} DataLoader ({getattr(loader, 'num_workers', '?')} workers)" for what, loader in risky
    )
    shown = ".".join(str(part) for part in version)
    return (
        f"ddp_strategy: {names} fork(s) new worker processes at every epoch (persistent_workers=False) on Python "
        f"{shown}. Before Python 3.11.10 such a fork can deadlock the new worker when one of torch's collective "
        "threads is taking the GIL at that instant (CPython gh-112275); that rank then waits for a batch forever. "
        "Pass persistent_workers=True (one fork per run instead of one per epoch) or "
        "multiprocessing_context='forkserver' to the DataLoader, or use Python >= 3.11.10."
    )
