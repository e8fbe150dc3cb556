"""The preemption signals during a run: the strategy's handler takes them from Lightning's.

It reaches the Trainer's signal connector (a private of Lightning's) through the Trainer it is given, whichever
Lightning namespace that Trainer is of; it is loaded once per namespace, as :mod:`ddp_strategy._compat.lightning` is.
When the strategy's handler takes SIGTERM, Lightning's per-batch broadcast of rank 0's SIGTERM flag (the training
epoch loop's ``_broadcast_sigterm_tensor``, Lightning >= 2.5) is skipped for the run: that flag is set by Lightning's
SIGTERM handler only, which then never runs.
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

__all__ = ["exit_with_code_on", "handle_signals_during_run", "sigterm_broadcast_skipped"]

_SIGNALS_ATTR = "_ddp_strategy_signals"
#: Lightning >= 2.5: the training epoch loop's method that broadcasts rank 0's ``trainer.received_sigterm`` to every
#: rank before each training batch (one collective, and on a GPU one wait for the device, per batch)
_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


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

    With SIGTERM among ``signals``, Lightning's SIGTERM handler, the only code that sets the flag its training loop
    broadcasts from rank 0 before every batch, is not installed for the run (off the main thread Lightning installs
    none), so the flag stays ``False`` on every rank and that broadcast is skipped until the run's teardown: one
    collective fewer per training batch, the same on every rank since every rank has the same ``signals``.
    """
    connector = trainer._signal_connector
    setattr(connector, _SIGNALS_ATTR, (tuple(signals), handler, after_restore))
    if getattr(connector, "_ddp_strategy_wrapped", False):
        return
    register, teardown = connector.register_signal_handlers, connector.teardown

    def register_signal_handlers() -> None:
        register()
        spec = getattr(connector, _SIGNALS_ATTR, None)
        if spec is None:
            return
        if signal.SIGTERM in spec[0]:
            _skip_sigterm_broadcast(connector.trainer)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in spec[0]:
            before = connector._original_handlers.get(sig)
            signal.signal(sig, _Composed(spec[1], before if callable(before) else None))

    def restore_signal_handlers() -> None:
        teardown()
        _restore_sigterm_broadcast(connector.trainer)
        spec = getattr(connector, _SIGNALS_ATTR, None)
        setattr(connector, _SIGNALS_ATTR, None)
        if spec is not None:
            spec[2]()

    connector.register_signal_handlers = register_signal_handlers
    connector.teardown = restore_signal_handlers
    connector._ddp_strategy_wrapped = True


def _skip_sigterm_broadcast(trainer: Any) -> None:
    """Lightning's per-batch broadcast of rank 0's SIGTERM flag, replaced on the run's loop by a call that does nothing.

    Where Lightning has no such broadcast (< 2.5), nothing changes.
    """
    loop = trainer.fit_loop.epoch_loop
    if callable(getattr(type(loop), _SIGTERM_BROADCAST, None)):
        setattr(loop, _SIGTERM_BROADCAST, _no_sigterm_to_broadcast)


def _restore_sigterm_broadcast(trainer: Any) -> None:
    """Lightning's own broadcast again on the loop (undoes :func:`_skip_sigterm_broadcast`)."""
    vars(trainer.fit_loop.epoch_loop).pop(_SIGTERM_BROADCAST, None)


def sigterm_broadcast_skipped(trainer: Any) -> bool:
    """Whether the run's training loop skips Lightning's per-batch broadcast of rank 0's SIGTERM flag."""
    return vars(trainer.fit_loop.epoch_loop).get(_SIGTERM_BROADCAST) is _no_sigterm_to_broadcast


def _no_sigterm_to_broadcast() -> None:
    """In place of Lightning's broadcast: the strategy's handler has SIGTERM, so rank 0's flag stays ``False``."""


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
