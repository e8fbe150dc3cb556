"""Name the DataLoaders whose worker start can deadlock on this Python (CPython gh-112275).

A DataLoader with ``num_workers > 0`` and ``persistent_workers=False`` forks its workers from the training process
at every epoch. Under DDP the training process has background threads (gloo's workers) that take the GIL from time
to time; on CPython before 3.11.10 a fork at the instant such a thread creates its Python thread state leaves the
new worker deadlocked in ``PyOS_AfterFork_Child`` (https://github.com/python/cpython/issues/112275), and its rank
waits for a batch forever. Rare per fork, but every rank forks at every epoch.

On an affected Python the strategy therefore gives each gloo worker thread of its process groups a Python thread
state that it keeps (:func:`pin_collective_threads`): a thread that has one never creates another, so no
collective, whoever makes it (the strategy, Lightning, torchmetrics, user code), opens that window. Where that
cannot be done completely, the DataLoaders that fork at every epoch are named (:func:`fork_hazard`).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ._compat.torch import gloo_worker_threads, pin_python_thread_states

__all__ = ["FIXED_IN", "fork_hazard", "pin_collective_threads"]

#: The first CPython 3.11 release with the fix of gh-112275 (3.12 and later have it too).
FIXED_IN = (3, 11, 10)


def affected(python: Sequence[int] | None = None) -> bool:
    """Whether this interpreter (or ``python``) has CPython gh-112275."""
    return tuple(python if python is not None else sys.version_info[:3]) < FIXED_IN


def pin_collective_threads(groups: Iterable[Any]) -> bool:
    """On an affected Python, make the gloo worker threads of ``groups`` keep a Python thread state. Collective.

    Args:
        groups: process groups every rank is a member of (groups whose CPU backend is not gloo are skipped).

    Returns:
        Whether every gloo worker thread of ``groups`` on every rank holds one (``True`` on a fixed Python).

    """
    if not affected():
        return True
    complete = True
    for group in groups:
        threads = gloo_worker_threads(group)
        if threads:
            complete = pin_python_thread_states(group, threads) >= threads and complete
    return complete


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
    if world_size < 2 or not affected(version):
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
