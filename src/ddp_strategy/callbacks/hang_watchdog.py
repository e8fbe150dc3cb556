"""``HangWatchdog``: turn a silent distributed hang into stack dumps, a cross-rank summary and a non-zero exit.

A rank that stops making progress (stuck in a collective, in its own code, or waiting for a rank that died)
would otherwise wait for the process-group timeout, 30 minutes by default, and then fail with a message that
names neither the culprit nor the place. With this callback, a thread on every rank watches the training
thread's progress (Lightning's batch, epoch, backward and optimizer hooks). When one rank sees none for
``timeout`` seconds, it raises an alarm in the rendezvous store; every rank that can still run Python then
writes the stacks of all its threads to a file and to stderr and publishes a short report; the lowest rank that
reported (rank 0 unless it is the one that is gone) prints a one-screen summary of where every rank is and which
ranks differ from the rest; and every rank exits with ``exit_code``.

This module holds the callback: its arguments, its life cycle and the watchdog thread. The hooks that count as
progress are in :mod:`.hang_progress`, what a rank does once the alarm is raised in :mod:`.hang_alarm`, and the
stack analysis and the summary's text in :mod:`.hang_report` (:func:`locate` and :func:`summarize` are
re-exported here).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from typing_extensions import override

from .._compat.lightning import pl, rank_zero_warn
from ..control import ControlPlane, Store, scaled_interval, to_timedelta
from ..peers import diagnose_failed_peers
from ..store import get_if_set
from .hang_alarm import PROCESS_KEY, TRIGGER_KEY, HangAlarm
from .hang_progress import ProgressHooks
from .hang_report import locate as locate  # re-exported (they were defined here)
from .hang_report import summarize as summarize

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]

#: The default exit code of every rank after a detected hang (the code ``timeout(1)`` uses).
HANG_EXIT_CODE = 124


class HangWatchdog(ProgressHooks):
    """Dump every rank's stacks and stop the job when a rank makes no progress for ``timeout`` seconds.

    Progress is any of Lightning's batch, epoch, backward, optimizer or checkpoint hooks on this rank. When a
    rank sees no progress for ``timeout`` seconds (stuck in a gloo/NCCL collective, in a barrier only some ranks
    called, in its own code such as an endless loop or sleep, or waiting for a rank that died), it raises an
    alarm through the rendezvous store of :class:`~ddp_strategy.SafeDDPStrategy`'s control plane. Then every rank
    whose watchdog thread can run

    1. writes the Python stack of each of its threads, with where it is and its last progress, to
       ``<dump_dir>/hang-rank<R>.txt`` and to stderr;
    2. publishes a short report (training step, last progress, where its training thread is waiting);

    the lowest rank that reported (rank 0 unless rank 0 is the one that is gone) prints a one-screen summary:
    each place ranks are at (barrier name and call site, collective, training step), ranks without a report
    with their last published position and heartbeat, and which ranks differ from the rest; and every rank
    exits with ``exit_code`` (``os._exit`` after flushing), so the launcher returns non-zero instead of waiting
    for the process-group timeout. A rank that reported nothing within ``grace_period`` and still runs on the
    summarising rank's host (frozen without running Python) is killed.

    When the training thread fails with an exception instead (gloo notices a dead peer at once), the callback
    names peers that failed first or whose heartbeat has stopped, since the backend's error names only an address
    (:func:`~ddp_strategy.peers.diagnose_failed_peers`, shared with ``SafeDDPStrategy``: one message per failure).

    Without ``SafeDDPStrategy`` (or with one process) the watchdog still dumps this rank's stacks and exits.

    Args:
        timeout: seconds (or a ``timedelta``) without progress on a rank before the alarm. Set it well above
            the longest legitimate gap between two hooks (a checkpoint write, the first batch of a slow
            dataloader, a long validation ``setup``).
        dump_dir: where the per-rank stack files go. Default: ``<trainer.default_root_dir>/hang_dumps``.
        grace_period: seconds the ranks wait for each other's reports after the alarm before the summary.
        exit_code: the exit code of every rank after a hang (1-255). Default: 124.
        poll_interval: seconds between two checks of the watchdog thread. Default: ``min(1, timeout / 4)``.

    Raises:
        ValueError: an argument is not a positive number (``exit_code``: not an integer in 1-255).

    """

    def __init__(
        self,
        timeout: float | timedelta = 600.0,
        *,
        dump_dir: str | os.PathLike[str] | None = None,
        grace_period: float = 10.0,
        exit_code: int = HANG_EXIT_CODE,
        poll_interval: float | None = None,
    ) -> None:
        self.timeout = to_timedelta(timeout, name="timeout").total_seconds()
        self.grace_period = to_timedelta(grace_period, name="grace_period").total_seconds()
        if not isinstance(exit_code, int) or isinstance(exit_code, bool) or not 1 <= exit_code <= 255:
            raise ValueError(f"`exit_code` must be an integer from 1 to 255 (non-zero), got {exit_code!r}.")
        self.exit_code = exit_code
        self.poll_interval = (
            min(1.0, self.timeout / 4)
            if poll_interval is None
            else to_timedelta(poll_interval, name="poll_interval").total_seconds()
        )
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self._note("setup")
        self._stop = threading.Event()
        self._firing = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainer: pl.Trainer | None = None
        self._control: ControlPlane | None = None
        self._store: Store | None = None
        self._rank = 0
        self._world_size = 1
        self._folder = Path("hang_dumps")

    def __getstate__(self) -> dict[str, Any]:
        # The spawn launcher pickles the Trainer with its callbacks: leave the thread, events and store behind.
        state = dict(self.__dict__)
        for name in ("_stop", "_firing", "_thread", "_trainer", "_control", "_store"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop, self._firing = threading.Event(), threading.Event()
        self._thread = self._trainer = self._control = self._store = None

    # ------------------------------------------------------------------ life cycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disarm()
        control = getattr(trainer.strategy, "control_plane", None)
        self._control = control if isinstance(control, ControlPlane) else None
        self._trainer = trainer
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._folder = self.dump_dir if self.dump_dir is not None else Path(trainer.default_root_dir) / "hang_dumps"
        self._store = None
        if self._control is not None and self._control.world_size > 1:
            self._store = self._control.connect()
            process = {"host": socket.gethostname(), "pid": os.getpid()}
            self._store.set(PROCESS_KEY.format(rank=self._rank), json.dumps(process))
        elif trainer.world_size > 1:
            rank_zero_warn(
                "HangWatchdog coordinates ranks through SafeDDPStrategy's control plane, which this run does not "
                f"have ({type(trainer.strategy).__name__}); each rank will only dump its own stacks and exit."
            )
        self._stop = threading.Event()
        self._note("setup")
        self._thread = threading.Thread(
            target=self._watch, name=f"ddp_strategy-hang-watchdog-rank{self._rank}", daemon=True
        )
        self._thread.start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disarm()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()  # the strategy's teardown (its own timeouts) follows; nothing left to watch

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._disarm()
        else:
            self._note("on_validation_end")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._firing.is_set():
            # The watchdog is dumping and will exit the process; returning would let this rank exit on the error
            # first, and a launcher may then kill the rank that is printing the summary.
            time.sleep(2 * self.grace_period + 5.0)
        armed = self._thread is not None
        self._disarm()
        if armed and self._control is not None:
            # The backend's error names an address, not a rank: name the peers that failed or are gone. Shared
            # with SafeDDPStrategy.on_exception (called after this): one wait and one message per failure.
            diagnose_failed_peers(self._control, exception)

    def _disarm(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the watchdog thread
    def _watch(self) -> None:
        stop, store = self._stop, self._store
        # the look at the store for another rank's alarm: one read, paced like the heartbeat beyond 512 ranks
        look_every, next_look = scaled_interval(self.poll_interval, self._world_size), 0.0
        while not stop.wait(self.poll_interval):
            idle = time.monotonic() - self._progress_at
            if idle > self.timeout:
                reason = (
                    f"rank {self._rank} made no progress for {idle:.1f} s (timeout {self.timeout:g} s; "
                    f"last progress: {self._progress_what})"
                )
                if stop.is_set():
                    return
                self._fire(reason, raise_alarm=True)
                return
            if store is None or time.monotonic() < next_look:
                continue
            next_look = time.monotonic() + look_every
            try:
                alarm = get_if_set(store, TRIGGER_KEY)
            except Exception:  # the store is gone (rank 0 exited or died): only this rank's own progress counts now
                continue
            if alarm is not None and not stop.is_set():
                self._fire(alarm.decode(), raise_alarm=False)
                return

    def _fire(self, reason: str, *, raise_alarm: bool) -> None:
        """Dump, exchange reports, summarise, exit (:class:`.HangAlarm`). Runs on the watchdog thread; never returns."""
        self._firing.set()
        trainer = self._trainer
        alarm = HangAlarm(
            rank=self._rank,
            world_size=self._world_size,
            control=self._control,
            store=self._store,
            folder=self._folder,
            exit_code=self.exit_code,
            grace_period=self.grace_period,
            step=lambda: int(trainer.global_step) if trainer is not None else -1,
            progress=lambda: (self._progress_at, self._progress_what),
            emit=self._emit,
        )
        alarm.sound(reason, raise_alarm=raise_alarm)

    @staticmethod
    def _emit(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
