"""Lightning's launchers, wrapped: the run's errors may be replaced, and a preempted spawn run exits with its code.

Loaded once per Lightning namespace, as :mod:`ddp_strategy._compat.lightning` is (its relative import binds these
classes to the launchers of the package that module is bound to).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from importlib import import_module
from typing import Any

from .lightning import pl

__all__ = ["configure_launcher", "exit_at_once_on_stop"]

_MultiProcessingLauncher = pl.strategies.launchers.multiprocessing._MultiProcessingLauncher
_SubprocessScriptLauncher = pl.strategies.launchers.subprocess_script._SubprocessScriptLauncher


def _run_converting(
    function: Callable[..., Any], convert: Callable[[BaseException], BaseException | None], *args: Any, **kwargs: Any
) -> Any:
    """Run the launched function (``Trainer._fit_impl`` and the like); an error it raises may be replaced."""
    try:
        return function(*args, **kwargs)
    except Exception as err:
        replacement = convert(err)
        if replacement is None or replacement is err:
            raise
        raise replacement from err


def exit_at_once_on_stop(
    function: Callable[..., Any], exit_codes: frozenset[int], trainer: Any, *args: Any, **kwargs: Any
) -> Any:
    """Run a spawn rank's function; a ``SystemExit`` with one of ``exit_codes`` ends the process at once.

    A preempted rank has saved, agreed and printed its line when :class:`~ddp_strategy.Preempted` reaches here.
    It then does what Lightning does for a rank of the subprocess launcher (``_call_and_handle_interrupt``:
    ``on_exception`` hooks, loggers finalized, ``trainer._teardown()``, so that the strategy closes its control
    plane with every rank: rank 0, the store's host, goes last), and ends with ``os._exit`` after flushing the
    streams and ending its own child processes (DataLoader workers). Its exit code so depends neither on the
    interpreter's finalization nor on C++ static destructors: once, one of those aborted a stopped rank (SIGABRT,
    "terminate called without an active exception"), and the main process exited 1 instead of 143. Other errors
    and exit codes pass unchanged (as in stock Lightning, a spawn rank's error reaches the main process).

    Args:
        function: the launched function (``Trainer._fit_impl`` and the like).
        exit_codes: the preemption exit codes (``128 + signal``).
        trainer: the rank's Trainer (``None`` when the launcher runs without one).
        *args: ``function``'s arguments.
        **kwargs: ``function``'s keyword arguments.

    """
    try:
        return function(*args, **kwargs)
    except SystemExit as stop:
        if stop.code not in exit_codes:
            raise
        if trainer is not None:
            import_module(f"{pl.__name__}.trainer.call")._interrupt(trainer, stop)
            trainer._teardown()
        code = int(stop.code)  # one of exit_codes
    for child in multiprocessing.active_children():
        child.terminate()
    for child in multiprocessing.active_children():
        child.join(timeout=5.0)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _ConvertingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess-script launcher (also used under torchrun and SLURM); the run's errors may be replaced.

    ``convert`` turns an error the run raised into the one to raise instead (or ``None``), before Lightning's
    ``on_exception`` hooks see it.
    """

    def __init__(self, launcher: Any, convert: Callable[[BaseException], BaseException | None]) -> None:
        self.__dict__.update(launcher.__dict__)
        self.convert = convert

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        wrapped = functools.partial(_run_converting, function, self.convert)
        return super().launch(wrapped, *args, trainer=trainer, **kwargs)


class _ExitCodeLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher; a rank that exits with a preemption code makes the main process exit with it.

    While the ranks run, the preemption signals the main process receives are passed on to them (it is no rank
    and has no checkpoint to write). In each rank, an error of the run may be replaced, as in
    :class:`_ConvertingScriptLauncher`, and a preemption stop ends the rank at once (:func:`exit_at_once_on_stop`).
    """

    def __init__(
        self,
        strategy: Any,
        start_method: Any,
        exit_codes: frozenset[int],
        signals: tuple[int, ...],
        convert: Callable[[BaseException], BaseException | None] | None = None,
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        self.exit_codes = exit_codes
        self.signals = signals
        self.convert = convert

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from torch.multiprocessing.spawn import ProcessExitedException

        if self.convert is not None:
            function = functools.partial(_run_converting, function, self.convert)
        function = functools.partial(exit_at_once_on_stop, function, self.exit_codes, trainer)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._pass_on) for sig in self.signals}
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as err:
            if err.exit_code in self.exit_codes:
                raise SystemExit(err.exit_code) from None  # each rank printed why it stopped
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _pass_on(self, signum: int, frame: Any) -> None:
        for process in getattr(self, "procs", []):
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)


def configure_launcher(
    strategy: Any,
    exit_codes: frozenset[int],
    signals: tuple[int, ...],
    convert: Callable[[BaseException], BaseException | None],
) -> None:
    """Replace the strategy's launcher by one that converts the run's errors (and, for spawn, passes on signals).

    The spawn launcher (``_MultiProcessingLauncher``) becomes :class:`_ExitCodeLauncher`: the main process exits
    with a rank's preemption code. The subprocess-script launcher becomes :class:`_ConvertingScriptLauncher`.
    """
    launcher = strategy._launcher
    if type(launcher) is _MultiProcessingLauncher:
        strategy._launcher = _ExitCodeLauncher(strategy, launcher._start_method, exit_codes, signals, convert)
    elif type(launcher) is _SubprocessScriptLauncher:
        strategy._launcher = _ConvertingScriptLauncher(launcher, convert)
