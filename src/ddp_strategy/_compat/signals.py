"""The preemption signals during a run: the strategy's handler takes them from Lightning's.

It reaches the Trainer's signal connector (a private of Lightning's) through the Trainer it is given, whichever
Lightning namespace that Trainer is of; it is loaded once per namespace, as :mod:`ddp_strategy._compat.lightning` is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["exit_with_code_on", "handle_signals_during_run"]

_SIGNALS_ATTR = "_ddp_strategy_signals"


def handle_signals_during_run(
    trainer: Any,
    signals: Sequence[signal.Signals],
    handler: Callable[[int], None],
    after_restore: Callable[[], None],
) -> None:
    """For the next run of ``trainer``, let ``handler`` take ``signals`` from Lightning's handlers.

    Lightning installs its handlers in ``trainer._run`` after the strategy's ``setup`` (its SIGTERM handler starts a
    broadcast from inside the handler, which deadlocks against any collective in progress) and restores the
    previous ones in ``trainer._teardown``. This wraps the Trainer's signal connector (once; later runs replace the
    spec): after Lightning registered its handlers, each of ``signals`` calls ``handler(signum)`` and then the
    handler the process had before the run (a user's own, when callable). After Lightning restored the handlers,
    ``after_restore()`` runs, once.
    """
    connector = trainer._signal_connector
    setattr(connector, _SIGNALS_ATTR, (tuple(signals), handler, after_restore))
    if getattr(connector, "_ddp_strategy_wrapped", False):
        return
    register, teardown = connector.register_signal_handlers, connector.teardown

    def register_signal_handlers() -> None:
        register()
        spec = getattr(connector, _SIGNALS_ATTR, None)
        if spec is None or threading.current_thread() is not threading.main_thread():
            return
        for sig in spec[0]:
            before = connector._original_handlers.get(sig)
            signal.signal(sig, _Composed(spec[1], before if callable(before) else None))

    def restore_signal_handlers() -> None:
        teardown()
        spec = getattr(connector, _SIGNALS_ATTR, None)
        setattr(connector, _SIGNALS_ATTR, None)
        if spec is not None:
            spec[2]()

    connector.register_signal_handlers = register_signal_handlers
    connector.teardown = restore_signal_handlers
    connector._ddp_strategy_wrapped = True


class _Composed:
    """A signal handler: ours, then the one the process had before the run."""

    def __init__(self, first: Callable[[int], None], then: Callable[..., Any] | None) -> None:
        self.first, self.then = first, then

    def __call__(self, signum: int, frame: Any) -> None:
        self.first(signum)
        if self.then is not None:
            self.then(signum, frame)


def exit_with_code_on(signals: Sequence[signal.Signals], code: int) -> None:
    """From now on, each of ``signals`` ends the process at once with exit ``code`` (streams flushed first).

    For a rank that already stopped and is exiting with ``code``: a signal that arrives while it tears down (from
    ``torchrun``'s agent, once another rank exited) must not turn its exit into "killed by a signal". Only from the
    main thread (Python sets handlers there only).

    At interpreter exit (an ``atexit`` callback, run before the others registered earlier) the signals are ignored
    instead: the interpreter's finalization puts a Python handler back to the default action, which would end the
    process as "killed by a signal" in the last moments of its exit (seen once under ``torchrun``: exit -15 on the
    rank still finalizing when the other had exited). An ignored signal stays ignored, and the process ends with its
    code anyway.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals:
        signal.signal(sig, _ExitWith(code))
    atexit.register(_ignore, tuple(signals))


def _ignore(signals: tuple[signal.Signals, ...]) -> None:
    for sig in signals:
        with contextlib.suppress(ValueError, OSError):  # not the main thread, or a signal that cannot be ignored
            signal.signal(sig, signal.SIG_IGN)


class _ExitWith:
    """A signal handler that ends the process with a fixed exit code."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __call__(self, signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.code)
