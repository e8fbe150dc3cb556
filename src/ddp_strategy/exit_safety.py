"""No background thread of the package is inside a store call while the interpreter finalizes.

A daemon thread blocked in a ``TCPStore`` call (a ``wait``, or any operation in flight) wakes with an error when
the store's host (rank 0) exits. If that happens while this process is finalizing, the thread's way back into
Python cannot take the GIL any more: CPython (before 3.14) ends it with ``pthread_exit``, whose forced unwinding
through torch's C++ frames calls ``std::terminate``, and the process aborts (SIGABRT, "terminate called without an
active exception"; exit code 134 instead of the one it was leaving with). Reproduced on torch 2.14.1 / Python 3.11
with a client whose server exits within about 20 ms of the client's own exit (tests/test_exit_safety.py).

:func:`end_at_exit` registers a callable that ends (and joins) such a thread; one ``atexit`` hook runs them all,
before the interpreter starts finalizing.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable

__all__ = ["end_at_exit", "end_threads_now"]

log = logging.getLogger(__name__)

_ENDERS: list[weakref.WeakMethod[Callable[[], None]]] = []
_LOCK = threading.Lock()


def end_at_exit(ender: Callable[[], None]) -> None:
    """Call ``ender`` (a bound method: held weakly, so it keeps nothing alive) when the process exits.

    Args:
        ender: ends the caller's thread and waits a bounded time for it; it must not raise.

    """
    with _LOCK:
        _ENDERS[:] = [ref for ref in _ENDERS if ref() is not None]  # one per stage: drop the ended ones
        _ENDERS.append(weakref.WeakMethod(ender))


def end_threads_now() -> None:
    """Run every registered ender whose object is still alive (the ``atexit`` hook; also callable directly)."""
    with _LOCK:
        enders = [ref() for ref in _ENDERS]
        _ENDERS.clear()
    for ender in enders:
        if ender is None:
            continue
        try:
            ender()
        except Exception as err:  # exiting anyway: say it, never stop the other enders
            log.debug("ddp_strategy: ending a thread at exit failed: %r", err)


atexit.register(end_threads_now)
